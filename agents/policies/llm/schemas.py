"""The JSON schema of each role's answer: what a server that constrains decoding holds the model to.

Each is built from what the answer is read into, with the values the study allows where they are
known (the nodes that may take children, the soft constraints' names, the nodes that exist) and a
length cap on every text, so a small model can neither wander off the form nor write forever.
"""

from __future__ import annotations

from typing import Any

from agents.policies.space import Space

TITLE = 120
PROSE = 600  # the longest text a schema asks for: llama.cpp refuses the grammar of 1,200 (and then fails)
TEXT = 300
ITEM = 240


# What a text in an answer may hold: it starts with a letter or digit (never "..." or "<text>") and
# holds printable ASCII but quotes and backslashes, so a grammar built from it never breaks the JSON.
SAFE = "A-Za-z0-9 _.,;:()=+*/%<>!?'`#&@|~-"


def _text(cap: int = TEXT, least: int = 1) -> dict[str, Any]:
    pattern = f"^[A-Za-z0-9][{SAFE}]{{{max(least - 1, 0)},{cap - 1}}}$"
    return {"type": "string", "minLength": least, "maxLength": cap, "pattern": pattern}


def _nodes(numbers: list[int]) -> dict[str, Any]:
    return {"type": "integer", "enum": sorted(set(numbers))} if numbers else {"type": "integer"}


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


GRID = 9  # values a range is offered as: a server's grammar holds a model to listed values, not to bounds


def _value(space: Space, key: str) -> dict[str, Any]:
    """Return the schema of a value `key` may take: one of those `offered`."""
    return {"enum": offered(space, key)}


def offered(space: Space, key: str) -> list[Any]:
    """Return the values a model is offered for `key`: its own, or `GRID` points spread over its range
    (log-spaced on a log range) and the repository's value."""
    if not space.is_range(key):
        return space.values(key)
    points: list[Any] = []
    for i in range(GRID):
        v = space.snap(key, i / (GRID - 1))
        v = v if space.is_int(key) else space.clean(key, float(f"{v:.2g}"))  # values a person would write
        if v not in points:
            points.append(v)
    here = space.base.get(key)  # the repository's own value, to go back to
    if here is not None and here not in points and space.contains(key, here):
        points = sorted([*points, here], key=float)
    return points


def edits(space: Space, least: int = 0) -> dict[str, Any]:
    """Return the schema of a child's edits: each a `[search]` key of `space` and a value it may take
    (at least `least` of them)."""
    options = [
        _object({"key": {"type": "string", "enum": [key]}, "value": _value(space, key)}, ["key", "value"])
        for key in space.keys
    ]
    return {"type": "array", "items": {"anyOf": options}, "minItems": least, "maxItems": len(options)}


def ideator(k: int, parents: list[int], space: Space | None = None, needed: bool = False) -> dict[str, Any]:
    """Return the ideator's schema: 1 to `k` children, each under one of `parents` (node numbers), with
    edits of the `[search]` keys of `space` where the study declares any (one at least, if `needed`)."""
    settings = {"edits": edits(space, int(needed))} if space is not None and space.keys else {}
    child = _object(
        {
            "parent_id": _nodes(parents),
            "title": _text(TITLE, 3),
            **settings,
            "mechanism": _text(TEXT, 8),
            "hypothesis": _text(TEXT, 8),
            "observable": _text(TEXT, 8),
            "risks": _text(TEXT, 4),
            "expected_gain": {"type": "number"},
        },
        ["parent_id", "title", *settings, "mechanism", "hypothesis", "observable", "risks", "expected_gain"],
    )
    children = {"type": "array", "items": child, "minItems": 1, "maxItems": max(1, k)}
    return _object({"children": children}, ["children"])


def prose(field: str, cap: int) -> dict[str, Any]:
    """Return the schema of a one-text answer (an insight, a reflection): `{field: text}`."""
    return _object({field: _text(min(cap, PROSE), 8)}, [field])


def verifier(names: list[str]) -> dict[str, Any]:
    """Return the verifier's schema: one verdict per soft constraint of `names`, and a call."""
    verdict = _object(
        {
            "name": {"type": "string", "enum": names} if names else _text(80),
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
            "reason": _text(),
        },
        ["name", "confidence", "reason"],
    )
    verdicts = {"type": "array", "items": verdict, "minItems": len(names), "maxItems": max(1, len(names))}
    call = {"type": "string", "enum": ["accept", "refine", "restart"]}
    return _object({"verdicts": verdicts, "call": call, "why": _text()}, ["verdicts", "call", "why"])


def state(numbers: list[int], items: int = 8) -> dict[str, Any]:
    """Return the improvement state's schema, its node references among `numbers`."""
    ids = {"type": "array", "items": _nodes(numbers), "maxItems": 8}

    def listed(item: dict[str, Any]) -> dict[str, Any]:
        return {"type": "array", "items": item, "maxItems": items}

    finding = _object({"text": _text(ITEM), "node_ids": ids}, ["text", "node_ids"])
    status = _text(40)
    constraint = _object(
        {"name": _text(80), "status": status, "detail": _text(ITEM), "node_ids": ids},
        ["name", "status", "detail", "node_ids"],
    )
    rejected = _object({"node_id": _nodes(numbers), "reason": _text(ITEM)}, ["node_id", "reason"])
    return _object(
        {
            "verified_findings": listed(finding),
            "open_constraints": listed(constraint),
            "rejected_candidates": listed(rejected),
            "concerns": listed(_text(ITEM)),
            "next_plan": listed(_text(ITEM)),
        },
        ["verified_findings", "open_constraints", "rejected_candidates", "concerns", "next_plan"],
    )


ARGUMENT = 300  # characters of a short argument of an action (a path, a command, a pattern)
LONG = ("content", "search", "replace", "report")  # bounded by the answer's token cap alone: a long
# maxLength becomes a grammar too large for a server to decode with quickly


def action(tools: list[dict[str, Any]], editable: list[str] | None = None) -> dict[str, Any]:
    """Return the schema of one executor action in the text format: `{"tool": name, ...its arguments}`.

    `tools` are the function schemas the executor has; paths a change may write are listed where
    `editable` names plain files (no wildcards).
    """
    plain = sorted(p for p in editable or [] if not any(ch in p for ch in "*?["))
    options = []
    for tool in tools:
        params = tool.get("parameters", {})
        properties: dict[str, Any] = {"tool": {"type": "string", "enum": [tool["name"]]}}
        for name, spec in params.get("properties", {}).items():
            spec = dict(spec)
            if spec.get("type") == "string" and name not in LONG:
                spec["maxLength"] = ARGUMENT
                if name == "path" and plain and tool["name"] in ("write", "edit"):
                    spec = {"type": "string", "enum": plain}
            properties[name] = spec
        options.append(_object(properties, ["tool", *params.get("required", [])]))
    return {"anyOf": options}
