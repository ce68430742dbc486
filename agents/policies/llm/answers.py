"""Reading structured answers out of model text, as real models write them.

Models write a node as `n3`, `"3"` or 3, a number as `"+0.5"` or `"5%"`, a confidence on a 0–1 or a
0–100 scale, an enum in any case, and JSON with a trailing comma. The readers here accept those
forms and leave anything else as it is, for the caller's validation to refuse with a message the
model can act on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

_NODE = re.compile(r"^\s*(?:node\s*|n\s*)?#?\s*(\d+)\s*$", re.I)
_NUMBER = re.compile(
    r"^\s*[~≈]?\s*([+\-−]?\s*(?:\d+(?:\.\d*)?|\.\d+)(?:e[+\-]?\d+)?)\s*(%|percent)?\s*$", re.I
)
_TRAILING_COMMA = re.compile(r",(\s*[}\]])")
NODE_KEYS = frozenset({"node_id", "node_ids", "parent_id", "nodes"})  # keys whose values are nodes


def json_object(text: str) -> dict[str, Any] | None:
    """Return the first JSON object in `text` (fences, prose and trailing text around it are ignored).

    An object that is valid JSON but for trailing commas is read too.
    """
    value = _first(text, "{", dict)
    return value if isinstance(value, dict) else None


def json_list(text: str) -> list[Any] | None:
    """Return the first JSON array in `text`, or None."""
    value = _first(text, "[", list)
    return value if isinstance(value, list) else None


def _first(text: str, opener: str, kind: type) -> Any:
    for lenient in (False, True):
        for m in re.finditer(re.escape(opener), text):
            rest = text[m.start() :]
            if lenient:
                rest = _TRAILING_COMMA.sub(r"\1", rest)
            try:
                value, _ = json.JSONDecoder().raw_decode(rest)
            except ValueError:
                continue
            if isinstance(value, kind):
                return value
    return None


def node_number(value: Any) -> Any:
    """Return a node number written as 3, 3.0, "3", "n3", "#3" or "node 3"; any other value unchanged."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and (m := _NODE.match(value)):
        return int(m.group(1))
    return value


def node_refs(value: Any) -> Any:
    """Return `value` with every node written as text (`"n3"`) under a node key made a number."""
    if isinstance(value, list):
        return [node_refs(v) for v in value]
    if not isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for k, v in value.items():
        if k in NODE_KEYS:
            out[k] = [node_number(x) for x in v] if isinstance(v, list) else node_number(v)
        else:
            out[k] = node_refs(v)
    return out


def _parsed(value: Any) -> tuple[float, bool] | None:
    """Return a number written as a number or as text, and whether it was a percentage."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        try:
            return float(value), False
        except OverflowError:  # an integer of hundreds of digits is no number a setting takes
            return None
    if isinstance(value, str) and (m := _NUMBER.match(value)):
        digits = m.group(1).replace("−", "-").replace(" ", "")
        try:
            return float(digits), m.group(2) is not None
        except ValueError:
            return None
    return None


def number(value: Any, percent_of: float | None = None) -> Any:
    """Return a number written as 0.5, "0.5", "+0.5" or "5%"; any other value unchanged.

    A percentage is that many hundredths of `percent_of` (a gain of "5%" over a trunk scoring 10 is
    0.5), or of 1 when `percent_of` is unknown or zero.
    """
    got = _parsed(value)
    if got is None:
        return value
    x, percent = got
    if percent:
        return x / 100 * (abs(percent_of) if percent_of else 1.0)
    return x


def confidence(value: Any) -> Any:
    """Return a 0–100 confidence from 0.9, 90, "90", "90%" or "0.9"; any other value unchanged.

    A plain number from 0 to 1 is a fraction (0.9 and 1 are 90 and 100); above 1 it is already on the
    0–100 scale. The result is rounded to a whole number.
    """
    got = _parsed(value)
    if got is None:
        return value
    x, percent = got
    if not percent and 0 <= x <= 1:
        x *= 100
    return round(x)


def choice(value: Any, options: Iterable[str]) -> Any:
    """Return the option `value` names, whatever its case, spaces and closing punctuation; else `value`."""
    if not isinstance(value, str):
        return value
    key = value.strip().strip(".!\"'`").strip().lower()
    for option in options:
        if option.lower() == key:
            return option
    return value


def name_key(text: str) -> str:
    """Return a name reduced to its letters and digits, in lower case ("Readable" and "readable" agree)."""
    return re.sub(r"[^0-9a-z]", "", text.lower())
