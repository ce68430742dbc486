"""What makes two ideas one, how insights are bounded, and how every role's prompt is fitted."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from agents.llm.model import ContextTooLong, Turn
from agents.policies.base import NodeEvidence
from agents.policies.llm.fitting import cut, fitted, room
from agents.policies.llm.ideas import identity, same
from agents.tree.insights import bounded
from tests.unit.test_search_policy import ctx_of, ev


def one(a: tuple[str, str], b: tuple[str, str]) -> bool:
    return same(identity(*a), identity(*b))


def test_numbers_are_part_of_an_ideas_identity_and_titles_alone_never_are() -> None:
    assert not one(
        ("Set learning rate to 0.003", "set train.lr to 0.003"),
        ("Set learning rate to 0.01", "set train.lr to 0.01"),
    )
    assert one(("Lower the rate", "set train.lr to 0.010"), ("Try lr 1e-2", "Set train.lr to 1e-2."))
    # Clauses may come in any order; the values stay bound to their knobs.
    assert one(("a", "lr 0.01 and width 64"), ("b", "width 64, lr 0.01"))
    assert not one(("a", "lr 0.01 and width 64"), ("b", "lr 64 and width 0.01"))
    # The same title over different mechanisms is two ideas; numbers in a title count as parameters.
    assert not one(("Tune the knob", "set knob.x to 3"), ("Tune the knob", "widen knob.x's range"))
    assert not one(("Use 64 units", "widen the hidden layer"), ("Use 128 units", "widen the hidden layer"))
    assert one(("Use 64 units", "widen the hidden layer"), ("64 units", "Widen the hidden layer"))
    # Equal edits are one change whatever the words.
    assert same(identity("a", "x", {"c.toml:k": 1}), identity("b", "y", {"c.toml:k": 1}))
    assert not same(identity("a", "x", {"c.toml:k": 1}), identity("a", "x", {"c.toml:k": 2}))


def test_an_insight_is_cut_to_150_words_and_1200_characters() -> None:
    text = " ".join(f"w{i}" for i in range(400))
    assert len(bounded(text).split()) == 150 and bounded(text).endswith("w149…")
    assert len(bounded("x" * 5000)) == 1200 and bounded("  short lesson \n") == "short lesson"
    assert cut("abcdef", 4) == "abc…" and cut(None, 4) == "" and cut("abc", 4) == "abc"


class Counting:
    """A model double that counts a prompt as a quarter of its JSON characters, as a tokenizer roughly would."""

    name = "counting"

    def __init__(self, limit: int, *answers: str) -> None:
        self.input_limit, self.answers = limit, list(answers)
        self.prompts: list[list[dict[str, Any]]] = []
        self.roles: list[str] = []

    def count(self, messages: list[dict[str, Any]], tools: object = None) -> int:
        return len(json.dumps(messages)) // 4

    def complete(
        self, role: str, messages: list[dict[str, Any]], tools: object = None, schema: object = None
    ) -> Turn:
        self.prompts.append(messages)
        self.roles.append(role)
        return Turn(self.answers.pop(0) if self.answers else "{}", [], 10, 10, 0.0)


def heavy(i: int) -> NodeEvidence:
    return replace(
        ev(i, 1 if i < 20 else i - 18, {}, 0.5 + i / 1000),
        title=f"Idea {i} " + "long title " * 20, mechanism="set knob.x and explain " * 30,
        insight="a lesson " * 300, failure="a failure " * 100, summary="a summary " * 200,
        report="a report " * 3000, diff="+x = 3\n" * 5000,
        constraints=[{"name": "small", "verdict": "satisfied", "value": 1.0, "detail": "d " * 200}],
    )  # fmt: skip


def test_every_roles_prompt_is_fitted_to_the_input_limit() -> None:
    from agents.policies.llm.policy import LlmPolicy

    nodes = [ev(1, None, {}, 0.5, "merged"), *(heavy(i) for i in range(2, 61))]
    limit = 3000
    space = room(Counting(limit))
    assert space == limit - 150
    model = Counting(limit, json.dumps({"children": [{"parent_id": 1, "title": "t", "mechanism": "m 1"}]}))
    ctx = replace(
        ctx_of(nodes), dropped=[{"title": "an idea", "parent_id": 1, "reason": "a duplicate of n2"}]
    )
    props = LlmPolicy(model).ideate(ctx)  # type: ignore[arg-type]
    assert [p.title for p in props] == ["t"]
    sent = model.prompts[0]
    assert model.count(sent) <= space
    evidence = json.loads(sent[1]["content"])
    assert evidence["dropped_ideas"] == [{"title": "an idea", "parent_id": 1, "reason": "a duplicate of n2"}]
    assert {1, 60} <= {n["id"] for n in evidence["nodes"]} and "shortened" in evidence
    policy = LlmPolicy(model)  # type: ignore[arg-type]
    policy.synthesize(nodes[0], nodes[1:], "acc")
    policy.verify(nodes[5], [{"name": "small", "description": "a small change"}])
    policy.update_state({"concerns": ["c " * 100] * 10}, nodes[1:8], {n.id: n.id for n in nodes})
    assert set(model.roles) == {"ideator", "insight", "verifier", "state"}
    assert all(model.count(p) <= space for p in model.prompts)
    # What cannot fit even at its shortest is not sent.
    tiny = Counting(200)
    with pytest.raises(ContextTooLong, match="the ideator's prompt needs"):
        LlmPolicy(tiny).ideate(ctx)  # type: ignore[arg-type]
    assert tiny.prompts == []
    # A model that cannot count gets the fullest prompt.
    assert fitted(object(), "x", lambda level: [{"level": level}], 3) == [{"level": 0}]
