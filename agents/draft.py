"""A drafted spec: what it says (`Choices`), written out as grove.toml."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Choices:
    """What a draft spec says, before it is written out as TOML."""

    name: str
    goal: str
    base: str = ""
    metric: str = "score"
    direction: str = "maximize"
    dev: str = "python eval.py dev"
    test: str = "python eval.py test"
    editable: list[str] = field(default_factory=list)
    protected: list[str] = field(default_factory=list)
    sealed: list[str] = field(default_factory=list)
    formats: dict[str, str] = field(default_factory=dict)
    search: dict[str, dict[str, Any]] = field(default_factory=dict)
    constraints: list[dict[str, Any]] = field(default_factory=list)  # each with the goal's phrase in "why"
    setup: str = ""
    env_inputs: list[str] = field(default_factory=list)  # environment.inputs, where not the default
    notes: list[str] = field(default_factory=list)
    writes: dict[str, str] = field(default_factory=dict)  # files the draft adds beside grove.toml


def fmt_value(dim: dict[str, Any]) -> str:
    """Return a search dimension in words, as a draft's notes show it (values, or a range)."""
    if "values" in dim:
        return json.dumps(dim["values"])
    return (
        f"[{dim['low']:g}, {dim['high']:g}]"
        + (" log" if dim.get("log") else "")
        + (" integer" if dim.get("integer") else "")
    )


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{ " + ", ".join(f"{_key(str(k))} = {_toml(v)}" for k, v in value.items()) + " }"


def _key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def drop(c: Choices, noop: dict[str, str]) -> list[str]:
    """Drop knobs that moved no metric (and those conditional on one) from the draft; return them."""
    gone = [k for k in c.search if k in noop or any(p in noop for p in c.search[k].get("when", {}))]
    for key in gone:
        del c.search[key]
    if gone:
        tried = "; ".join(f"{k}: {noop[k]}" for k in gone if k in noop)
        c.notes.append(
            f"dropped from the search: {', '.join(gone)} (moving it changed no metric on dev: {tried}; "
            "the evaluator does not read it)"
        )
    return gone


def one_line(text: str) -> str:
    """Return text with every control character (a line break above all) turned into a space."""
    return re.sub(r"[\x00-\x1f\x7f\u2028\u2029\x85]", " ", text)


def _constraint_lines(c: Choices) -> list[str]:
    lines = []
    for con in c.constraints:
        lines += [f"[[constraints]]   # from the goal: {one_line(con['why'])}"]
        lines += [f"{k} = {_toml(v)}" for k, v in con.items() if k != "why"]
        lines.append("")
    return lines


def render(c: Choices) -> str:
    """Write the choices out as a commented grove.toml."""
    lines = [
        "# Drafted by Grove from what it found in the repository; every line is yours to change.",
        "# Each choice is explained in a comment; `grove validate` checks it and runs dev once.",
        "[study]",
        f"name = {_toml(c.name)}",
        f"goal = {_toml(c.goal)}",
    ]
    if c.base:
        lines.append(f"base = {_toml(c.base)}")
    lines += [
        "",
        "[objective]",
        f"metric = {_toml(c.metric)}          # a key of the JSON line the evaluator prints",
        f"direction = {_toml(c.direction)}",
        "",
        "[evaluate]",
        f"dev = {_toml(c.dev)}     # scores a change; GROVE_SEED=0,1,2 for the repeats",
        f"test = {_toml(c.test)}   # the sealed held-out score: only the gate runs it",
        "# If that command runs code a change may edit, it could read the held-out labels: split it",
        "# into test_predict (writes $GROVE_OUTPUTS, no labels) and test_score (protected code only).",
        "repeats = 3",
        "",
        *_constraint_lines(c),
        "[files]",
        f"editable = {_toml(c.editable or ['TODO-config-file'])}   # what a change may touch",
        f"protected = {_toml(c.protected)}   # never changed: the evaluator and its data",
        f"sealed = {_toml(c.sealed)}   # hidden from every experiment",
    ]
    if c.formats:
        lines.append(f"formats = {_toml(c.formats)}   # files whose name does not say their format")
    if c.search:
        lines += ["", "[search]   # the space the search policy explores"]
        lines += [f"{_toml(k)} = {_toml(v)}" for k, v in c.search.items()]
    if c.setup:
        lines += [
            "",
            "[environment]   # built once per repository and dependency files, then shared by every run",
            f"setup = {_toml(c.setup)}",
            "network = true   # the setup step downloads packages",
            *(
                [f"inputs = {_toml(c.env_inputs)}   # the files whose content keys the build"]
                if c.env_inputs
                else []
            ),
        ]
    lines += [
        "",
        "[budget]",
        "experiments = 20",
        "parallel = 2",
        "",
        "[gate]",
        'mode = "approve"   # a human approves each change that clears the sealed gate',
        "",
        "# Why each choice was made:",
        *(f"# - {one_line(n)}" for n in c.notes),
        "",
    ]
    return "\n".join(lines)
