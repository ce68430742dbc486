"""Every distillation parameter combination either runs or is refused at submission, naming the field."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from backend.core import db
from backend.core.config import Settings
from backend.engine import learning
from tests.support.learning import records, tiny_model_dir


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Settings, dict[str, Any]]:
    root = tmp_path_factory.mktemp("params")
    settings = Settings(data_dir=root / "data", worktrees_dir=root / "wt")
    settings.ensure_dirs()
    tiny_model_dir(root / "lm")
    data = root / "trajectories.jsonl"
    # Two rollouts of one prompt, so CANON has a majority to take on the stored records too.
    rows = [*records(), {**records()[1], "rollout": " 4"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = root / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": "say 4:", "check": "grep -q 4 answer.txt"}) + "\n")
    base = {"model": str(root / "lm"), "steps": 1, "batch_size": 2, "max_tokens": 128, "save_model": False}
    return settings, {"base": base, "data": str(data), "tasks": str(tasks)}


def submit(settings: Settings, params: dict[str, Any]) -> int:
    with db.session(settings.db_url) as s:
        return learning.submit(s, "distill", params).id or 0


def refused(settings: Settings, params: dict[str, Any]) -> str:
    with pytest.raises(learning.LearningJobError) as err, db.session(settings.db_url) as s:
        learning.submit(s, "distill", params)
    return str(err.value)


def test_every_accepted_combination_runs(setup: tuple[Settings, dict[str, Any]]) -> None:
    settings, f = setup
    ran, refusals = 0, set()
    combos = itertools.product(
        ("sdpo", "canon"), (None, "ema", "trust_region", "frozen"), (False, True), (False, True),
        (("full", 0.5), ("topk", 0.0), ("sampled", 1.0), ("sampled", 0.5)),
    )  # fmt: skip
    for method, teacher, opsa, on_policy, (support, beta) in combos:
        params = {**f["base"], "method": method, "opsa": opsa, "on_policy": on_policy, "support": support,
                  "beta": beta, "trajectories": f["data"]}  # fmt: skip
        if teacher is not None:
            params["teacher"] = teacher
        if on_policy:
            params.update(rounds=1, samples=2, max_new_tokens=4)
        try:
            with db.session(settings.db_url) as s:
                job_id = learning.submit(s, "distill", params).id or 0
        except learning.LearningJobError as exc:
            refusals.add(str(exc).split(":")[0])
            continue
        status = learning.run(settings, job_id)
        with db.session(settings.db_url) as s:
            job = s.get(learning.LearningJob, job_id)
            assert job is not None
            assert status == "done", (params, job.error)
        ran += 1
    # SDPO with any teacher, CANON with the frozen one (unset or named); × OPSA × on-policy × 3 supports.
    assert ran == 4 * 2 * 2 * 3 + 2 * 2 * 2 * 3
    assert refusals == {"params.teacher", "params.beta"}


def test_bad_combinations_are_refused_naming_the_field(setup: tuple[Settings, dict[str, Any]]) -> None:
    settings, f = setup
    base, data = f["base"], f["data"]
    cases = {
        "params.teacher": {"method": "canon", "teacher": "ema", "trajectories": data},
        "params.beta": {"support": "sampled", "beta": 0.5, "trajectories": data},
        "params.opsa_weight": {"opsa_weight": 0.3, "trajectories": data},
        "params.opsa_a_min": {"opsa": True, "opsa_a_min": -0.1, "opsa_a_max": -0.5, "trajectories": data},
        "params.rounds": {"rounds": 2, "trajectories": data},
        "params.tasks": {"tasks": f["tasks"], "trajectories": data, "on_policy": True},
        "params.samples": {"method": "canon", "on_policy": True, "samples": 1, "trajectories": data},
        "params.mode": {"mode": "canon", "teacher": "frozen", "trajectories": data, "bogus": 1},
    }
    for key, params in cases.items():
        message = refused(settings, {**base, **params})
        want = "params.bogus" if key == "params.mode" else key
        assert message.startswith(want), (key, message)
    unique = Path(data).with_name("unique.jsonl")
    unique.write_text("".join(json.dumps(r) + "\n" for r in records()))
    message = refused(settings, {**base, "method": "canon", "trajectories": str(unique)})
    assert message.startswith("params.method") and "on_policy = true" in message
    bad_tasks = Path(data).with_name("bad-tasks.jsonl")
    for text, why in (
        ('{"prompt": "x"}\n', "line 1: `check` must be a non-empty string"),
        ('{"prompt": "x", "check": "true", "answer_file": "../x"}\n', "must be a relative path"),
        ('{"prompt": "x", "check": "true", "files": {"/etc/x": "y"}}\n', "must be a relative path"),
        ('{"prompt": "x", "check": "true", "answer_file": "."}\n', "must be a relative path"),
        (
            '{"prompt": "x", "check": "true", "files": {"a": "1", "a/b": "2"}}\n',
            "both as a file and as a folder",
        ),
        ('{"prompt": "x", "check": "true", "files": {"answer.txt": "1"}}\n', "named twice"),
        ("not json\n", "line 1: not JSON"),
        ("", "holds no task"),
    ):
        bad_tasks.write_text(text)
        message = refused(settings, {**base, "on_policy": True, "tasks": str(bad_tasks)})
        assert message.startswith("params.tasks") and why in message, message
    # The old name of `method` is still understood.
    assert submit(settings, {**base, "mode": "canon", "trajectories": data}) > 0
