"""The bundled examples: each spec checks out against its own folder, and each dev evaluation runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backend.core import gitops
from backend.core.config import PROJECT_ROOT
from backend.services.studies import check_spec, parse_spec
from tests.support.repos import git

EXAMPLES = PROJECT_ROOT / "examples"


@pytest.mark.parametrize("name", ["digits", "needle"])
def test_example_spec_holds_against_its_repository(name: str, tmp_path: Path) -> None:
    repo = tmp_path / name
    shutil.copytree(EXAMPLES / name, repo)
    git("init", "-q", "-b", "main", cwd=repo)
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "example", cwd=repo)
    spec = parse_spec((repo / "grove.toml").read_text(), f"examples/{name}/grove.toml")
    assert check_spec(spec, gitops.Repo(repo))


def test_needle_example_trains_its_router_and_measures_recall(tmp_path: Path) -> None:
    work = tmp_path / "needle"
    shutil.copytree(EXAMPLES / "needle", work)
    out = subprocess.run(
        [sys.executable, "eval.py", "--split", "dev"], cwd=work, env={**os.environ, "GROVE_SEED": "1"},
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    metrics = json.loads(out.stdout.strip().splitlines()[-1])
    assert metrics["kv_tokens"] == 2 * 8 + 8  # top_k · ⌈128 / pool⌉ + the query's 8
    assert metrics["recall"] > metrics["recall_untrained"]  # the router learned on documents it never saw
    shutil.rmtree(work / "data" / "test")  # sealed: a worktree has no test seeds
    gone = subprocess.run(
        [sys.executable, "eval.py", "--split", "test"], cwd=work, capture_output=True, check=False
    )
    assert gone.returncode != 0


def test_digits_predicts_without_the_labels_and_scores_with_them(tmp_path: Path) -> None:
    work = tmp_path / "digits"
    shutil.copytree(EXAMPLES / "digits", work)
    labels = (work / "data" / "test" / "labels.csv").read_text()
    (work / "data" / "test" / "labels.csv").unlink()  # the predict phase's box holds the inputs only
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    env = {**os.environ, "GROVE_SEED": "0", "GROVE_OUTPUTS": str(outputs)}
    subprocess.run(
        [sys.executable, "predict.py"], cwd=work, env=env, capture_output=True, timeout=120, check=True
    )
    assert len((outputs / "predictions.csv").read_text().split()) == len(labels.split())
    (work / "model.py").unlink()  # the score phase's box holds no editable file
    (work / "data" / "test" / "labels.csv").write_text(labels)
    out = subprocess.run(
        [sys.executable, "score.py"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    accuracy = json.loads(out.stdout.strip().splitlines()[-1])["accuracy"]
    assert 0.3 < accuracy <= 1.0  # the untuned model is well above chance (0.1)
