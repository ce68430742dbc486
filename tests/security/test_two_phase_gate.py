"""A candidate's code never runs beside the held-out labels: the two-phase sealed test.

An editable `model.py` that looks for the held-out labels and returns them gets a perfect score
when the sealed test is one command that imports it. With `test_predict` + `test_score`, the
model runs where the labels are absent and the protected scorer alone sees them: the gate
measures the honest score. `grove validate` refuses the one-command form of the same study.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlmodel import select
from typer.testing import CliRunner

from agents.spec import SpecError, parse_spec
from agents.tree.status import NodeStatus
from backend.cli.main import app as cli
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Node, ReceiptRow, Study
from backend.engine import evaluation, workspace
from backend.engine.gatekeeper import LocalGatekeeper
from backend.services.studies import create_study, validate
from tests.support.repos import git, make_repo

INPUTS = list(range(20))
LABELS = [x % 2 for x in INPUTS]  # an honest model that answers 0 scores 0.5

SPEC = """\
[study]
name = "{name}"
goal = "Classify the parity of a number"

[objective]
metric = "accuracy"
direction = "maximize"
bounds = [0, 1]

[evaluate]
dev = "python eval.py"
{test}
timeout = 60
repeats = 2

[files]
editable = ["model.py"]
protected = ["eval.py", "predict.py", "score.py", "data/dev.csv"]
sealed = ["data/test/**"]

[budget]
experiments = 4
usd = 0

[gate]
mode = "auto"
test_repeats = 2

[policy]
kind = "llm"
model = "openai/none"
"""
TWO_PHASE = """test_predict = "python predict.py"
test_score = "python score.py"
test_inputs = ["data/test/inputs.csv"]"""
ONE_COMMAND = 'test = "python eval_test.py"'

HONEST_MODEL = "def predict(xs):\n    return [0 for _ in xs]\n"
# Looks wherever the labels could be (its tree, the box's tree, next to its outputs) and returns them.
CHEATING_MODEL = """\
import os

PLACES = ["data/test/labels.csv", "/grove/tree/data/test/labels.csv",
          os.path.join(os.environ.get("GROVE_OUTPUTS", "."), "..", "data", "test", "labels.csv")]


def predict(xs):
    for place in PLACES:
        if os.path.exists(place):
            return [int(v) for v in open(place).read().split()[1:]]
    return [0 for _ in xs]
"""
# Points the scorer at the labels: a link named as the predictions, to where the scorer's tree holds them.
LINKING_MODEL = """\
import os


def predict(xs):
    os.symlink("../data/test/labels.csv", os.path.join(os.environ["GROVE_OUTPUTS"], "predictions.csv"))
    return None
