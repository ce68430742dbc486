"""The `llm` ideator through `grove run` and the scripted server: what counts as a duplicate, what an
empty round does, and how large its prompt and the insights it reads may grow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backend.core import db
from backend.core.config import Settings
from backend.core.models import Event, InsightVersion, Node, Study
from backend.services.records import add_insight
from backend.services.studies import create_study
from tests.integration.test_llm_policy import IDEA, grove_run, llm_repo, rows, tool
from tests.support.fake_llm import FakeLLM


def child(title: str, mechanism: str, parent: int = 1, gain: float = 1.0) -> dict[str, Any]:
    return {"parent_id": parent, "title": title, "mechanism": mechanism, "hypothesis": "the score moves",
            "observable": "a higher dev score", "risks": "none", "expected_gain": gain}  # fmt: skip


def answer(*children: dict[str, Any]) -> dict[str, Any]:
    return {"content": json.dumps({"children": list(children)})}


def ideator_prompts(llm: FakeLLM) -> list[str]:
    return [json.dumps(r["body"]["messages"]) for r in llm.requests if r["role"] == "ideator"]


def test_two_values_of_one_knob_are_two_experiments(settings: Settings, tmp_path: Path) -> None:
    # Word for word the titles differ only in the number: both are tried, neither is a duplicate.
    repo = llm_repo(tmp_path, experiments=2)
    script = {
        "ideator": [
            answer(
                child("Set learning rate to 0.01", "set knob.x to 0.01"),
                child("Set learning rate to 0.003", "set knob.x to 0.003"),
            )
        ],
        "executor": [
            tool("edit", path="config.toml", search="x = 0", replace="x = 0.01"),
            tool("finish", report="x = 0.01"),
            tool("finish", report="x = 0.01"),
            tool("edit", path="config.toml", search="x = 0", replace="x = 0.003"),
            tool("finish", report="x = 0.003"),
        ],
    }
    with FakeLLM(script) as llm:
        res = grove_run(settings, repo, llm.url)
    assert res.returncode == 0, res.stderr + res.stdout
    nodes = {n.title: n for n in rows(settings, Node) if n.parent_id is not None}
    assert set(nodes) == {"Set learning rate to 0.01", "Set learning rate to 0.003"}
    assert all(n.attempts == 1 and n.dev_n > 0 for n in nodes.values()), [
        (n.title, n.status, n.failure) for n in nodes.values()
    ]
    assert [e for e in rows(settings, Event) if e.type == "proposal.dropped"] == []
    assert len(ideator_prompts(llm)) == 1


def test_an_empty_round_with_budget_left_asks_again_and_says_what_was_dropped(
    settings: Settings, tmp_path: Path
) -> None:
    repo = llm_repo(tmp_path, experiments=2)
    script = {
        "ideator": [
            IDEA,  # n2: set knob.x to 3 (merged)
            answer(),  # no child at all
            answer(child("Put the knob at 3", "set knob.x to 3")),  # n2's mechanism and value: dropped
            answer(child("Try the knob at 2", "set knob.x to 2")),
        ],
        "executor": [
            tool("edit", path="config.toml", search="x = 0", replace="x = 3"),
            tool("finish", report="x = 3"),
            tool("finish", report="x = 3"),
            tool("edit", path="config.toml", search="x = 3", replace="x = 2"),
            tool("finish", report="x = 2"),
        ],
    }
    with FakeLLM(script) as llm:
        res = grove_run(settings, repo, llm.url)
    assert res.returncode == 0, res.stderr + res.stdout
    st = rows(settings, Study)[0]
    assert st.stop_reason == "experiment budget spent (2)", st.stop_reason
    third = rows(settings, Node, Node.number == 3)
    assert third and third[0].title == "Try the knob at 2" and third[0].dev_n > 0
    events = rows(settings, Event)
    dropped = [e.payload for e in events if e.type == "proposal.dropped"]
    assert [(d["title"], d["reason"]) for d in dropped] == [
        ("Put the knob at 3", "a duplicate of n2 (Centre the knob): the same mechanism and parameters")
    ]
    assert [e.payload["asks_left"] for e in events if e.type == "ideation.empty"] == [2, 1]
    prompts = ideator_prompts(llm)
    assert len(prompts) == 4
    assert "dropped_ideas" in prompts[2] and "no child in the answer" in prompts[2]
    assert "Put the knob at 3" in prompts[3] and "a duplicate of n2 (Centre the knob)" in prompts[3]


LONG = " ".join(f"word{i}" for i in range(500))  # 500 words, 4,390 characters


def test_an_over_long_insight_is_cut_when_it_is_written(settings: Settings, tmp_path: Path) -> None:
    repo = llm_repo(tmp_path, experiments=1)
    script = {
        "ideator": [IDEA],
        "executor": [tool("edit", path="config.toml", search="x = 0", replace="x = 3"), tool("finish", report="x = 3")],
        "insight": [{"content": LONG}],
    }  # fmt: skip
    with FakeLLM(script) as llm:
        res = grove_run(settings, repo, llm.url)
    assert res.returncode == 0, res.stderr + res.stdout
    assert [r["role"] for r in llm.requests].count("insight") == 1
    root = rows(settings, InsightVersion, InsightVersion.node_id == 1)
    written = [v.text for v in root if v.text.startswith("word0 ")]
    assert len(written) == 1, [v.text[:80] for v in root]
    assert len(written[0].split()) == 150 and written[0].endswith("word149…") and len(written[0]) <= 1200


def test_the_ideators_request_at_60_nodes_fits_max_input_tokens(settings: Settings, tmp_path: Path) -> None:
    limit = 4000
    repo = llm_repo(tmp_path, experiments=1, policy=f"max_input_tokens = {limit}\n")
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
        sid, root = study.id or 0, study.trunk_node_id
        ids = [root]
        for i in range(2, 61):  # n2..n60: measured, rejected ideas with long texts, some in chains
            parent = root if i < 20 else ids[i - 19]
            node = Node(
                study_id=sid, parent_id=parent, depth=1 if parent == root else 2, status="rejected", round_no=-1,
                title=f"Idea {i}: " + "a long title about the knob " * 6,
                hypothesis={"mechanism": f"set knob.x to {i / 100} and " + "explain at length " * 40},
                dev_values=[1.0 + i / 1000], dev_mean=1.0 + i / 1000, dev_n=1, gain=i / 1000 - 0.01,
                gain_lcb=-0.1, completed_order=i - 1, attempts=1, failure="a failure story " * 30,
                constraints=[{"name": "small", "verdict": "satisfied", "value": 0.0, "detail": "d " * 200}],
            )  # fmt: skip
            s.add(node)
            s.flush()
            ids.append(node.id or 0)
            lesson = f"n{i}: " + "a lesson that goes on and on " * 80  # written before insights were bounded
            add_insight(s, sid, node.id or 0, lesson, [node.id or 0])
    script = {
        "ideator": [answer(child("Centre the knob", "set knob.x to 3"))],
        "executor": [tool("edit", path="config.toml", search="x = 0", replace="x = 3"), tool("finish", report="x = 3")],
    }  # fmt: skip
    with FakeLLM(script) as llm:
        res = grove_run(settings, repo, llm.url)
    assert res.returncode == 0, res.stderr + res.stdout
    import litellm  # after Grove's model seam, which keeps litellm from fetching its price list

    bodies = [r["body"] for r in llm.requests if r["role"] == "ideator"]
    assert bodies, "the ideator was never asked"
    first = bodies[0]["messages"]
    assert litellm.token_counter(model="openai/fake-model", messages=first) <= limit
    assert "Answer with one JSON object" in first[0]["content"]  # the format instructions are whole
    evidence = json.loads(first[1]["content"])
    shown = {n["id"] for n in evidence["nodes"]}
    assert evidence["nodes_shown"].startswith(f"{len(shown)} of 60") and 1 in shown
    assert 60 in shown  # the latest
    assert "shortened" in evidence
    # Every request of every role stayed within the limit.
    for r in llm.requests:
        assert litellm.token_counter(model="openai/fake-model", messages=r["body"]["messages"]) <= limit
    assert rows(settings, Node, Node.number == 61)[0].dev_n > 0
