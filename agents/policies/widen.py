"""Widen a `[search]` range on the side where a merged change landed on its bound.

A merge at a range's bound says the optimum may lie beyond it, if the bound is what made it
better. Replaying the merged nodes in order, each value within 2% of a bound (in the range's own
coordinates: log or linear) moves that bound out where the dev evidence known when the node
completed shows the objective still rising toward the bound (`pays`): a local model of the
measured nodes around the merged one predicts it better at the bound than a quarter of the range
inward, by more than twice the typical standard error of a node's dev mean (and more than a
hundredth of the spread of the measured means, where runs repeat exactly). A knob that barely
matters, which a sampler often leaves at a bound, does not widen its range. The bound moves — a
log range by a factor of up to 10, a linear one by half its width — never past a natural limit:
0 for a range that starts at or above 0, 1 for an integer range starting at 1, 0 or 1 for a range
inside [0, 1] (a probability or fraction), nor below what a parameter accepts
(`min_samples_split` 2); a log range stays above 0.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agents.policies.space import Space

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


@dataclass(frozen=True)
class Measured:
    """A node's dev evidence, as the widening of a range reads it."""

    id: int
    order: int  # when it completed (the coordinator's completion order)
    edits: dict[str, Any]
    dev_mean: float
    se: float  # the standard error of its dev mean (0 for one run or a deterministic evaluator)


INWARD = 0.25  # how far inside the bound (in the range's coordinates) the model compares against


def pays(
    dims: dict[str, dict[str, Any]],
    base: dict[str, Any],
    key: str,
    side: str,
    edits: dict[str, Any],
    known: Sequence[Measured],
    maximize: bool,
) -> bool:
    """Return whether the evidence shows the objective rising toward `key`'s bound at a merged node's values."""
    from agents.policies.search import LocalModel  # numpy: loaded only where evidence is weighed

    known = [m for m in known if math.isfinite(m.dev_mean) and math.isfinite(m.se)]
    if len(known) < 2:  # at least the unchanged repository and the merged node
        return False
    sign = 1.0 if maximize else -1.0
    values = [m.dev_mean for m in known]
    # Twice a node mean's typical error; where runs repeat exactly (se 0), a hundredth of the spread
    # of what was measured, so a ridge fit's sign on a knob that does nothing is not a rise.
    spread = max(values) - min(values)
    bar = max(2 * statistics.median(m.se for m in known), 0.01 * spread, 1e-9 * max(map(abs, values)))
    try:
        space = Space(dims, base)
        here = space.full({**base, **edits})
        x = space.coord(key, space.value(here, key))
        inside = {**here, key: space.snap(key, x - INWARD if side == "high" else x + INWARD)}
        points = [(space.full({**base, **m.edits}), sign * m.dev_mean) for m in known]
        model = LocalModel(space, points, here, log=False)
        lift = model.predict(here) - model.predict(inside)
    except (ArithmeticError, TypeError, ValueError):  # odd values (numpy's LinAlgError too): no evidence
        return False
    return math.isfinite(lift) and lift > bar


# `pays` answers, by what they depend on: the coordinator replays every widening at each ideation,
# and at thousands of nodes one answer costs half a second. What a node completed before stays as
# it was (the first look's values), so an answer holds.
_PAID: dict[tuple[Any, ...], bool] = {}


def _pays_once(
    dims: dict[str, dict[str, Any]],
    base: dict[str, Any],
    key: str,
    side: str,
    node: tuple[int, dict[str, Any]],
    known: Sequence[Measured],
    maximize: bool,
) -> bool:
    seen = (
        len(known),
        math.fsum(m.dev_mean for m in known),
        math.fsum(m.se for m in known),
        max((m.id for m in known), default=0),
    )
    memo = (
        repr(sorted(dims.items())),
        repr(sorted(base.items())),
        key,
        side,
        node[0],
        repr(node[1]),
        seen,
        maximize,
    )
    if memo not in _PAID:
        if len(_PAID) > 10_000:
            _PAID.clear()
        _PAID[memo] = pays(dims, base, key, side, node[1], known, maximize)
    return _PAID[memo]


def widen(
    search: dict[str, dict[str, Any]],
    merged: list[tuple[int, int, dict[str, Any]]],
    history: Sequence[Measured] | None = None,
    *,
    base: dict[str, Any] | None = None,
    maximize: bool = True,
) -> tuple[dict[str, dict[str, Any]], list[Widening]]:
    """Return the search space widened by the merged nodes `(id, number, edits)`, in merge order.

    With `history` (every measured node), a bound moves only where `pays` finds the evidence known
    when the merged node completed pointing past it; without it, every merge on a bound moves it.
    """
    dims = copy.deepcopy(search)
    out = []
    order = {m.id: m.order for m in history or ()}
    for node_id, number, edits in merged:
        for key, value in edits.items():
            dim = dims.get(key)
            if dim is None or dim.get("values") is not None or dim.get("low") is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            side = on_bound(dim, float(value))
            if side is None:
                continue
            # An integer key stays one (a half-width step of an odd width would leave a fractional
            # bound and let floats in); the repository's value decides where the spec does not say.
            whole = Space({key: dim}, {key: (base or {}).get(key, value)}).is_int(key)
            new = widened_bound({**dim, "integer": whole}, side, key)
            if new is None:
                continue
            if history is not None:
                cut = order.get(node_id, 0)
                known = [m for m in history if m.order <= cut]  # the root's 0 is always known
                if not _pays_once(dims, base or {}, key, side, (node_id, edits), known, maximize):
                    continue
            out.append(Widening(key, side, float(value), float(dim[side]), new, node_id, number))
            dim[side] = new
            if whole:
                dim["integer"] = True  # said once, so the next widening does not infer it again
    return dims, out