"""

FILES = {
    "model.py": HONEST_MODEL,
    "eval.py": (
        "import json, model\n"
        "rows = [l.split(',') for l in open('data/dev.csv').read().split()[1:]]\n"
        "xs, ys = [int(r[0]) for r in rows], [int(r[1]) for r in rows]\n"
        "print(json.dumps({'accuracy': sum(p == y for p, y in zip(model.predict(xs), ys)) / len(ys)}))\n"
    ),
    "eval_test.py": (
        "import json, model\n"
        "xs = [int(v) for v in open('data/test/inputs.csv').read().split()[1:]]\n"
        "ys = [int(v) for v in open('data/test/labels.csv').read().split()[1:]]\n"
        "print(json.dumps({'accuracy': sum(p == y for p, y in zip(model.predict(xs), ys)) / len(ys)}))\n"
    ),
    "predict.py": (
        "import os, model\n"
        "xs = [int(v) for v in open('data/test/inputs.csv').read().split()[1:]]\n"
        "out = os.path.join(os.environ['GROVE_OUTPUTS'], 'predictions.csv')\n"
        "ys = model.predict(xs)\n"
        "if ys is not None:\n"
        "    open(out, 'w').write('label\\n' + ''.join(f'{y}\\n' for y in ys))\n"
    ),
    "score.py": (
        "import json, os, sys\n"
        "truth = open('data/test/labels.csv').read().split()[1:]\n"
        "try:\n"
        "    got = open(os.path.join(os.environ['GROVE_OUTPUTS'], 'predictions.csv')).read().split()[1:]\n"
        "except OSError as exc:\n"
        "    sys.exit(f'no predictions: {exc}')\n"
        "print(json.dumps({'accuracy': sum(p == t for p, t in zip(got, truth)) / len(truth)}))\n"
    ),
    "data/dev.csv": "x,label\n" + "".join(f"{x},{x % 2}\n" for x in range(100, 110)),
    "data/test/inputs.csv": "x\n" + "".join(f"{x}\n" for x in INPUTS),
    "data/test/labels.csv": "label\n" + "".join(f"{y}\n" for y in LABELS),
}


def repository(root: Path, name: str, test: str) -> Path:
    return make_repo(root / name, {**FILES, "grove.toml": SPEC.format(name=name, test=test)})


def gate_with_model(settings: Settings, repo: Path, model: str) -> Node:
    """Create the study, measure its baseline, and gate a node whose only change is `model`."""
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
        s.flush()
        s.refresh(study)
        s.expunge(study)
    keeper = LocalGatekeeper(settings)
    keeper.baseline(study.id or 0)
    clone = Path(study.repo_path)
    branch = f"grove/{study.name}/n2"
    git("branch", branch, study.trunk_commit, cwd=clone)
    tree = workspace.prepare(workspace.repo_of(study), settings.worktrees_dir / "n2", branch, study.trunk_commit,
                             sealed=["data/test/**"], reason="test")  # fmt: skip
    (tree / "model.py").write_text(model)
    commit = workspace.repo_of(study).commit_all(tree, "the model")
    workspace.repo_of(study).remove_worktree(tree)
    with db.session(settings.db_url) as s:
        node = Node(study_id=study.id or 0, parent_id=study.trunk_node_id, depth=1, number=2, title="model",
                    status=NodeStatus.EVALUATED, base_commit=study.trunk_commit, branch=branch, commit=commit or "")  # fmt: skip
        s.add(node)
        s.flush()
        node_id = node.id or 0
    keeper.gate(study.id or 0, node_id)
    with db.session(settings.db_url) as s:
        got = s.get(Node, node_id)
        assert got is not None
        s.expunge(got)
        return got


def test_the_cheating_model_reads_the_labels_in_a_one_command_test(
    settings: Settings, tmp_path: Path
) -> None:
    # The attack is real: evaluated the one-command way, beside the labels, it scores 1.0.
    repo = repository(tmp_path, "cheat-one", TWO_PHASE)
    (repo / "model.py").write_text(CHEATING_MODEL)
    r = evaluation.evaluate(
        kind="test", command="python eval_test.py", worktree=repo, output_dir=tmp_path / "out", seed=0,
        metric="accuracy", commit="x", limits=workspace.limits_of(parse_spec(SPEC.format(name="x", test=ONE_COMMAND))),
        evaluator_fingerprint="", isolation=workspace.isolation_of(settings),
    )  # fmt: skip
    assert r.ok and r.metrics == {"accuracy": 1.0}


def test_two_phases_give_the_honest_held_out_score(settings: Settings, tmp_path: Path) -> None:
    node = gate_with_model(settings, repository(tmp_path, "cheat-two", TWO_PHASE), CHEATING_MODEL)
    assert node.heldout_values == [0.5, 0.5]  # what answering 0 scores: the labels were not there
    assert node.status == NodeStatus.REJECTED and node.gate_reason.startswith("failed")
    with db.session(settings.db_url) as s:
        kinds = {r.kind for r in s.exec(select(ReceiptRow).where(ReceiptRow.node_id == node.id))}
        study = s.exec(select(Study).where(Study.name == "cheat-two")).one()
    assert kinds == {"test", "test-predict"}
    assert study.baseline_heldout == [0.5, 0.5]


def test_a_link_in_the_outputs_does_not_reach_the_labels(settings: Settings, tmp_path: Path) -> None:
    node = gate_with_model(settings, repository(tmp_path, "link-two", TWO_PHASE), LINKING_MODEL)
    assert node.heldout_values == [] and node.status == NodeStatus.REJECTED
    assert "did not run cleanly" in node.gate_reason
    with db.session(settings.db_url) as s:
        scored = s.exec(
            select(ReceiptRow).where(ReceiptRow.node_id == node.id, ReceiptRow.kind == "test")
        ).all()
    assert scored and not scored[0].ok and "no predictions" in scored[0].stderr_tail


def test_validate_refuses_the_one_command_form(tmp_path: Path) -> None:
    repo = repository(tmp_path, "one-command", ONE_COMMAND)
    with pytest.raises(SpecError) as info:
        validate((repo / "grove.toml").read_text(), str(repo))
    assert "evaluate.test" in str(info.value) and "model.py" in str(info.value)
    result = CliRunner().invoke(cli, ["validate", str(repo), "--static"])
    assert result.exit_code != 0
    assert "evaluate.test" in result.output and "test_predict" in result.output
    # The two-phase form of the same study passes.
    two = repository(tmp_path, "two-phase", TWO_PHASE)
    assert validate((two / "grove.toml").read_text(), str(two)).evaluate.two_phase
    # A scorer that imports the model is refused too.
    (two / "score.py").write_text("import model\n" + FILES["score.py"])
    git("commit", "-qam", "score imports the model", cwd=two)
    with pytest.raises(SpecError, match=r"evaluate\.test_score"):
        validate((two / "grove.toml").read_text(), str(two))


def test_the_digits_example_is_two_phase_and_valid() -> None:
    from backend.core.config import PROJECT_ROOT

    spec_text = (PROJECT_ROOT / "examples" / "digits" / "grove.toml").read_text()
    spec = parse_spec(spec_text, "grove.toml")
    assert spec.evaluate.two_phase and json.dumps(spec.evaluate.test_inputs) == '["data/test/inputs.csv"]'
