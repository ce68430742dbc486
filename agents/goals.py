"""Read limits out of a goal in words: "keep the model under 30k parameters" → `n_params <= 30000`.

`limits(goal, names)` finds phrases that bound a quantity ("under 30k parameters", "latency
below 50 ms", "at least 0.9 recall", "n_params < 3e4") and keeps those whose quantity matches a
metric the evaluator prints (`names`), by the words they share ("parameters" is `n_params`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

NUMBER = r"(\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?)\s*(k|m|b|thousand|million|billion|%)?(?![a-z])"
_WORD = r"(?!(?:and|or|but|while|with|without|so|then|than)\b)[a-z][\w-]*"
WORDS = rf"({_WORD}(?:\s+{_WORD}){{0,2}})"
UPPER = r"(?:under|below|less than|fewer than|at most|no more than|not more than|not above|within|<=?|≤)"
LOWER = r"(?:over|above|more than|at least|no less than|not below|>=?|≥)"
SCALE = {"k": 1e3, "thousand": 1e3, "m": 1e6, "million": 1e6, "b": 1e9, "billion": 1e9, "%": 0.01}
FILLER = {
    "the",
    "a",
    "an",
    "of",
    "model",
    "models",
    "total",
    "number",
    "num",
    "n",
    "its",
    "our",
    "keep",
    "it",
}
SYNONYMS = {
    "parameter": "param", "param": "param", "weight": "param", "second": "time", "sec": "time",
    "ms": "time", "millisecond": "time", "latency": "time", "runtime": "time", "duration": "time",
    "megabyte": "mb", "memory": "mem", "mem": "mem", "byte": "size", "size": "size",
}  # fmt: skip


@dataclass(frozen=True)
class Limit:
    """A bound on a printed metric, read from the goal's words."""

    metric: str
    min: float | None
    max: float | None
    phrase: str


def _stem(word: str) -> str:
    word = word.lower().strip("-_")
    for end in ("ies", "es", "s"):
        if len(word) > len(end) + 2 and word.endswith(end) and not word.endswith("ss"):
            word = word[: -len(end)] + ("y" if end == "ies" else "")
            break
    return SYNONYMS.get(word, word)


def _tokens(text: str) -> set[str]:
    return {_stem(w) for w in re.split(r"[\s_\-./]+", text) if w} - {_stem(f) for f in FILLER}


def _value(number: str, scale: str | None) -> float:
    return float(number.replace(",", "")) * SCALE.get((scale or "").lower(), 1.0)


def _match(words: str, names: list[str]) -> str | None:
    wanted = _tokens(words)
    if not wanted:
        return None
    scored = [(len(wanted & _tokens(n)), -len(n), n) for n in names]
    best = max(scored, default=(0, 0, ""))
    return best[2] if best[0] else None


def limits(goal: str, names: list[str]) -> list[Limit]:
    """Return the bounds the goal puts on metrics in `names`, one per metric (the first phrase wins)."""
    text = goal.lower()
    found: list[tuple[int, str, str, float, str]] = []  # (position, side, words, value, phrase)
    patterns = [
        (
            rf"\b{WORDS}\s+(?:of\s+|at\s+|to\s+|stays?\s+|remains?\s+|is\s+|are\s+)?({UPPER}|{LOWER})\s*{NUMBER}",
            "after",
        ),
        (rf"({UPPER}|{LOWER})\s*{NUMBER}\s*{WORDS}", "before"),
    ]
    for pattern, where in patterns:
        for m in re.finditer(pattern, text):
            if where == "after":
                words, op, number, scale = m.group(1), m.group(2), m.group(3), m.group(4)
            else:
                op, number, scale, words = m.group(1), m.group(2), m.group(3), m.group(4)
            side = "max" if re.fullmatch(UPPER, op) else "min"
            if not math.isfinite(_value(number, scale)):
                continue
            found.append((m.start(), side, words, _value(number, scale), m.group(0).strip()))
    out: dict[str, Limit] = {}
    for _, side, words, value, phrase in sorted(found):
        metric = _match(words, names)
        if metric is None or metric in out:
            continue
        out[metric] = Limit(
            metric, value if side == "min" else None, value if side == "max" else None, phrase
        )
    return list(out.values())
