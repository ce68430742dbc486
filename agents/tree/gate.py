"""Gate rules: who may be tested on the sealed split, and who passes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agents.tree.stats import gain_over


@dataclass(frozen=True)
class Eligibility:
    ok: bool
    reason: str


def eligible(
    *,
    dev_gain_lcb: float | None,
    constraints_hold: bool,
    on_current_trunk: bool,
    queries_used: int,
    max_queries: int,
) -> Eligibility:
    """Decide whether a candidate may query the sealed split."""
    if dev_gain_lcb is None or dev_gain_lcb <= 0:
        return Eligibility(False, "dev gain over trunk is not significantly positive")
    if not constraints_hold:
        return Eligibility(False, "a constraint is violated or unknown")
    if not on_current_trunk:
        return Eligibility(False, "built on an older trunk")
    if queries_used >= max_queries:
        return Eligibility(False, f"sealed split query cap reached ({max_queries})")
    return Eligibility(True, "dev LCB gain > 0 and every constraint holds")


@dataclass(frozen=True)
class HeldoutDecision:
    passed: bool
    gain: float
    gain_lcb: float
    reason: str


def heldout_decision(
    candidate: Sequence[float], trunk: Sequence[float], *, maximize: bool, margin: float, alpha: float = 0.05
) -> HeldoutDecision:
    """Pass only when the held-out gain over trunk is strictly above `margin`, noise included.

    The gain is paired by seed, and its one-sided 95% lower confidence bound must clear the
    margin: under no real effect one gate query passes at most 5% of the time (a study may make
    up to `max_test_runs` of them, each behind a significant dev gain). With one test run per
    side there is no noise estimate and the bound is the plain difference. A query that took
    more seeds (an unclear gain, `agents/tree/sequential.py`) is judged at its last look's level.
    """
    if not candidate:
        return HeldoutDecision(False, float("nan"), float("-inf"), "held-out evaluation failed")
    g = gain_over(candidate, trunk, maximize=maximize, alpha=alpha)
    told = f"held-out gain {g.mean:+.6g} ({100 * (1 - alpha):.3g}% lower bound {g.lcb:+.6g}, n={g.n})"
    if g.lcb > margin:
        return HeldoutDecision(True, g.mean, g.lcb, f"{told} > margin {margin:g}")
    return HeldoutDecision(False, g.mean, g.lcb, f"{told} does not clear margin {margin:g}")
