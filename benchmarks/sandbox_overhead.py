"""Cost of the sandbox: one trivial evaluation boxed (bubblewrap) vs unboxed, side by side in one run.

Runs the same evaluation (`python -c` printing a metrics line) through `evaluation.evaluate`
alternately with `GROVE_SANDBOX=bwrap` and `none`, on the same tree, and prints the median
wall time of each and their ratio. A shell `true` is timed the same way, to show the fixed
cost of a box apart from Python's start-up.

    python benchmarks/sandbox_overhead.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from backend.engine import evaluation, sandbox

EVAL = "python -c 'import json; print(json.dumps({\"score\": 1.0}))'"


def timed(command: str, tree: Path, iso: sandbox.Isolation, kind: str) -> float:
    """Return the wall time of one run of `command` on `tree`."""
    start = time.perf_counter()
    if kind == "eval":
        r = evaluation.evaluate(
            kind="dev", command=command, worktree=tree, output_dir=tree.parent / "out", seed=0,
            metric="score", commit="bench", limits=sandbox.Limits(timeout=60), evaluator_fingerprint="",
            isolation=iso,
        )  # fmt: skip
        assert r.ok, r.reason
    else:
        res = sandbox.run(command, cwd=tree, output_dir=tree.parent / "out", isolation=iso)
        assert res.ok, res.stderr_tail
    return time.perf_counter() - start


def main() -> None:
    """Print boxed vs unboxed medians and ratios."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    boxed, plain = sandbox.Isolation(), sandbox.Isolation(mode="none")
    sandbox.check(boxed)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        for i in range(200):  # a small repository's worth of files, handed to the box's uid and back
            (tree / f"f{i}.txt").write_text("x" * 100)
        print(f"{'run':<22}{'unboxed ms':>12}{'boxed ms':>12}{'ratio':>8}{'+ms':>8}")
        for label, command, kind in (("shell `true`", "true", "run"), ("trivial evaluation", EVAL, "eval")):
            times: dict[str, list[float]] = {"none": [], "bwrap": []}
            for _ in range(args.repeats):
                times["none"].append(timed(command, tree, plain, kind))
                times["bwrap"].append(timed(command, tree, boxed, kind))
            a, b = statistics.median(times["none"]) * 1000, statistics.median(times["bwrap"]) * 1000
            print(f"{label:<22}{a:>12.1f}{b:>12.1f}{b / a:>8.2f}{b - a:>8.1f}")


if __name__ == "__main__":
    main()
