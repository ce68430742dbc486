"""The learning loop's curves on the CPU: on-policy SDPO rounds and router training, tiny sizes.

    python benchmarks/learning_loop.py [--rounds 8]

(1) An on-policy SDPO job (`learning.submit` + `learning.run`, as a gpu worker runs it) on a
    randomly initialised 1-layer GPT-2 with a byte tokenizer, two tasks whose checkers run in the
    sandbox: the checker's pass rate and the teacher–student divergence before and after each
    round's steps. A random tiny model is not expected to learn arithmetic; the divergence is what
    the steps minimise.
(2) A `sparse_train` job: needle recall of a fresh MSA layer's router before and after training,
    on documents it never saw.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from backend.core import db
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.models import LearningJob
from backend.engine import learning

sys.path.insert(0, str(PROJECT_ROOT))
from tests.support.learning import tiny_model_dir

TASKS = [
    {"prompt": "add two and two:", "check": "grep -q 4 answer.txt"},
    {"prompt": "write a digit:", "check": "grep -q '[0-9]' answer.txt"},
]


def run(settings: Settings, kind: str, params: dict[str, object]) -> dict[str, object]:
    """Submit and run one learning job here; return its result."""
    with db.session(settings.db_url) as s:
        job_id = learning.submit(s, kind, params).id or 0
    status = learning.run(settings, job_id)
    with db.session(settings.db_url) as s:
        job = s.get(LearningJob, job_id)
        assert job is not None
        if status != "done":
            raise SystemExit(f"{kind} job failed: {job.error}")
        return dict(job.result)


def main() -> None:
    """Print both curves."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="grove-learning-") as tmp:
        root = Path(tmp)
        settings = Settings(data_dir=root / "data", worktrees_dir=root / "wt")
        settings.ensure_dirs()
        tiny_model_dir(root / "lm")
        tasks = root / "tasks.jsonl"
        tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
        sdpo = run(settings, "distill", {
            "model": str(root / "lm"), "tasks": str(tasks), "on_policy": True, "rounds": args.rounds,
            "samples": 8, "steps": 8, "batch_size": 8, "max_new_tokens": 8, "lr": 3e-3, "beta": 0.5,
            "support": "full", "max_tokens": 256, "save_model": False,
        })  # fmt: skip
        print("(1) on-policy SDPO, tiny GPT-2, 2 tasks × 8 samples, 8 steps per round")
        print("| round | pass rate | divergence before | divergence after |\n|---|---|---|---|")
        rows = zip(sdpo["pass_rate"], sdpo["divergence_before"], sdpo["divergence_after"], strict=True)  # type: ignore[call-overload]
        for n, (rate, before, after) in enumerate(rows, 1):
            print(f"| {n} | {rate:.3f} | {before:.2e} | {after:.2e} |")
        router = run(settings, "sparse_train", {"docs": 32, "doc_len": 64, "pool": 16, "top_k": 2, "trials": 64,
                                                 "steps": 300, "save_model": False})  # fmt: skip
        print(
            "\n(2) needle recall of a fresh MSA layer, 32 documents of 64 tokens, top-2, 64 unseen episodes"
        )
        print(f"untrained {router['recall_before']:.3f} -> trained {router['recall_after']:.3f} "
              f"(routing loss {router['first_loss']:.2f} -> {router['last_loss']:.2f}, 300 steps)")  # fmt: skip


if __name__ == "__main__":
    main()
