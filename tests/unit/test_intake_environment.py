"""The environment `grove init` drafts from the dependency files it finds."""

from __future__ import annotations

from agents import intake
from agents.spec import ENV_INPUTS, parse_spec

EVALUATE = 'import json\nprint(json.dumps({"score": 1}))\n'
SCRIPT = """\
# /// script
# requires-python = ">=3.11"
# dependencies = ["numpy>=1.26", "pyyaml"]
# ///
import argparse
parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.01)
print("loss:", parser.parse_args().lr)
"""


def test_inline_script_metadata_is_installed_and_keys_the_build() -> None:
    c = intake.draft({"train.py": SCRIPT, "data/x.csv": "1\n2\n3\n"}, "x", "lower the loss")
    assert c.setup.endswith("\"$GROVE_ENV/bin/pip\" install 'numpy>=1.26' pyyaml")
    spec = parse_spec(intake.render(c))
    assert spec.environment.inputs == [*ENV_INPUTS, "train.py"] and spec.environment.network
    assert intake.inline_dependencies("# /// script\n# dependencies = [\n#   'torch',\n# ]\n# ///\n") == [
        "torch"
    ]
    assert intake.inline_dependencies("import torch\n") is None


def test_a_conda_environment_file_is_built_with_micromamba_or_conda_or_says_it_cannot() -> None:
    files = {"environment.yaml": "name: x\ndependencies:\n  - numpy\n", "evaluate.py": EVALUATE}
    c = intake.draft(files, "x", "")
    assert 'micromamba create -y -q -p "$GROVE_ENV" -f environment.yaml' in c.setup
    assert 'conda env create -q -p "$GROVE_ENV" -f environment.yaml' in c.setup
    assert "neither is installed" in c.setup and c.setup.endswith("exit 127; fi")
    spec = parse_spec(intake.render(c))
    assert "environment.yaml" in spec.environment.inputs
    both = intake.draft({**files, "requirements.txt": "numpy\n"}, "x", "")
    assert "micromamba" in both.setup  # the conda file is the whole environment; pip's list is part of it


def test_well_known_categorical_knobs_are_drafted_with_their_alternatives() -> None:
    params = (
        "model:\n  optimizer: adam\n  activation: relu\n  name: foo\n  lr: 0.001\ntree:\n  criterion: gini\n"
    )
    c = intake.draft({"evaluate.py": EVALUATE, "params.yaml": params}, "x", "")
    assert c.search["params.yaml:model.optimizer"] == {"values": ["adam", "adamw", "sgd", "rmsprop"]}
    assert c.search["params.yaml:model.activation"] == {"values": ["relu", "gelu", "tanh", "silu"]}
    assert c.search["params.yaml:tree.criterion"] == {"values": ["gini", "entropy", "log_loss"]}
    assert "params.yaml:model.name" not in c.search  # not a knob Grove knows the alternatives of
    parse_spec(intake.render(c))


def test_layer_size_lists_are_drafted_as_halved_kept_and_doubled() -> None:
    params = "model:\n  hidden_dims: [64, 32]\n  milestones: [30, 60]\n"
    c = intake.draft({"evaluate.py": EVALUATE, "params.yaml": params}, "x", "")
    assert c.search["params.yaml:model.hidden_dims"] == {"values": [[32, 16], [64, 32], [128, 64]]}
    assert "params.yaml:model.milestones" not in c.search  # not named like a size
    parse_spec(intake.render(c))
