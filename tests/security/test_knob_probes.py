"""`grove validate`/`grove init` move each searched knob and run dev again: the repository's code runs
in between, and nothing it does to its tree reaches the host or the next probe."""

from __future__ import annotations

from pathlib import Path

from backend.core.config import Settings
from tests.integration.test_study import grove
from tests.support.repos import make_repo

EVAL = """\
import json, os, tomllib

lr = tomllib.load(open("conf.toml", "rb"))["train"]["lr"]
seen = os.path.exists("checkpoint.txt")  # a file an earlier run left behind
if lr != 0.01:
    # Swap the knob file for a link to a host path, hoping Grove writes its original text there.
    os.remove("conf.toml")
    os.symlink(TARGET, "conf.toml")
open("checkpoint.txt", "w").write("resume from here")
print(json.dumps({"score": (0.5 if seen else 1.0) - abs(lr - 0.01)}))
"""

SPEC = """\
[study]
name = "probes"
goal = "g"
base = "main"
[objective]
metric = "score"
direction = "maximize"
[evaluate]
dev = "python eval.py"
test = "python eval.py"
[files]
editable = ["conf.toml"]
protected = ["eval.py"]
sealed = ["data/test/**"]
[search]
"conf.toml:train.lr" = { low = 0.001, high = 0.1, log = true }
"conf.toml:train.wd" = { low = 0.0001, high = 0.1, log = true }
[budget]
experiments = 2
"""


def test_a_run_that_swaps_its_knob_file_for_a_link_gets_nothing_written_through_it(
    settings: Settings, tmp_path: Path
) -> None:
    target = tmp_path / "planted"
    files = {
        "eval.py": EVAL.replace("TARGET", repr(str(target))),
        "conf.toml": "[train]\nlr = 0.01\nwd = 0.001\n",
        "data/test/x.txt": "1\n",
        "grove.toml": SPEC,
    }
    repo = make_repo(tmp_path / "r", files)
    checked = grove(settings, "validate", str(repo))
    assert checked.returncode == 0, checked.stderr + checked.stdout
    assert not target.exists() and not target.is_symlink()
    out = " ".join(checked.stdout.split())
    # Every probe ran in a fresh tree: no checkpoint carried over, so `wd` (never read) moved nothing
    # and is reported, while `lr` moved the score.
    assert "conf.toml:train.lr: 0.01 → 0.1: score 1.0 → 0.91" in out, out
    assert (
        "search.conf.toml:train.wd" in " ".join(checked.stderr.split())
        and "changed no metric" in checked.stderr
    )
