"""The `llm` policy end to end against a scripted OpenAI-compatible server on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import col, select

from backend.core import db
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.models import LlmCall, Node, ReceiptRow, Study, Trajectory
from backend.services.fates import fate_of
from backend.services.ledger import prompt_of
from tests.support.fake_llm import FakeLLM
from tests.support.repos import TINY_EVAL, git, make_repo, tiny_files

LLM_POLICY = """\
[policy]
kind = "llm"
model = "openai/fake-model"
input_usd_per_mtok = 1.0
output_usd_per_mtok = 2.0
max_turns = 12
"""


SOFT = """
[[constraints]]
name = "readable"
judge = "llm"
description = "the change is small and easy to review"
threshold = 70
"""


def llm_repo(
    tmp_path: Path,
    usd: float = 1.0,
    experiments: int = 2,
    fail_at: int | None = None,
    soft: bool = False,
    policy: str = "",
    extra_files: dict[str, str] | None = None,
    name: str = "llm-study",
    parallel: int = 1,
) -> Path:
    files = tiny_files(name=name, experiments=experiments) | (extra_files or {})
    spec = files["grove.toml"]
    if soft:
        spec = spec.replace("[search]", SOFT.lstrip() + "\n[search]")
    spec = spec[: spec.index("[search]")] + spec[spec.index("[budget]") :]
    spec = spec.replace('[policy]\nkind = "search"\nseed = 0\nchildren = 2\n', LLM_POLICY + policy)
    spec = spec.replace("parallel = 2", f"parallel = {parallel}\nusd = {usd}")
    files["grove.toml"] = spec
    files["eval.py"] = files["eval.py"].replace(
        'print(json.dumps({"score": score, "size": x}))',
        'print(json.dumps({"score": score, "size": x, "saw_key": int("OPENAI_API_KEY" in os.environ)}))',
    )
    if fail_at is not None:
        files["eval.py"] = files["eval.py"].replace(
            'if sys.argv[1] == "dev":',
            f'if x == {fail_at}:\n    sys.exit("boom: x={fail_at} breaks the evaluator")\nif sys.argv[1] == "dev":',
        )
    return make_repo(tmp_path / "repo", files)


def grove_run(
    settings: Settings, repo: Path, api: str, *extra: str, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "GROVE_DATA_DIR": str(settings.data_dir),
        "GROVE_WORKTREES_DIR": str(settings.worktrees_dir),
        "GROVE_LLM_API_BASE": api,
        "GROVE_LLM_BACKOFF": "0.05",
        "OPENAI_API_KEY": "sk-test-secret-key",
    }
    return subprocess.run(
        [sys.executable, "-m", "backend.cli.main", "run", str(repo), "--auto-approve", "--quiet", *extra],
        cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def rows(settings: Settings, model: Any, *where: Any) -> list[Any]:
    with db.session(settings.db_url) as s:
        return list(s.exec(select(model).where(*where)))


def prompt(settings: Settings, call: LlmCall) -> list[dict[str, Any]]:
    """Return the whole prompt a stored call sent."""
    with db.session(settings.db_url) as s:
        return prompt_of(s, call)


def tool(name: str, **args: Any) -> dict[str, Any]:
    return {"tool": name, "args": args}


IDEA = {
    "content": json.dumps(
        {
            "children": [
                {
                    "parent_id": 1,
                    "title": "Centre the knob",
                    "mechanism": "set knob.x to 3",
                    "hypothesis": "the score peaks at x = 3",
                    "observable": "dev score near 10",
                    "risks": "none",
                    "expected_gain": 5.0,
                }
            ]
        }
    )
}


def test_scripted_executor_edits_evaluates_finishes_and_merges(settings: Settings, tmp_path: Path) -> None:
    repo = llm_repo(tmp_path, soft=True)
    script = {
        "verifier": [
            {"content": '{"verdicts": [{"name": "readable", "confidence": 90, "reason": "a one-line edit"}]}'}
        ],
        "ideator": [{"content": "Let me think..."}, IDEA],  # the first answer is not JSON: asked again
        "executor": [
            tool("list"),
            tool("read", path="config.toml"),
            tool("write", path="eval.py", content="print('{\"score\": 1e9}')"),
            tool("read", path="../../outside.txt"),
            {"tool": "edit", "raw": '{"path": "config.toml", "search": '},
            {"status": 429},
            tool("edit", path="config.toml", search="x = 0", replace="x = 3"),
            tool("evaluate_dev"),
            tool("finish", report="Set x = 3; dev score 10."),
        ],
        "insight": [{"content": "n2: centring the knob at x = 3 raises the score to 10."}],
        "state": [
            {
                "content": json.dumps(
                    {
                        "verified_findings": [{"text": "x = 3 is the optimum", "node_ids": [2]}],
                        "open_constraints": [],
                        "rejected_candidates": [],
                        "concerns": ["scripted concern"],
                        "next_plan": ["stop here"],
                    }
                )
            },
        ],
    }
    with FakeLLM(script) as llm:
        res = grove_run(settings, repo, llm.url)
    assert res.returncode == 0, res.stderr + res.stdout
    st = rows(settings, Study)[0]
    node = rows(settings, Node, Node.id == 2)[0]
    assert node.status == "merged" and node.title == "Centre the knob"
    soft = next(c for c in node.constraints if c["name"] == "readable")
    assert soft["verdict"] == "satisfied" and soft["value"] == 90 and "a one-line edit" in soft["detail"]
    assert "x = 3" in git("show", f"{st.trunk_branch}:config.toml", cwd=Path(st.repo_path))
    assert "1e9" not in git("show", f"{st.trunk_branch}:eval.py", cwd=Path(st.repo_path))

    calls = rows(settings, LlmCall)
    assert {c.role for c in calls} >= {"ideator", "executor", "insight", "verifier", "state"}
    ideator = json.loads(prompt(settings, next(c for c in calls if c.role == "ideator"))[1]["content"])
    files = {f["path"] for f in ideator["repository"]["files"]}
    assert {"config.toml", "eval.py"} <= files and not any(f.startswith("data/test") for f in files)
    assert ideator["repository"]["editable_contents"]["config.toml"].startswith("[knob]")
    # The dev evaluator's command and what it printed on trunk, and the start of the protected files.
    evaluator = ideator["repository"]["evaluator"]
    assert evaluator["dev_command"] == "python eval.py dev" and '"score": 1.0' in evaluator["dev_output"]
    assert ideator["repository"]["protected_preview"]["eval.py"].startswith("import json, os, sys")
    assert st.improvement_state["concerns"] == ["scripted concern"]  # the state updater's rewrite
    assert st.improvement_state["verified_findings"][0]["node_ids"] == [2]
    verifier = next(c for c in calls if c.role == "verifier")
    judged = json.dumps(prompt(settings, verifier))
    assert "Set x = 3; dev score 10." in judged and "+x = 3" in judged  # it judged the report and the diff
    executor = [c for c in calls if c.role == "executor"]
    last = json.dumps(prompt(settings, executor[-1]))
    # Each message of the conversation is stored once, however many turns re-sent it.
    assert len(executor) >= 4 and sum(len(c.messages) for c in executor) == len(
        prompt(settings, executor[-1])
    )
    assert "refused: eval.py is not editable" in last
    assert "resolves outside the worktree" in last
    assert "malformed arguments for edit" in last
    assert "dev evaluation ok" in last
    assert node.cost["calls"] == len(executor) and node.cost["usd"] > 0
    assert all(c.usd > 0 and c.tokens_in > 0 for c in calls)

    traj = rows(settings, Trajectory, Trajectory.node_id == 2)
    assert len(traj) == 1 and traj[0].report == "Set x = 3; dev score 10."
    assert any("dev evaluation ok" in f for f in traj[0].feedback)
    assert any("refused" in f for f in traj[0].feedback)

    # No held-out number and no sealed content ever reached a prompt.
    heldout = st.trunk_heldout + st.baseline_heldout
    assert heldout and min(heldout) > 700
    for c in calls:
        text = json.dumps(c.messages)
        assert "777.1" not in text and "777" not in text
        for value in heldout:
            assert f"{value:g}" not in text and str(value) not in text
    for r in llm.requests:
        assert "777" not in json.dumps(r["body"])
    # The evaluated code never saw the provider key.
    metrics = [r.metrics for r in rows(settings, ReceiptRow, col(ReceiptRow.metrics).is_not(None))]
    assert metrics and all(m.get("saw_key") == 0 for m in metrics)
    assert "sk-test-secret-key" not in json.dumps([c.messages for c in calls])
    report = Path(st.report_path).read_text()
    assert f"LLM: {len(calls)} calls" in report
    # The ideator said +5; the study had measured nothing, so the prior was clipped to a tenth of trunk's dev.
    table = report.split("## Predicted vs realised dev gain", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in table.splitlines() if line.startswith("| n2 | Centre the knob |"))
    predicted, prior, realised = (float(c) for c in row.strip("|").split("|")[2:5])
    assert predicted == 5.0 and 0 < prior < 0.1 * 1.01 and realised == pytest.approx(node.gain, rel=1e-3)


def test_failed_attempt_is_retried_with_a_reflection_only(settings: Settings, tmp_path: Path) -> None:
    repo = llm_repo(tmp_path, experiments=2, fail_at=5)
    written = "x = 5 crashes the evaluator outright; stay at or below 4 and try the centre, 3, first."
    script = {
        "ideator": [IDEA],
        "reflect": [{"content": written}],
        "executor": [
            tool("edit", path="config.toml", search="x = 0", replace="x = 5"),
            tool("finish", report="Set x = 5."),
            tool("finish", report="Set x = 5."),  # confirmed once shown the change
            tool("read", path="config.toml"),
            tool("edit", path="config.toml", search="x = 0", replace="x = 3"),
            tool("finish", report="Set x = 3 this time."),
        ],
    }
    with FakeLLM(script) as llm:
        res = grove_run(settings, repo, llm.url)
    assert res.returncode == 0, res.stderr
    node = rows(settings, Node, Node.id == 2)[0]
    assert node.attempts == 2 and node.status == "merged"
    executor = [c for c in rows(settings, LlmCall) if c.role == "executor"]
    second = [
        c for c in executor if "A previous attempt at this node failed" in json.dumps(prompt(settings, c)[:2])
    ]
    assert second, "the retry did not carry a reflection"
    first_prompt = json.dumps(prompt(settings, second[0]))
    assert "boom: x=5 breaks the evaluator" in first_prompt  # the reflection names what went wrong
    assert f"Reflection: {written}" in first_prompt  # in the model's own words
    reflect = [c for c in rows(settings, LlmCall) if c.role == "reflect"]
    assert len(reflect) == 1
    asked = json.dumps(prompt(settings, reflect[0]))
    assert "boom: x=5" in asked and "x = 5" in asked  # it saw the failure and the attempt's last actions
    assert "Set x = 5." not in first_prompt and '"replace": "x = 5"' not in first_prompt  # no old transcript
    trajectories = rows(settings, Trajectory, Trajectory.node_id == 2)
    assert sorted(t.attempt for t in trajectories) == [1, 2]
    env = {**os.environ, "GROVE_DATA_DIR": str(settings.data_dir)}
    out = tmp_path / "traj.jsonl"
    exported = subprocess.run(
        [sys.executable, "-m", "backend.cli.main", "export-trajectories", "llm-study", "--out", str(out)],
        cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["attempt"] for r in records] == [1, 2]
    assert records[0]["outcome"] == "failed" and "boom: x=5" in records[0]["feedback"]
    assert records[1]["outcome"] == "evaluated" and "dev mean 10" in records[1]["feedback"]
    assert (
        records[1]["prompt"][0]["role"] == "system" and "ROLE: executor" in records[1]["prompt"][0]["content"]
    )
    assert any(m.get("tool_calls") for m in records[1]["rollout"])


def test_a_refine_child_starts_from_its_parents_change_and_is_told_it(
    settings: Settings, tmp_path: Path
) -> None:
    # n2 sets x = 5: a better score (6 against trunk's 1) but size 5 breaks the `small` rule (<= 4),
    # so AREX refines it. The refine child's executor edits `x = 5`, which only its parent's code holds.
    repo = llm_repo(tmp_path, experiments=2)
    over = json.loads(IDEA["content"])
    over["children"][0].update(title="Push the knob to 5", mechanism="set knob.x to 5")
    fix = {"children": [{"parent_id": 2, "title": "Pull the knob back to 3", "mechanism": "set knob.x to 3",
                         "hypothesis": "3 keeps the score and meets the size rule", "observable": "dev 10",
                         "risks": "none", "expected_gain": 4.0}]}  # fmt: skip
    script = {
        "ideator": [{"content": json.dumps(over)}, {"content": json.dumps(fix)}],
        "executor": [
            tool("edit", path="config.toml", search="x = 0", replace="x = 5"),
            tool("finish", report="Set x = 5."),
            tool("finish", report="Set x = 5."),
            tool("edit", path="config.toml", search="x = 5", replace="x = 3"),
            tool("finish", report="Moved x from 5 to 3."),
            tool("finish", report="Moved x from 5 to 3."),
        ],
    }
    with FakeLLM(script) as llm:
        res = grove_run(settings, repo, llm.url)
    assert res.returncode == 0, res.stderr + res.stdout
    parent, child = rows(settings, Node, Node.id == 2)[0], rows(settings, Node, Node.id == 3)[0]
    assert parent.status == "rejected" and any(c["verdict"] == "violated" for c in parent.constraints)
    assert child.parent_id == 2 and child.origin == "refine", (child.origin, child.failure)
    st = rows(settings, Study)[0]
    # It started from the merge of trunk and n2's commit, and its own change took x from 5 to 3.
    assert child.inherited["parent"] == 2 and child.inherited["commit"]
    assert git("rev-parse", f"{child.commit}^", cwd=Path(st.repo_path)).strip() == child.inherited["commit"]
    assert "x = 3" in git("show", f"{child.commit}:config.toml", cwd=Path(st.repo_path))
    assert child.status == "merged" and child.dev_mean == pytest.approx(10.005)
    # Its executor was told what it builds on: the parent's diff, effect and the refine's goal.
    first = json.dumps(prompt(settings, next(c for c in rows(settings, LlmCall) if c.role == "executor"
                                             and c.node_id == 3)))  # fmt: skip
    assert "You build on n2 (Push the knob to 5)" in first and "+x = 5" in first
    assert "This is a refine of n2" in first and "dev mean 6" in first


def merge_while_held(ideas: dict[str, Any], edit: tuple[str, str], report: str) -> dict[str, Any]:
    """Script two first-round children: n2 sets x = 3 and merges while n3's executor is held.

    The next ideation comes once n2 is merged (its slot is free): n3's executor goes on then, and
    makes `edit` (search, replace) in config.toml.
    """
    held = threading.Event()
    return {
        "ideator": [{"content": json.dumps(ideas)}, {"content": '{"children": []}', "set": held}],
        "executor|(node n2)": [
            tool("edit", path="config.toml", search="x = 0", replace="x = 3"),
            tool("finish", report="Set x = 3."),
            tool("finish", report="Set x = 3."),
        ],
        "executor|(node n3)": [
            {"wait": held, **tool("edit", path="config.toml", search=edit[0], replace=edit[1])},
            tool("finish", report=report),
            tool("finish", report=report),
        ],
    }


def test_a_change_made_stale_by_a_merge_is_measured_again_on_the_new_trunk(
    settings: Settings, tmp_path: Path
) -> None:
    # Trunk scores 1. n2 centres x (+9) and n3 raises y (+2) side by side; n2 merges while n3's
    # executor is held, so n3 is measured on the trunk it was built on (1), not on the new one (10).
    y = ' + 2 * cfg["knob"].get("y", 0)'
    evaluator = TINY_EVAL.replace("+ 0.01 * seed", "+ 0.01 * seed" + y)
    repo = llm_repo(
        tmp_path, experiments=3, parallel=2,
        extra_files={"eval.py": evaluator, "config.toml": "[knob]\nx = 0\nsleep = 0\n# y adds to the score\ny = 0\n"},
    )  # fmt: skip
    both = {"children": [
        {"parent_id": 1, "title": "Centre the knob", "mechanism": "set knob.x to 3", "hypothesis": "peak at 3",
         "observable": "dev near 10", "risks": "none", "expected_gain": 5.0},
        {"parent_id": 1, "title": "Raise y", "mechanism": "set knob.y to 1", "hypothesis": "y adds to the score",
         "observable": "dev up by 2", "risks": "none", "expected_gain": 2.0},
    ]}  # fmt: skip
    with FakeLLM(merge_while_held(both, ("y = 0", "y = 1"), "Set y = 1.")) as llm:
        res = grove_run(settings, repo, llm.url)
    assert res.returncode == 0, res.stderr + res.stdout
    n2, n3, n4 = (rows(settings, Node, Node.id == i)[0] for i in (2, 3, 4))
    st = rows(settings, Study)[0]
    assert n3.base_commit != n2.gate_commit  # built on the trunk n2 replaced
    # Its gain is paired against the trunk it was built on (3 against 1), and the gain against the
    # new trunk (3 against 10) is kept beside it.
    assert n3.gain == pytest.approx(2.0) and n3.status == "evaluated", (n3.status, n3.gain, n3.status_reason)
    assert n3.verification["trunk_gain"]["gain"] == pytest.approx(-7.0)
    # n4 measures n3's change merged onto the new trunk, with no executor at work, and merges.
    assert (n4.origin, n4.origin_ref, n4.parent_id) == ("revisit", 3, 2), (n4.origin, n4.title)
    assert n4.base_commit == n2.gate_commit and n4.inherited["commit"] == n4.commit
    assert "x = 3" in git("show", f"{n4.commit}:config.toml", cwd=Path(st.repo_path))
    assert "y = 1" in git("show", f"{n4.commit}:config.toml", cwd=Path(st.repo_path))
    assert n4.gain == pytest.approx(2.0) and n4.status == "merged", (n4.status, n4.status_reason)
    assert not [c for c in rows(settings, LlmCall) if c.role == "executor" and c.node_id == 4]
    # The ideation after n2 read what n2's executor reported and the diff it made.
    later = json.loads(
        [r for r in llm.requests if r["role"] == "ideator"][1]["body"]["messages"][1]["content"]
    )
    done = later["recent_changes"][0]
    assert done["id"] == 2 and done["executor_report"] == "Set x = 3." and "+x = 3" in done["diff"]
    assert st.trunk_node_id == 4
    with db.session(settings.db_url) as s:
        told = fate_of(s, s.get(Node, 3))  # type: ignore[arg-type]
    assert told.endswith("measured again on a newer trunk as n4"), told


def test_a_revisit_of_a_change_trunk_already_holds_is_rejected_before_any_evaluation(
    settings: Settings, tmp_path: Path
) -> None:
    # n2 and n3 make the same change in other words; n2 merges while n3 is held, so n3 is stale and
    # its revisit merges onto a trunk that already holds it: there is nothing to measure again.
    repo = llm_repo(tmp_path, experiments=3, parallel=2)
    twins = {"children": [
        {"parent_id": 1, "title": "Centre the knob", "mechanism": "set knob.x to 3", "hypothesis": "peak at 3",
         "observable": "dev near 10", "risks": "none", "expected_gain": 5.0},
        {"parent_id": 1, "title": "Climb to the top", "mechanism": "put the knob where the curve peaks",
         "hypothesis": "the curve peaks in the middle", "observable": "dev up", "risks": "none",
         "expected_gain": 5.0},
    ]}  # fmt: skip
    with FakeLLM(merge_while_held(twins, ("x = 0", "x = 3"), "Put x at 3.")) as llm:
        res = grove_run(settings, repo, llm.url)
    assert res.returncode == 0, res.stderr + res.stdout
    n3, n4 = (rows(settings, Node, Node.id == i)[0] for i in (3, 4))
    assert n3.gain == pytest.approx(9.0) and n3.status == "evaluated"
    assert (n4.origin, n4.origin_ref) == ("revisit", 3)
    assert n4.status == "rejected" and n4.failure.startswith("nothing to measure again"), (
        n4.status,
        n4.failure,
    )
    assert n4.dev_n == 0 and not rows(settings, ReceiptRow, ReceiptRow.node_id == 4)
    assert not [c for c in rows(settings, LlmCall) if c.role in ("executor", "reflect") and c.node_id == 4]
