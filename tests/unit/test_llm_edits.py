"""An ideator's child may carry exact edits of `[search]` keys, applied with no executor turn."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agents.llm.model import Turn
from agents.policies.base import ImplementInput
from agents.policies.llm import schemas
from agents.policies.llm.ideation import Unusable, children_of
from agents.policies.llm.policy import LlmPolicy
from agents.policies.space import Space
from tests.unit.test_search_policy import BASE, SPACE, ctx, ev


class Scripted:
    """A model double that answers each call with the next scripted text and keeps what it was sent."""

    name = "scripted"

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.schemas: list[Any] = []
        self.prompts: list[list[dict[str, Any]]] = []

    def complete(
        self, role: str, messages: list[dict[str, Any]], tools: object = None, schema: object = None
    ) -> Turn:
        self.prompts.append(messages)
        self.schemas.append(schema)
        return Turn(self.answers.pop(0), [], 10, 10, 0.0)


def child(**fields: Any) -> dict[str, Any]:
    return {"parent_id": 1, "title": "a wider layer", "mechanism": "", **fields}


def test_the_schema_offers_each_key_with_the_values_it_may_take() -> None:
    schema = schemas.ideator(2, [1], Space(SPACE, BASE))
    item = schema["properties"]["children"]["items"]
    assert item["required"][:3] == ["parent_id", "title", "edits"]
    options = item["properties"]["edits"]["items"]["anyOf"]
    by_key = {o["properties"]["key"]["enum"][0]: o["properties"]["value"] for o in options}
    assert by_key["c.toml:m.hidden"] == {"enum": [8, 16, 32, 64]}
    # A range is offered as values spread over it (log-spaced here), as a person would write them.
    assert by_key["c.toml:t.lr"] == {
        "enum": [0.0001, 0.00024, 0.00056, 0.001, 0.0013, 0.0032, 0.0075, 0.018, 0.042, 0.1]
    }
    assert "edits" not in schemas.ideator(2, [1])["properties"]["children"]["items"]["properties"]


def test_edits_parse_by_key_or_its_ending_and_a_value_outside_is_refused_naming_what_it_takes() -> None:
    space = Space(SPACE, BASE)
    got = children_of(
        json.dumps({"children": [child(edits=[{"key": "m.hidden", "value": "32"}])]}), None, space
    )
    assert got[0].edits == {"c.toml:m.hidden": 32}
    got = children_of(json.dumps({"children": [child(edits={"c.toml:t.lr": "0.003"})]}), None, space)
    assert got[0].edits == {"c.toml:t.lr": 0.003}
    for edits, says in (
        ([{"key": "m.hidden", "value": 48}], "takes one of 8, 16, 32, 64, not 48"),
        ([{"key": "t.lr", "value": 3}], "takes a number from 0.0001 to 0.1, not 3"),
        ([{"key": "dropout", "value": 0.1}], "'dropout' is not one of the settings"),
        ("wider", "a list of"),
    ):
        with pytest.raises(Unusable, match=says):
            children_of(json.dumps({"children": [child(edits=edits)]}), None, space)
    with pytest.raises(Unusable, match="declares no settings"):
        children_of(json.dumps({"children": [child(edits=[{"key": "m.hidden", "value": 32}])]}))


def test_a_child_with_edits_is_proposed_with_them_and_one_that_changes_nothing_is_dropped() -> None:
    nodes = [ev(1, None, {}, 0.5, "merged"), ev(2, 1, {"c.toml:m.hidden": 16}, 0.6)]
    answer = {
        "children": [
            child(edits=[{"key": "c.toml:t.lr", "value": 0.01}]),
            child(parent_id=2, title="same width", edits=[{"key": "c.toml:m.hidden", "value": 16}]),
            child(parent_id=2, title="n2 wider", edits=[{"key": "c.toml:m.hidden", "value": 32}]),
            child(title="again the lr", edits=[{"key": "c.toml:t.lr", "value": 0.01}]),
            child(title="no change named"),
        ]
    }
    model = Scripted(json.dumps(answer))
    props = LlmPolicy(model).ideate(ctx(nodes, k=5))  # type: ignore[arg-type]
    assert [(p.title, p.edits) for p in props if not p.dropped] == [
        ("a wider layer", {"c.toml:t.lr": 0.01}),
        ("n2 wider", {"c.toml:m.hidden": 32}),
    ]
    why = {p.title: p.dropped for p in props if p.dropped}
    assert why["same width"] == "its edits change nothing: n2 already has those values"
    assert why["again the lr"].startswith("a duplicate of 'a wider layer'")
    assert why["no change named"] == "it names no change: neither edits nor a mechanism"
    # The prompt lists each setting with trunk's value and what it may take; the schema holds them.
    evidence = json.loads(model.prompts[0][1]["content"])
    assert evidence["settings"]["c.toml:m.hidden"] == {"trunk": 8, "values": [8, 16, 32, 64]}
    lr = evidence["settings"]["c.toml:t.lr"]
    assert lr == {"trunk": 0.001, "values": lr["values"], "low": 1e-4, "high": 0.1}
    assert lr["values"][0] == 1e-4 and lr["values"][-1] == 0.1 and 0.001 in lr["values"]
    assert "edits" in model.schemas[0]["properties"]["children"]["items"]["properties"]


def test_a_node_with_edits_is_implemented_exactly_with_no_model_turn(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text("[m]\nhidden = 8\n[t]\nlr = 0.001\n")
    node = ImplementInput(
        node_id=3, title="wider", hypothesis={}, edits={"c.toml:m.hidden": 32}, reflection="",
        editable=["c.toml"], targets={}, runtime=None,
    )  # fmt: skip
    model = Scripted()  # no answers: a model turn would fail
    account = LlmPolicy(model).implement(tmp_path, node)  # type: ignore[arg-type]
    assert "hidden = 32" in (tmp_path / "c.toml").read_text() and "c.toml" in account
    assert model.prompts == []


def test_where_ideas_are_settings_only_a_child_without_edits_is_refused_and_asked_again() -> None:
    nodes = [ev(1, None, {}, 0.5, "merged")]
    code = child(title="a deeper net", mechanism="add a second hidden layer in model.py")
    setting = child(title="wider", edits=[{"key": "c.toml:m.hidden", "value": 32}])
    model = Scripted(json.dumps({"children": [code]}), json.dumps({"children": [code, setting]}))
    told: list[tuple[Any, ...]] = []
    policy = LlmPolicy(model, refused=lambda *a: told.append(a), settings_only=True)  # type: ignore[arg-type]
    props = policy.ideate(ctx(nodes, k=2))
    assert [(p.title, p.edits) for p in props] == [("wider", {"c.toml:m.hidden": 32})]
    assert told[0][0] == "ideator" and "edits: set at least one of the settings" in told[0][2]
    assert model.schemas[0]["properties"]["children"]["items"]["properties"]["edits"]["minItems"] == 1
    assert "sets at least one of the settings" in model.prompts[0][0]["content"]
    # Without settings to set, a code change is what a child is.
    plain = Scripted(json.dumps({"children": [code]}))
    bare = replace(ctx(nodes, k=1), search_space={}, base_values={})
    assert [p.title for p in LlmPolicy(plain, settings_only=True).ideate(bare)] == ["a deeper net"]  # type: ignore[arg-type]


def test_a_change_of_settings_made_stale_by_a_merge_is_revisited_with_its_edits() -> None:
    from agents.policies.llm.ideation import revisits

    nodes = [
        ev(1, None, {}, 0.5, "merged"),
        ev(2, 1, {"c.toml:t.lr": 0.01}, 0.6),
        ev(3, 1, {}, 0.7, "merged"),
    ]
    again = revisits(replace(ctx(nodes, k=2), trunk_node_id=3, revisit=[2]))
    assert [(p.parent_id, p.origin, p.origin_ref, p.edits) for p in again] == [
        (3, "revisit", 2, {"c.toml:t.lr": 0.01})
    ]


def test_a_number_too_large_for_a_float_and_a_text_answer_without_its_field_are_refused() -> None:
    from agents.policies.llm.ideation import prose

    huge = json.dumps({"children": [child(edits=[{"key": "t.lr", "value": 10**400}])]})
    with pytest.raises(Unusable, match="takes a number"):
        children_of(huge, None, Space(SPACE, BASE))
    read = prose("insight", "ROLE: insight")
    assert read('{"insight": "n2 helps: a wider layer"}') == "n2 helps: a wider layer"
    assert read("n2 helps: a wider layer") == "n2 helps: a wider layer"
    for answer in ('{"insight": null}', '{"lesson": "n2 helps"}'):
        with pytest.raises(Unusable, match='needs "insight"'):
            read(answer)
