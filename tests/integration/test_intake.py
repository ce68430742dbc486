"""`grove init`: a public-style repository becomes a study whose drafted spec validates and runs."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from backend.core.config import Settings
from tests.integration.test_study import grove
from tests.support.repos import make_repo

EVALUATE = """\
import argparse, json, os, re

parser = argparse.ArgumentParser()
parser.add_argument("--split", choices=["dev", "test"], required=True)
split = parser.parse_args().split
ml = open("MLproject").read()
alpha = float(re.search(r"alpha: \\{type: float, default: ([^}]+)\\}", ml).group(1))
lr = float(re.search(r"lr: ([0-9.e+-]+)", open("params.yaml").read()).group(1))
rows = open("data/test/test.csv" if split == "test" else "data/dev.csv").read().split()
rmse = abs(alpha - 0.3) + abs(lr - 0.01) * 10 + 0.001 * len(rows)
print(json.dumps({"rmse": rmse}))
"""

FILES = {
    "README.md": "# wine quality\n\nElasticNet on the wine data; `python evaluate.py --split dev`.\n",
    "MLproject": (
        "name: wine\n# MLflow entry point\nentry_points:\n  main:\n    parameters:\n"
        "      alpha: {type: float, default: 0.5}\n    command: python train.py {alpha}\n"
    ),
    "params.yaml": "train:\n  lr: 1e-3   # learning rate\n  seed: 7\n",
    "evaluate.py": EVALUATE,
    "requirements.txt": "# nothing beyond the standard library\n",
    "data/dev.csv": "1\n2\n3\n",
    "data/test/test.csv": "4\n5\n",
    "tests/test_smoke.py": "def test_ok():\n    assert True\n",
}


def test_init_drafts_a_spec_that_validates_and_runs_dev(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = make_repo(tmp_path / "wine-quality", FILES)
    made = grove(settings, "init", str(repo), "--goal", "Lower the dev RMSE of the wine model")
    # init writes the draft, then checks it as validate does: its setup downloads packages, which
    # this server does not allow, so init says so and exits 1.
    failed = " ".join(made.stderr.split())
    assert made.returncode == 1 and "environment.network: this server does not give the setup step" in failed
    assert "the draft did not pass its check" in failed
    said = " ".join(made.stdout.split())
    assert "evaluator: evaluate.py" in said and "metric: 'rmse', minimized" in said
    spec = tomllib.loads((repo / "grove.toml").read_text())
    assert spec["study"]["name"] == "wine-quality"
    assert spec["objective"] == {"metric": "rmse", "direction": "minimize"}
    assert spec["evaluate"]["dev"] == "python evaluate.py --split dev"
    assert spec["evaluate"]["test"] == "python evaluate.py --split test"
    assert spec["files"]["sealed"] == ["data/test/**"]  # data that looks held out; tests/ is code
    assert spec["files"]["protected"] == ["evaluate.py", "data/**"]
    assert spec["files"]["formats"] == {"MLproject": "yaml"}
    assert spec["search"] == {
        "MLproject:entry_points.main.parameters.alpha.default": {"low": 0.005, "high": 50.0, "log": True},
        "params.yaml:train.lr": {"low": 1e-05, "high": 0.1, "log": True},
    }  # `seed` is no hyperparameter
    assert spec["environment"]["setup"].endswith('/bin/pip" install -r requirements.txt')
    again = grove(settings, "init", str(repo))
    assert again.returncode == 1 and "--force" in again.stderr
    # The setup downloads packages: only with the operator's leave.
    refused = grove(settings, "validate", str(repo))
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 1 and "environment.network: this server does not give the setup step" in said
    monkeypatch.setenv("GROVE_SANDBOX_NETWORK", "true")
    checked = grove(settings, "validate", str(repo))
    assert checked.returncode == 0, checked.stderr + checked.stdout
    assert "dev on base: rmse = " in checked.stdout
