"""Config files as real repositories have them, tuned by a whole study with real git and job processes.

An extension-less YAML file (`MLproject`) read through a format override, one dimension written to
two files, a Hydra defaults-list choice, and `lr: 1e-3` searched as a float: every experiment's
change is the changed values' characters only, with comments, order and quoting kept.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from sqlmodel import select

from agents import configfiles
from agents.policies.space import fmt
from backend.cli.runner import run_study
from backend.core import db, gitops
from backend.core.config import Settings
from backend.core.models import Node, Study
from backend.services.studies import create_study, validate
from tests.support.repos import make_repo

MLPROJECT = """\
name: wine-quality
# The MLflow entry point; its defaults are what `mlflow run .` uses.
entry_points:
  main:
    parameters:
      alpha: {type: float, default: 0.5}   # ElasticNet mixing
      l1_ratio: {type: float, default: 0.1}
    command: "python train.py {alpha} {l1_ratio}"
"""

PARAMS = """\
train:
  alpha: 0.5  # keep in step with MLproject
"""

HYDRA = """\
# Hydra primary config
defaults:
  - model: mlp   # the model group
  - _self_

train:
  lr: 1e-3   # learning rate
  epochs: 3
"""

EVAL = """\
import json, os, re, sys
ml = open("MLproject").read()
alpha = float(re.search(r"alpha: \\{type: float, default: ([^}]+)\\}", ml).group(1))
alpha2 = float(re.search(r"alpha: ([0-9.e+-]+)", open("params.yaml").read()).group(1))
assert alpha == alpha2, (alpha, alpha2)
cfg = open("conf/config.yaml").read()
model = re.search(r"- model: (\\w+)", cfg).group(1)
lr = float(re.search(r"lr: ([0-9.e+-]+)", cfg).group(1))
seed = int(os.environ.get("GROVE_SEED", "0"))
score = -abs(alpha - 0.2) + (0.5 if model == "cnn" else 0.0) - abs(lr - 0.004) * 10 + 0.001 * seed
if sys.argv[1] == "test":
    score += float(open("data/test/shift.txt").read())
print(json.dumps({"score": score}))
"""

SPEC = """\
[study]
name = "configs"
goal = "Tune a repository whose configs are YAML without a suffix, in two places, and Hydra groups"

[objective]
metric = "score"
direction = "maximize"

[evaluate]
dev = "python eval.py dev"
test = "python eval.py test"
timeout = 60
repeats = 2

[files]
editable = ["MLproject", "params.yaml", "conf/config.yaml"]
protected = ["eval.py"]
sealed = ["data/test/**"]
formats = { "MLproject" = "yaml" }

[search]
alpha = { low = 0.05, high = 0.9, targets = ["MLproject:entry_points.main.parameters.alpha.default", "params.yaml:train.alpha"] }
"conf/config.yaml:defaults.model" = { values = ["mlp", "cnn"] }
"conf/config.yaml:train.lr" = { low = 1e-4, high = 1e-2, log = true }

[budget]
experiments = 8
parallel = 2

[gate]
mode = "auto"
margin = 0.01
test_repeats = 2

[policy]
kind = "search"
seed = 0
"""


def repository(tmp_path: Path) -> Path:
    return make_repo(
        tmp_path / "configs",
        {
            "MLproject": MLPROJECT,
            "params.yaml": PARAMS,
            "conf/config.yaml": HYDRA,
            "eval.py": EVAL,
            "data/test/shift.txt": "0.0\n",
            "grove.toml": SPEC,
        },
    )


def changed_lines(old: str, new: str) -> list[tuple[str, str]]:
    """Return the (old, new) line pairs of a change that only rewrites lines in place."""
    gone = [line for line in difflib.ndiff(old.splitlines(), new.splitlines()) if line.startswith("- ")]
    came = [line for line in difflib.ndiff(old.splitlines(), new.splitlines()) if line.startswith("+ ")]
    assert len(gone) == len(came), (old, new)
    return [(a[2:], b[2:]) for a, b in zip(gone, came, strict=True)]


def test_study_tunes_suffixless_yaml_two_targets_hydra_choice_and_float_lr(
    settings: Settings, tmp_path: Path
) -> None:
    repo = repository(tmp_path)
    spec = validate(SPEC, str(repo))
    assert spec.study.base == "HEAD" and spec.targets("alpha")[1] == ("params.yaml", "train.alpha")
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, SPEC, str(repo))
        assert study.base_values == {
            "alpha": 0.5,
            "conf/config.yaml:defaults.model": "mlp",
            "conf/config.yaml:train.lr": 0.001,
        }
    assert run_study(settings, study.id or 0, approver=lambda s, n: {"approved": True}) == "finished"
    with db.session(settings.db_url) as s:
        st = s.get(Study, study.id)
        assert st is not None
        nodes = [n for n in s.exec(select(Node).where(Node.study_id == study.id)) if n.parent_id and n.commit]
    git = gitops.Repo(Path(st.repo_path))
    assert len(nodes) >= 4
    seen_model, seen_lr, seen_alpha = False, False, False
    titled = 0
    for n in nodes:
        lr = n.edits["conf/config.yaml:train.lr"]
        assert isinstance(lr, float) and 1e-4 <= lr <= 1e-2
        for file in ("MLproject", "params.yaml", "conf/config.yaml"):
            old, new = git.read_at(n.base_commit, file), git.read_at(n.commit, file)
            pairs = changed_lines(old, new)
            # Comments and every untouched line are kept; a changed line keeps its comment.
            assert [line for line in old.splitlines() if line.lstrip().startswith("#")] == [
                line for line in new.splitlines() if line.lstrip().startswith("#")
            ]
            for before, after in pairs:
                assert before.split(":")[0] == after.split(":")[0]  # the same key, in place
                assert ("#" in before) == ("#" in after)
                assert before.split("#")[1:] == after.split("#")[1:]
        ml, params = git.read_at(n.commit, "MLproject"), git.read_at(n.commit, "params.yaml")
        alpha = configfiles.get_key("MLproject", ml, "entry_points.main.parameters.alpha.default", "yaml")
        assert alpha == configfiles.get_key("params.yaml", params, "train.alpha") == n.edits["alpha"]
        hydra_old, hydra_new = (
            git.read_at(n.base_commit, "conf/config.yaml"),
            git.read_at(n.commit, "conf/config.yaml"),
        )
        for before, after in changed_lines(hydra_old, hydra_new):
            seen_lr |= before.strip().startswith("lr: ")
            seen_model |= before.strip().startswith("- model: ") and after.strip() in (
                "- model: cnn   # the model group",
                "- model: mlp   # the model group",
            )
        seen_alpha |= bool(changed_lines(git.read_at(n.base_commit, "MLproject"), ml))
        # The title names each key the commit really changed, with its old and new value.
        moved = []
        for key in sorted(n.edits):
            was = fmt(spec.value_at(key, lambda f, n=n: git.read_followed(n.base_commit, f)))
            now = fmt(spec.value_at(key, lambda f, n=n: git.read_followed(n.commit, f)))
            moved += [f"{key} {was} → {now}"] if was != now else []
        assert not moved or n.title == ", ".join(moved)
        titled += bool(moved)
    assert seen_lr and seen_model and seen_alpha and titled >= 4
    assert any(n.edits["conf/config.yaml:defaults.model"] == "cnn" for n in nodes)  # the choice was searched
