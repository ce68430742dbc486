"""Reading model answers as real open models write them: node ids, numbers, percentages, scales, enums."""

from __future__ import annotations

import json

import pytest

from agents.policies.llm import answers
from agents.policies.llm.ideation import Child, Unusable, children_of
from agents.policies.llm.policy import Verdicts


def test_node_ids_numbers_percentages_and_confidences_parse() -> None:
    assert [answers.node_number(v) for v in (3, 3.0, "3", "n3", "N3", " #3 ", "node 3")] == [3] * 7
    assert answers.node_number("the root") == "the root" and answers.node_number(2.5) == 2.5
    assert answers.number("+0.5") == 0.5 and answers.number("−0.25") == -0.25 and answers.number(2) == 2.0
    assert answers.number("5%", 10.0) == pytest.approx(0.5) and answers.number("5%", -10.0) == pytest.approx(
        0.5
    )
    assert answers.number("5%") == pytest.approx(0.05) and answers.number("5 percent", 0.0) == pytest.approx(
        0.05
    )
    assert answers.number("a lot") == "a lot" and answers.number(True) is True
    assert [answers.confidence(v) for v in (0.9, "0.9", 90, "90", "90%", 90.4, 1, 0)] == [
        90,
        90,
        90,
        90,
        90,
        90,
        100,
        0,
    ]
    assert answers.confidence(150) == 150 and answers.confidence("high") == "high"  # left for the range check
    assert (
        answers.choice("Refine.", ("accept", "refine")) == "refine"
        and answers.choice("ACCEPT", ("accept",)) == "accept"
    )
    assert answers.choice("maybe", ("accept",)) == "maybe"
    assert answers.json_object('Here:\n```json\n{"a": [1, 2,],}\n```') == {"a": [1, 2]}
    assert answers.node_refs({"verified_findings": [{"text": "t", "node_ids": ["n2", 3]}], "x": {"node_id": "n4"}}) == {
        "verified_findings": [{"text": "t", "node_ids": [2, 3]}], "x": {"node_id": 4},
    }  # fmt: skip


def test_an_ideators_children_parse_in_the_forms_models_write() -> None:
    child = Child.model_validate(
        {"parent_id": "n1", "title": "t", "expected_gain": "5%"}, context={"trunk": 8.0}
    )
    assert child.parent_id == 1 and child.expected_gain == pytest.approx(0.4)
    assert Child.model_validate({"parent_id": "2", "title": "t", "expected_gain": None}).expected_gain == 0.0
    one = '{"parent_id": "n1", "title": "A", "expected_gain": "+0.2"}'
    assert [c.parent_id for c in children_of(f'{{"children": [{one}]}}')] == [1]
    assert [c.title for c in children_of(f"Ideas:\n[{one}, {one.replace('A', 'B')}]")] == [
        "A",
        "B",
    ]  # a bare list
    assert [c.title for c in children_of(f'{{"proposals": [{one}]}}')] == ["A"]
    assert [c.title for c in children_of(one)] == ["A"]  # one child alone
    with pytest.raises(Unusable, match="no JSON object"):
        children_of("I think we should widen the network.")
    with pytest.raises(Unusable, match="parent_id"):
        children_of('{"children": [{"parent_id": "the root", "title": "A"}]}')


def test_a_verifiers_scales_and_enums_parse() -> None:
    v = Verdicts.model_validate({"verdicts": [{"name": "Readable", "confidence": 0.9}], "call": "Accept"})
    assert v.verdicts[0].confidence == 90 and v.call == "accept"
    v = Verdicts.model_validate({"verdicts": {"readable": "85%", "small": {"confidence": 70}}, "call": None})
    assert [(x.name, x.confidence) for x in v.verdicts] == [("readable", 85), ("small", 70)] and v.call == ""
    with pytest.raises(ValueError, match="less than or equal to 100"):
        Verdicts.model_validate({"verdicts": [{"name": "r", "confidence": 150}]})
    with pytest.raises(ValueError, match="'accept', 'refine' or 'restart'"):
        Verdicts.model_validate({"call": "ship it"})


def test_a_child_that_fills_the_form_without_an_idea_is_refused() -> None:
    real = {"parent_id": 1, "title": "wider hidden layer", "mechanism": "more capacity"}
    assert children_of(json.dumps({"children": [real]}))[0].title == "wider hidden layer"
    for field, text in (("title", "..."), ("mechanism", "..."), ("hypothesis", "…"), ("title", "string"),
                        ("risks", "<placeholder>"), ("observable", "TODO"), ("title", " -- ")):  # fmt: skip
        with pytest.raises(Unusable, match="placeholder"):
            children_of(json.dumps({"children": [{**real, field: text}]}))
    # One empty optional text is no placeholder; a valid sibling is kept beside a refused one.
    kept = children_of(json.dumps({"children": [{**real, "risks": ""}, {**real, "title": "..."}]}))
    assert [c.title for c in kept] == ["wider hidden layer"]
