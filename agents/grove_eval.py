"""Grove's evaluator adapter: run a repository's own entry point and print its metrics as JSON.

`grove init` copies this file into a repository as `grove_eval.py` (protected: no change edits
it) beside `grove/adapter.json`, which says how the repository is run. `python grove_eval.py dev`
and `python grove_eval.py test`:

1. mirror the tree in a scratch folder with symbolic links, where each data file `PATH` links
   to its split's copy (`grove/dev/PATH` or `grove/heldout/PATH`; the held-out copies and the
   originals are sealed, so only the gate's test runs have them);
2. run the entry point there (`command`, each `{name}` replaced by the value in the params file);
3. read the metrics it printed (`name: 0.91`, `name=0.91`, JSON lines) and any MLflow metrics it
   logged, and print them as one JSON line, names in lower case (`Val Acc` -> `val_acc`).

Standard library only: it runs under whatever interpreter the study's environment provides.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

NUMBER = r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?"
WORD = r"[A-Za-z][A-Za-z0-9_./-]*"
PAIR = re.compile(rf"(?<![\w.])({WORD}(?: {WORD}){{0,2}})\s*[:=]\s*({NUMBER})(?![\w.])")
SPLITS = {"dev": "grove/dev", "test": "grove/heldout"}


def name_of(raw: str) -> str:
    """Return a metric name as Grove keys it: lower case, runs of other characters as '_'."""
    return re.sub(r"[^a-z0-9]+", "_", raw.strip().lower()).strip("_")


def printed_metrics(text: str) -> dict[str, float]:
    """Return the numbers a run printed by name, the last value of each name winning."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                for k, v in obj.items():
                    if isinstance(v, int | float) and not isinstance(v, bool) and name_of(str(k)):
                        found[name_of(str(k))] = float(v)
                continue
        for m in PAIR.finditer(line):
            key = name_of(m.group(1))
            if key:
                found[key] = float(m.group(2))
    return found


def mlflow_metrics(store: Path) -> dict[str, float]:
    """Return the last value of each metric a run logged to an MLflow file store."""
    found: dict[str, float] = {}
    for path in sorted(store.glob("*/*/metrics/**/*")):
        fields = path.read_text(errors="replace").split() if path.is_file() else []
        if len(fields) >= 3:  # lines of "timestamp value step"
            try:
                found[name_of("/".join(path.relative_to(store).parts[3:]))] = float(fields[-2])
            except ValueError:
                continue
    return found


def command_of(config: dict[str, Any], root: Path) -> list[str]:
    """Return the entry point's command with the params file's values filled in."""
    values: dict[str, Any] = {}
    if config.get("params"):
        values = json.loads((root / config["params"]).read_text())

    def fill(token: str) -> str:
        return re.sub(r"\{(\w+)\}", lambda m: str(values.get(m.group(1), m.group(0))), token)

    argv = [fill(t) for t in config["command"]]
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def mirror(src: Path, dst: Path, swaps: dict[str, Path], rel: str = "") -> None:
    """Mirror `src` in `dst` with symbolic links, each path of `swaps` linked to its replacement.

    The repository's tree may be read-only (the gate's test runs), so the split's data is put in
    place in this mirror, never in the tree.
    """
    dst.mkdir(parents=True, exist_ok=True)
    inside = {p[len(rel) :] for p in swaps if p.startswith(rel)}
    firsts = {p.split("/")[0] for p in inside}
    for entry in sorted(src.iterdir()) if src.is_dir() and not src.is_symlink() else []:
        if entry.name not in firsts:
            (dst / entry.name).symlink_to(entry)
    for first in sorted(firsts):
        if first in inside:
            (dst / first).symlink_to(swaps[rel + first])
        else:
            mirror(src / first, dst / first, swaps, rel + first + "/")


def main(split: str) -> int:
    """Run the entry point on one split and print its metrics; return its exit status."""
    root = Path.cwd()
    config = json.loads((root / "grove/adapter.json").read_text())
    scratch = Path(tempfile.mkdtemp(prefix="grove-eval-"))
    try:
        swaps = {rel: root / SPLITS[split] / rel for rel in config.get("data", [])}
        for rel, source in swaps.items():
            if not source.is_file():
                print(f"grove_eval: {SPLITS[split]}/{rel} is missing for the {split} split", file=sys.stderr)
                return 2
        mirror(root, scratch / "tree", swaps)
        argv = command_of(config, root)
        if config.get("hydra"):
            argv += [f"hydra.run.dir={scratch / 'hydra'}", "hydra.output_subdir=null"]
        env = dict(os.environ, MLFLOW_TRACKING_URI=(scratch / "mlruns").as_uri(), PYTHONUNBUFFERED="1")
        run = subprocess.run(
            argv, cwd=scratch / "tree", env=env, capture_output=True, text=True, errors="replace"
        )
        sys.stderr.write(run.stdout[-20000:] + run.stderr[-20000:])
        if run.returncode != 0:
            print(f"grove_eval: {' '.join(argv)} exited with {run.returncode}", file=sys.stderr)
            return run.returncode
        # What it printed to stdout wins over stderr (library warnings, logging), MLflow's over both.
        printed = printed_metrics(run.stderr) | printed_metrics(run.stdout)
        metrics = printed | mlflow_metrics(scratch / "mlruns")
        print(json.dumps(metrics))
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in SPLITS:
        sys.exit("usage: python grove_eval.py dev|test")
    sys.exit(main(sys.argv[1]))
