"""CLI start-up: `grove submit --help` on this tree against an older tree and a bare interpreter.

The client commands (`grove submit`, `grove learn`, the token and memory commands ask the API or
the database only when they run) should start without the database layer, the engine or the
coordinator graph. Each command is timed `--repeat` times, alternating the trees, and the median
wall time is printed side by side; `python -X importtime` then names the largest imports of this
tree's start.

    python benchmarks/cli_start.py [--repeat 15] [--baseline REV]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "b934702"  # main before the CLI imported lazily
COMMAND = ["-m", "backend.cli.main", "submit", "--help"]


def timed(cmd: list[str], cwd: Path) -> float:
    """Return the wall time of one run of `cmd` in `cwd`."""
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def largest_imports(cwd: Path, top: int = 8) -> list[tuple[int, str]]:
    """Return the top-level imports of the command with the largest cumulative times (µs)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", *COMMAND], cwd=cwd, capture_output=True, text=True
    )
    rows = []
    for line in out.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit() and not parts[2].startswith("  "):
            rows.append((int(parts[1]), parts[2].strip()))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--baseline", default=BASELINE)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="grove-cli-start-") as tmp:
        old = Path(tmp) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "-q", "--detach", str(old), args.baseline], cwd=ROOT, check=True
        )
        try:
            runs: dict[str, list[float]] = {"python -c pass": [], "this tree": [], args.baseline: []}
            for _ in range(args.repeat):
                runs["python -c pass"].append(timed([sys.executable, "-c", "pass"], ROOT))
                runs["this tree"].append(timed([sys.executable, *COMMAND], ROOT))
                runs[args.baseline].append(timed([sys.executable, *COMMAND], old))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"`grove submit --help`, median of {args.repeat} runs each, alternated:\n")
    print("| command | median wall time |")
    print("|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v * 1000:.0f} ms |")
    print(f"\nthis tree / {args.baseline}: {med['this tree'] / med[args.baseline]:.2f}x")
    print("\nlargest top-level imports of this tree's start (cumulative, python -X importtime):")
    for us, name in largest_imports(ROOT):
        print(f"  {us / 1000:7.1f} ms  {name}")


if __name__ == "__main__":
    main()
