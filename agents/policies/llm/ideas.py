"""When two proposed ideas are the same idea: equal change, or equal mechanism and parameters.

Never by how alike their titles or texts read: "Set learning rate to 0.003" and "Set learning rate
to 0.01" are two experiments. Numbers are part of an idea's identity, compared as values
("0.010" is "1e-2"); words are compared after case, punctuation and filler words are set aside,
clause by clause, so "lr 0.01 and width 64" is "width 64, lr 0.01" but not "lr 64 and width 0.01".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MECHANISM_CHARS = 300  # what storage keeps of a node's mechanism: a proposal is compared on as much

_TOKEN = re.compile(r"(?:(?<![a-z0-9])-)?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?|[a-z]+")
_CLAUSE = re.compile(r"[,;\n]|\band\b|\bplus\b|\bthen\b")
# Words that say nothing about which change an idea makes.
_FILLER = frozenset({
    "a", "an", "the", "to", "of", "from", "in", "on", "at", "for", "by", "with", "into", "as", "its", "it",
    "is", "be", "this", "that", "set", "use", "using", "make", "try", "change",
})  # fmt: skip


@dataclass(frozen=True)
class Identity:
    """What makes an idea the idea it is."""

    change: str  # the normalized change (a config policy's edits), "" when the idea names none
    mechanism: tuple[tuple[str, ...], ...]  # its clauses, each a sequence of words and numbers
    parameters: frozenset[str]  # every number in its title and mechanism


def _number(token: str) -> str | None:
    try:
        return repr(float(token))
    except ValueError:
        return None


def _clause(text: str) -> tuple[str, ...]:
    out = []
    for token in _TOKEN.findall(text):
        number = _number(token)
        if number is not None:
            out.append(number)
        elif token not in _FILLER:
            out.append(token)
    return tuple(out)


def numbers(text: str) -> frozenset[str]:
    """Return the numbers a text names, as canonical values."""
    return frozenset(n for t in _TOKEN.findall(text.lower()) if (n := _number(t)) is not None)


def identity(title: str, mechanism: str, edits: dict[str, Any] | None = None) -> Identity:
    """Return an idea's identity; the mechanism is its title where it gives none."""
    said = (mechanism.strip()[:MECHANISM_CHARS] or title).lower()
    clauses = {c for c in (_clause(part) for part in _CLAUSE.split(said)) if c}
    change = json.dumps(edits, sort_keys=True, default=str) if edits else ""
    return Identity(change, tuple(sorted(clauses)), numbers(title) | numbers(said))


def same(a: Identity, b: Identity) -> bool:
    """Return whether two ideas are one: equal change, or equal mechanism and equal parameters."""
    if a.change and b.change:
        return a.change == b.change
    return bool(a.mechanism) and a.mechanism == b.mechanism and a.parameters == b.parameters
