from __future__ import annotations

import pytest

from agents.spec import SpecError, parse_spec
from agents.speccheck import check_against_tree
from tests.support.repos import tiny_files

GOOD = tiny_files()["grove.toml"]


def issues(text: str) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_spec(text)
    return {i.key: i.message for i in info.value.issues}


def test_good_spec_parses_with_defaults() -> None:
    spec = parse_spec(GOOD)
    assert spec.study.name == "tiny"
    assert spec.maximize
    assert spec.policy_kind == "search"
    assert spec.budget.hours == 2.0
    assert spec.search["config.toml:knob.x"].values == [0, 1, 2, 3, 4, 5]


def test_unknown_key_is_named() -> None:
    got = issues(GOOD.replace('goal = "', 'colour = "red"\ngoal = "'))
    assert got == {"study.colour": "unknown key"}


def test_unknown_section_is_named() -> None:
    assert issues(GOOD + "\n[extras]\nx = 1\n") == {"extras": "unknown key"}


def test_wrong_type_is_named_with_value() -> None:
    got = issues(GOOD.replace("\nrepeats = 2", '\nrepeats = "two"'))
    assert list(got) == ["evaluate.repeats"]
    assert "integer" in got["evaluate.repeats"] and "'two'" in got["evaluate.repeats"]


def test_direction_must_be_maximize_or_minimize() -> None:
    got = issues(GOOD.replace('direction = "maximize"', 'direction = "up"'))
    assert "maximize" in got["objective.direction"] and "'up'" in got["objective.direction"]


def test_missing_required_key() -> None:
    got = issues(GOOD.replace('metric = "score"\n', "", 1))
    assert got == {"objective.metric": "required key is missing"}


def test_not_toml() -> None:
    got = issues("[study\nname=1")
    assert "not valid TOML" in got[""]


def test_bad_search_entries_are_named() -> None:
    text = GOOD.replace(
        '"config.toml:knob.x" = { values = [0, 1, 2, 3, 4, 5] }',
        '"config.txt" = { values = [1, 2] }\n"config.toml:knob.y" = { low = 2, high = 1 }',
    )
    got = issues(text)
    assert "expected 'FILE:dotted.key'" in got['search."config.txt"']


def test_range_must_be_ordered() -> None:
    text = GOOD.replace("{ values = [0, 1, 2, 3, 4, 5] }", "{ low = 2, high = 1 }")
    assert issues(text) == {'search."config.toml:knob.x"': "low must be below high"}


def test_constraint_needs_a_bound() -> None:
    got = issues(GOOD.replace("max = 4\n", ""))
    assert got == {"constraints[0]": "needs min, max or both"}


def test_slug_name() -> None:
    got = issues(GOOD.replace('name = "tiny"', 'name = "Tiny Study"'))
    assert "slug" in got["study.name"]


FILES = ["eval.py", "config.toml", "data/test/offset.txt", "grove.toml"]


def read(path: str) -> str:
    return tiny_files()[path]


def test_globs_and_search_keys_checked_against_files() -> None:
    spec = parse_spec(
        GOOD.replace('protected = ["eval.py"]', 'protected = ["eval.py", "missing/*.py"]').replace(
            '"config.toml:knob.x" = { values = [0, 1, 2, 3, 4, 5] }',
            '"config.toml:knob.x" = { values = [0, 1] }\n"config.toml:knob.nope" = { values = [0, 1] }\n'
            '"other.toml:a.b" = { values = [0, 1] }',
        )
    )
    got = {i.key: i.message for i in check_against_tree(spec, FILES, read)}
    assert "matches no file" in got["files.protected[1]"]
    assert got['search."config.toml:knob.nope"'] == "key 'knob.nope' not found in config.toml"
    assert "does not exist at base" in got['search."other.toml:a.b"']
    assert 'search."config.toml:knob.x"' not in got


def test_clean_spec_has_no_tree_issues() -> None:
    assert check_against_tree(parse_spec(GOOD), FILES, read) == []


def test_soft_constraints_need_a_description_and_the_llm_policy() -> None:
    soft = '[[constraints]]\nname = "clear"\njudge = "llm"\n'
    got = issues(GOOD.replace("[search]", soft + "\n[search]"))
    assert "needs a description" in got["constraints[1]"]
    described = soft + 'description = "the code stays readable"\n'
    got = issues(GOOD.replace("[search]", described + "\n[search]"))
    assert "need policy.kind = 'llm'" in got[""]


def test_gate_mode_review_is_refused_with_the_alternatives() -> None:
    assert 'mode = "auto"' in GOOD
    got = issues(GOOD.replace('mode = "auto"', 'mode = "review"'))
    assert list(got) == ["gate.mode"]
    assert "'approve'" in got["gate.mode"] and "'auto'" in got["gate.mode"]


def test_policy_sampler_and_max_depth() -> None:
    assert "[policy]\n" in GOOD
    spec = parse_spec(GOOD.replace("[policy]\n", '[policy]\nsampler = "gp"\nmax_depth = 2\n'))
    assert spec.policy.sampler == "gp" and spec.policy.max_depth == 2
    assert parse_spec(GOOD).policy.sampler == "auto"
    assert list(issues(GOOD.replace("[policy]\n", '[policy]\nsampler = "cmaes"\n'))) == ["policy.sampler"]


def test_policy_temperature_is_one_number_or_a_table_by_role() -> None:
    spec = parse_spec(GOOD.replace("[policy]\n", "[policy]\ntemperature = 0.7\n"))
    assert spec.policy.temperature == 0.7 and parse_spec(GOOD).policy.temperature is None
    table = parse_spec(
        GOOD.replace("[policy]\n", "[policy]\ntemperature = { ideator = 0.9, executor = 0 }\n")
    )
    assert table.policy.temperature == {"ideator": 0.9, "executor": 0.0}
    got = issues(GOOD.replace("[policy]\n", "[policy]\ntemperature = { ideatr = 0.9 }\n"))
    assert list(got) == ["policy.temperature"] and "ideatr: not a role" in got["policy.temperature"]
    assert "ideator, executor, verifier" in got["policy.temperature"]
    for bad in ("3", '"hot"', "true", "{ executor = -1 }", '{ executor = "low" }'):
        got = issues(GOOD.replace("[policy]\n", f"[policy]\ntemperature = {bad}\n"))
        assert list(got) == ["policy.temperature"] and "from 0 to 2" in got["policy.temperature"], got
