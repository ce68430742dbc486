"""What `grove validate` reads of a sealed-test command: the editable code it runs, or what it cannot tell."""

from __future__ import annotations

import json

import pytest

from agents.entrypoints import adapter_source
from agents.evalcode import findings
from agents.spec import parse_spec

SPEC = """\
[study]
name = "t"
goal = "g"
base = "main"
[objective]
metric = "score"
direction = "maximize"
[evaluate]
dev = "python eval.py"
{test}
[files]
editable = ["model.py", "pkg/**"]
protected = ["eval.py", "score.py", "run.sh"]
sealed = ["data/test/**"]
[budget]
experiments = 2
"""


def check(test: str, files: dict[str, str]) -> list[tuple[str, str, str]]:
    spec = parse_spec(SPEC.format(test=test))
    return findings(spec, list(files), files.__getitem__)


def test_python_m_of_an_editable_package_runs_its_main() -> None:
    files = {"pkg/__init__.py": "", "pkg/__main__.py": "print(1)\n", "eval.py": ""}
    out = check('test = "python -m pkg"', files)
    assert [level for _, _, level in out] == ["error"] and "pkg/__main__.py" in out[0][1]


@pytest.mark.parametrize(
    "code",
    [
        "import subprocess\nsubprocess.run(['python', 'model.py'])\n",
        "import os\nos.system('python model.py')\n",
        "eval(open('model.py').read())\n",
        "import importlib.util as u\nu.spec_from_file_location('m', 'model.py')\n",
        "import pickle\npickle.load(open('out/model.pkl', 'rb'))\n",
    ],
    ids=["subprocess.run", "os.system", "eval", "spec_from_file_location", "pickle.load"],
)
def test_a_scorer_that_runs_something_named_at_run_time_is_warned_about(code: str) -> None:
    out = check('test = "python eval.py"', {"eval.py": code, "model.py": ""})
    assert [(key, level) for key, _, level in out] == [("evaluate.test", "warning")]
    assert "cannot tell" in out[0][1]


def test_a_scorer_of_plain_imports_is_neither_refused_nor_warned_about() -> None:
    out = check('test = "python eval.py"', {"eval.py": "import json\nimport numpy\nprint(json.dumps({}))\n"})
    assert out == []


ADAPTER = 'test = "python grove_eval.py test"'


def _adapter_files(command: list[str], adapter: str | None = None) -> dict[str, str]:
    return {
        "grove_eval.py": adapter_source() if adapter is None else adapter,
        "grove/adapter.json": json.dumps({"entry": "argparse", "command": command}),
        "train.py": "import yaml\nprint(1)\n",
        "model.py": "",
        "config.yaml": "lr: 0.1\n",
    }


def test_groves_own_adapter_is_followed_to_the_command_its_settings_name() -> None:
    assert check(ADAPTER, _adapter_files(["python", "train.py", "config.yaml"])) == []
    out = check(ADAPTER, _adapter_files(["python", "model.py"]))
    assert [level for _, _, level in out] == ["error"] and "model.py" in out[0][1]


def test_an_edited_adapter_is_not_trusted_to_run_only_what_its_settings_say() -> None:
    edited = adapter_source() + "\n# changed\n"
    out = check(ADAPTER, _adapter_files(["python", "train.py"], edited))
    assert [(key, level) for key, _, level in out] == [("evaluate.test", "warning")]


def test_an_adapter_whose_settings_a_change_may_edit_is_not_trusted() -> None:
    spec = parse_spec(
        SPEC.format(test=ADAPTER).replace('editable = ["model.py", "pkg/**"]', 'editable = ["grove/*.json"]')
    )
    files = _adapter_files(["python", "train.py"])
    out = findings(spec, list(files), files.__getitem__)
    assert [(key, level) for key, _, level in out] == [("evaluate.test", "warning")]


def test_a_hydra_apps_editable_configs_count_as_code_unless_the_search_policy_edits_them() -> None:
    files = {
        **_adapter_files(["python", "app.py"]),
        "grove/adapter.json": json.dumps({"entry": "hydra", "command": ["python", "app.py"], "hydra": True}),
        "app.py": "import hydra\n",
        "conf/config.yaml": "lr: 0.1\n",
    }
    free = parse_spec(SPEC.format(test=ADAPTER).replace('"model.py", "pkg/**"', '"conf/**"'))
    out = findings(free, list(files), files.__getitem__)
    assert [level for _, _, level in out] == ["error"] and "conf/config.yaml" in out[0][1]
    searched = parse_spec(
        SPEC.format(test=ADAPTER).replace('"model.py", "pkg/**"', '"conf/**"')
        + '[search]\n"conf/config.yaml:lr" = { low = 0.01, high = 1.0, log = true }\n'
    )
    assert findings(searched, list(files), files.__getitem__) == []
