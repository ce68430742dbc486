"""Widen a `[search]` range on the side where a merged change landed on its bound.

A merge at a range's bound says the optimum may lie beyond it. Replaying the merged nodes in
order, each value within 2% of a bound (in the range's own coordinates: log or linear) moves that
bound out — a log range by a factor of up to 10, a linear one by half its width — never past a
natural limit: 0 for a range that starts at or above 0, 1 for an integer range starting at 1,
0 or 1 for a range inside [0, 1] (a probability or fraction), nor below what a parameter
accepts (`min_samples_split` 2); a log range stays above 0.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

EDGE = 0.02


@dataclass(frozen=True)
class Widening:
    """One bound moved out because a merged node's value sat on it."""

    key: str
    side: str  # "low" | "high"
    value: float
    old: float
    new: float
    node_id: int
    number: int

    def text(self) -> str:
        """Describe it as a finding."""
        return (
            f"n{self.number} merged {self.key} = {self.value:.6g}, on the {self.side} bound of its range "
            f"({self.old:.6g}): the optimum may lie beyond it, so later proposals may go to {self.new:.6g}"
        )


def _coord(dim: dict[str, Any], v: float) -> float:
    return math.log(v) if dim.get("log") else v


def on_bound(dim: dict[str, Any], value: float) -> str | None:
    """Return the side of the range `value` sits on ("low"/"high"), or None."""
    low, high = float(dim["low"]), float(dim["high"])
    if dim.get("log") and value <= 0:
        return None
    span = _coord(dim, high) - _coord(dim, low)
    if not low - 1e-9 * abs(low) <= value <= high + 1e-9 * abs(high):
        return None  # set by hand outside the range: not the search running into its edge
    if _coord(dim, value) - _coord(dim, low) <= EDGE * span:
        return "low"
    if _coord(dim, high) - _coord(dim, value) <= EDGE * span:
        return "high"
    return None


def _whole(dim: dict[str, Any]) -> bool:
    return float(dim["low"]).is_integer() and float(dim["high"]).is_integer()


FLOORS = {"min_samples_split": 2.0}  # scikit-learn refuses less


def widened_bound(dim: dict[str, Any], side: str, key: str = "") -> float | None:
    """Return the bound moved out on `side`, or None where it is a natural limit."""
    low, high = float(dim["low"]), float(dim["high"])
    bound = low if side == "low" else high
    integer = bool(dim.get("integer"))
    if dim.get("log"):
        factor = min(10.0, high / low)
        new = low / factor if side == "low" else high * factor
    else:
        step = (high - low) / 2
        new = low - step if side == "low" else high + step
        if side == "low" and low >= 0:
            new = max(new, 0.0)
    if integer:
        new = float(math.floor(new) if side == "low" else math.ceil(new))
        if side == "low" and low >= 1:
            new = max(new, 1.0)
    if side == "low":
        new = max(new, FLOORS.get(key.rsplit(":", 1)[-1].rsplit(".", 1)[-1], -math.inf))
    if low >= 0.0 and high <= 1.0:  # a probability or fraction stays within [0, 1]
        new = min(max(new, 0.0), 1.0)
    if dim.get("log") and new <= 0:
        return None
    return new if new != bound else None


def widen(
    search: dict[str, dict[str, Any]], merged: list[tuple[int, int, dict[str, Any]]]
) -> tuple[dict[str, dict[str, Any]], list[Widening]]:
    """Return the search space widened by the merged nodes `(id, number, edits)`, in merge order."""
    dims = copy.deepcopy(search)
    out = []
    for node_id, number, edits in merged:
        for key, value in edits.items():
            dim = dims.get(key)
            if dim is None or dim.get("values") is not None or dim.get("low") is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if dim.get("integer") is None and _whole(dim) and isinstance(value, int):
                # An integer key (whole bounds, an int value) stays one: a half-width step of an odd
                # width would otherwise leave a fractional bound and let floats in.
                dim["integer"] = True
            side = on_bound(dim, float(value))
            new = widened_bound(dim, side, key) if side else None
            if side is None or new is None:
                continue
            out.append(Widening(key, side, float(value), float(dim[side]), new, node_id, number))
            dim[side] = new
    return dims, out
