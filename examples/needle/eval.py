"""Needle-in-documents recall of Grove's document-routed sparse attention after training its router.

Usage: python eval.py --split dev|test
A fresh attention layer's router is trained with the routing loss (`training` knobs) on needle
episodes, then routes queries to `memory.top_k` documents pooled in chunks of `memory.pool` tokens.
dev: GROVE_SEED picks the training seed and the dev documents; test: recall on the documents of
the sealed seeds in data/test/seeds.txt (absent from worktrees).
Prints {"recall": ..., "recall_untrained": ..., "kv_tokens": ..., "ms_per_query": ...}.
"""

import argparse
import json
import os
import tomllib
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from agents.learning.sparse_attention.needle import recall, train_router

TASK = {
    "docs": 32,
    "doc_len": 128,
    "noise": 1.0,
    "topic": 0.3,
    "topic_rank": 4,
    "trials": 32,
    "train_docs": 16,
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--split", choices=["dev", "test"], required=True)
    args = parser.parse_args()
    config = tomllib.loads(Path("config.toml").read_text())
    memory, training = config["memory"], config["training"]
    seed = int(os.environ.get("GROVE_SEED", "0"))
    if args.split == "dev":
        eval_seeds = [500 + seed]
    else:
        eval_seeds = [int(s) for s in Path("data/test/seeds.txt").read_text().split()]
    params = {
        **TASK,
        **memory,
        "lr": training["lr"],
        "steps": training["steps"],
        "tau": training["tau"],
        "seed": seed,
    }
    runs = [train_router({**params, "eval_seed": s}) for s in eval_seeds[:1]]
    trained = runs[0].pop("model")
    if len(eval_seeds) > 1:  # the same trained router on every sealed document set
        for s in eval_seeds[1:]:
            found, ms = recall(trained, params, s)
            runs.append({"recall_after": found, "ms_per_query": ms})
    chunks = -(-TASK["doc_len"] // memory["pool"])
    print(
        json.dumps(
            {
                "recall": round(sum(r["recall_after"] for r in runs) / len(runs), 6),
                "recall_untrained": runs[0]["recall_before"],
                "kv_tokens": min(memory["top_k"], TASK["docs"]) * chunks + 8,
                "ms_per_query": round(sum(r["ms_per_query"] for r in runs) / len(runs), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
