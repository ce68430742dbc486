"""Needle-in-documents recall of Grove's document-routed sparse attention under the config's knobs.

Usage: python eval.py --split dev|test
dev: GROVE_SEED picks the seed; test: the sealed seeds in data/test/seeds.txt (absent from worktrees).
Prints {"recall": ..., "kv_tokens": ..., "ms_per_query": ...}.
"""

import argparse
import json
import os
import tomllib
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from agents.learning.sparse_attention.needle import needle_recall

TASK = {"docs": 64, "doc_len": 256, "noise": 1.0, "topic": 0.3, "trials": 48}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--split", choices=["dev", "test"], required=True)
    args = parser.parse_args()
    memory = tomllib.loads(Path("config.toml").read_text())["memory"]
    if args.split == "dev":
        seeds = [int(os.environ.get("GROVE_SEED", "0"))]
    else:
        seeds = [int(s) for s in Path("data/test/seeds.txt").read_text().split()]
    runs = [
        needle_recall(
            {**TASK, "top_k": memory["top_k"], "pool": memory["pool"], "ssmax": memory["ssmax"], "seed": s}
        )
        for s in seeds
    ]
    print(
        json.dumps(
            {
                "recall": round(sum(r["recall"] for r in runs) / len(runs), 6),
                "kv_tokens": runs[0]["kv_tokens"],
                "ms_per_query": round(sum(r["ms_per_query"] for r in runs) / len(runs), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
