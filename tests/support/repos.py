"""Test repositories: the tiny study's files, committed with the git CLI."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

TINY_EVAL = """\
import json, os, sys, time, tomllib
cfg = tomllib.load(open("config.toml", "rb"))
x = cfg["knob"]["x"]
seed = int(os.environ.get("GROVE_SEED", "0"))
time.sleep(float(cfg["knob"].get("sleep", 0)))
if sys.argv[1] == "dev":
    score = 10 - (x - 3) ** 2 + 0.01 * seed
else:
    offset = float(open("data/test/offset.txt").read())
    score = offset - (x - 3) ** 2 + 0.01 * seed
print("some log line")
print(json.dumps({"score": score, "size": x}))
"""


TINY_SPEC = """\
[study]
name = "{name}"
goal = "Push the score of the tiny knob up"

[objective]
metric = "score"
direction = "maximize"

[evaluate]
dev = "python eval.py dev"
test = "python eval.py test"
timeout = 60
repeats = 2

[files]
editable = ["config.toml"]
protected = ["eval.py"]
sealed = ["data/test/**"]

[[constraints]]
name = "small"
metric = "size"
max = {max_size}

[search]
"config.toml:knob.x" = {{ values = [0, 1, 2, 3, 4, 5] }}

[budget]
experiments = {experiments}
parallel = 2

[gate]
mode = "{mode}"
margin = {margin}
test_repeats = 2
max_test_runs = {max_test_runs}

[plateau]
warn = 3
change = 5
stop = {plateau_stop}

[policy]
kind = "search"
seed = 0
children = 2
"""


def git(*args: str, cwd: Path) -> str:
    """Run git in a test repository."""
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def make_repo(path: Path, files: dict[str, str]) -> Path:
    """Create a git repository with the given files committed on `main`."""
    path.mkdir(parents=True, exist_ok=True)
    git("init", "-q", "-b", "main", cwd=path)
    for rel, text in files.items():
        f = path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(text))
    git("add", "-A", cwd=path)
    git("commit", "-q", "-m", "init", cwd=path)
    return path


def tiny_files(name: str = "tiny", **kw: object) -> dict[str, str]:
    """Return the files of the tiny study repository."""
    params = {
        "name": name,
        "max_size": 4,
        "experiments": 6,
        "mode": "auto",
        "margin": 0.5,
        "max_test_runs": 10,
        "plateau_stop": 8,
    }
    params.update(kw)
    sleep = params.pop("sleep", 0)
    values = params.pop("values", None)  # the knob's values, else 0 to 5
    spec = TINY_SPEC.format(**params)
    if values is not None:
        spec = spec.replace("values = [0, 1, 2, 3, 4, 5]", f"values = {values}")
    return {
        "eval.py": TINY_EVAL,
        "config.toml": f"[knob]\nx = 0\nsleep = {sleep}\n",
        "data/test/offset.txt": "777.125\n",
        "grove.toml": spec,
    }
