"""Model answers as real open models write them, end to end through `grove run` and the scripted server.

Node ids as `n1`, a gain as `"5%"`, a confidence of 0.9, enums in any case, actions as `<tool_call>` tags,
`{"name", "arguments"}` text or fenced JSON: each completes a node. An answer that cannot be used is
asked for again (quoting the error) and leaves an `llm.refused` event, shown on the node's page; an idea
whose attempts failed on format is tried again, not abandoned.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from backend.core.config import Settings
from backend.core.models import Event, Node, Study
from tests.integration.test_llm_policy import grove_run, llm_repo, rows, tool
from tests.support.fake_llm import FakeLLM


def refusals(settings: Settings, role: str) -> list[Event]:
    return [e for e in rows(settings, Event, Event.type == "llm.refused") if e.payload["role"] == role]


def bodies(llm: FakeLLM, role: str) -> list[dict[str, Any]]:
    return [r["body"] for r in llm.requests if r["role"] == role]


CHILD = {
    "parent_id": "n1",  # as the prompts write nodes
    "title": "Centre the knob",
    "mechanism": "set knob.x to 3",
    "hypothesis": "the score peaks at x = 3",
    "observable": "dev score near 10",
    "risks": "none",
    "expected_gain": "5%",  # of trunk's dev score
}


def test_answers_in_the_forms_open_models_write_complete_a_node(settings: Settings, tmp_path: Path) -> None:
    repo = llm_repo(tmp_path, soft=True, policy="temperature = { ideator = 0.9, executor = 0.2 }\n")
    script = {
        "ideator": [
            {"content": "Sure! I would centre the knob first."},  # no JSON: asked again
            {"content": '{"children": [{"parent_id": "n1", "title": ""}]}'},  # no valid child: asked again
            {"content": "Here you go:\n```json\n" + json.dumps({"children": [CHILD]}) + "\n```"},
        ],
        "executor": [
            {"content": 'Reading it.\n<tool_call>\n{"name": "read", "arguments": {"path": "config.toml"}}\n</tool_call>'},
            {"content": '{"name": "edit", "arguments": {"path": "config.toml", "search": "x = 0", "replace": "x = 3"}}'},
            {"content": '```json\n{"name": "evaluate_dev", "arguments": {}}\n```'},
            {"content": '<tool_call>{"name": "finish", "arguments": {"report": "Set x = 3."}}</tool_call>'},
            {"content": '<tool_call>{"name": "finish", "arguments": {"report": "Set x = 3."}}</tool_call>'},
        ],
        "verifier": [
            {"content": '{"verdicts": [{"name": "clarity", "confidence": 90}], "call": "accept"}'},  # wrong name
            {"content": '{"verdicts": [{"name": "Readable", "confidence": 0.9, "reason": "a one-line edit"}], '
                        '"call": "Accept"}'},
        ],
    }  # fmt: skip
    with FakeLLM(script) as llm:
        res = grove_run(settings, repo, llm.url)
    assert res.returncode == 0, res.stderr + res.stdout
    node = rows(settings, Node, Node.id == 2)[0]
    assert node.status == "merged" and node.title == "Centre the knob", node.failure
    assert node.parent_id == 1 and node.attempts == 1
    study = rows(settings, Study)[0]
    trunk = statistics.fmean(study.baseline_dev)
    assert float(node.hypothesis["expected_gain"]) == pytest.approx(0.05 * abs(trunk), rel=1e-3)
    soft = next(c for c in node.constraints if c["name"] == "readable")
    assert soft["verdict"] == "satisfied" and soft["value"] == 90 and "a one-line edit" in soft["detail"]

    # Each refused answer is an event with its reason; the next request quotes that reason exactly.
    ideator = refusals(settings, "ideator")
    assert [(e.node_id, e.payload["try"]) for e in ideator] == [(None, "1 of 3"), (None, "2 of 3")]
    assert ideator[0].payload["reason"] == "it holds no JSON object"
    assert ideator[0].payload["answer"] == "Sure! I would centre the knob first."
    assert (
        ideator[1]
        .payload["reason"]
        .startswith("no child is valid (child 0: title: String should have at least")
    )
    asked = bodies(llm, "ideator")
    for e, body in zip(ideator, asked[1:3], strict=True):
        assert body["messages"][-1]["content"].startswith(
            f"Your answer could not be used: {e.payload['reason']}."
        )
    verifier = refusals(settings, "verifier")
    assert len(verifier) == 1 and verifier[0].node_id == 2
    assert verifier[0].payload["reason"].startswith("no verdict for readable")
    assert refusals(settings, "executor") == []  # every action form was understood

    # `[policy] temperature` by role: the roles it names get theirs, the others the server's default.
    assert asked and all(b["temperature"] == 0.9 for b in asked)
    assert all(b["temperature"] == 0.2 for b in bodies(llm, "executor"))
    assert bodies(llm, "verifier") and all("temperature" not in b for b in bodies(llm, "verifier"))

    # The node's page shows the refusal among its events.
    from backend.api.main import create_app
    from backend.core.security import create_token
    from tests.frontend.conftest import app_test
    from tests.support.services import serve
    from tests.support.waiting import free_port

    token = create_token(settings, ["viewer"], "v")
    port = free_port()
    server, thread = serve(create_app(settings), port)
    try:
        at = app_test(f"http://127.0.0.1:{port}/api/v1", token, page="views/node.py", study=study.id, node=2)
        assert not at.exception, at.exception
        history = next(t.value for t in at.text if " · n2 proposed" in t.value).splitlines()
        shown = [h for h in history if "a model's answer was refused" in h]
        assert len(shown) == 1 and "no verdict for readable" in shown[0], history
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_an_idea_whose_attempts_fail_on_format_is_tried_again_not_abandoned(
    settings: Settings, tmp_path: Path
) -> None:
    repo = llm_repo(tmp_path, experiments=4)
    child = {**CHILD, "parent_id": 1, "expected_gain": 0.5}
    prose = [{"content": "I think the knob should move to the centre."}] * 3
    script = {
        "ideator": [{"content": json.dumps({"children": [child]})}],
        "executor": [
            *prose,  # attempt 1: three answers without an action
            *prose,  # attempt 2: the same
            tool("edit", path="config.toml", search="x = 0", replace="x = 3"),
            tool("finish", report="Set x = 3."),
        ],
    }
    with FakeLLM(script) as llm:
        res = grove_run(settings, repo, llm.url)
    assert res.returncode == 0, res.stderr + res.stdout
    node = rows(settings, Node, Node.id == 2)[0]
    assert node.status == "merged" and node.attempts == 3, node.failure
    events = rows(settings, Event, Event.node_id == 2)
    failed = [e.payload["reason"] for e in events if e.type == "node.failed"]
    assert len(failed) == 2 and all(
        r.startswith("AnswerFormatError: 3 answers in a row held no action that could run") for r in failed
    ), failed
    verified = [e.payload for e in events if e.type == "node.verified"]
    assert len(verified) == 2 and all(v.get("decision") == "reject" for v in verified), verified
    # No restart: no child of the root was asked for away from it, and no concern says it was abandoned.
    assert all(n.origin != "restart" for n in rows(settings, Node))
    study = rows(settings, Study)[0]
    assert not any(c.startswith("restart:") for c in study.improvement_state["concerns"])
    assert not any(r["node_id"] == 2 for r in study.improvement_state["rejected_candidates"])
    # Every answer without an action is an event on the node, with the answer and why it was refused.
    refused = refusals(settings, "executor")
    assert len(refused) == 6 and {e.node_id for e in refused} == {2}
    assert all(e.payload["reason"] == "the answer holds no action block" for e in refused)
    assert refused[0].payload["answer"] == "I think the knob should move to the centre."
