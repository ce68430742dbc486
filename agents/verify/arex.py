"""AREX's outer decision for a verified candidate: accept, refine, restart or reject."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from agents.verify.constraints import ConstraintResult, Verdict


class Decision(StrEnum):
    ACCEPT = "accept"  # improves and every constraint holds: a gate candidate
    REFINE = "refine"  # improves but some constraint is violated or unknown: narrower child
    RESTART = "restart"  # unrecoverable: abandon the branch, explore from the root away from it
    REJECT = "reject"  # ran cleanly but does not improve


@dataclass(frozen=True)
class Assessment:
    decision: Decision
    reason: str
    open_constraints: tuple[str, ...] = ()
    refine_goal: str = ""


def assess(
    *,
    succeeded: bool,
    recoverable: bool,
    improves: bool,
    results: Sequence[ConstraintResult],
    mechanism: str,
    no_evidence: bool = False,
) -> Assessment:
    """Turn one candidate's evidence into AREX's accept / refine / restart / reject call.

    A failure that is `no_evidence` against the idea (format, infrastructure) never restarts.
    """
    if not succeeded:
        if no_evidence:
            return Assessment(
                Decision.REJECT,
                "the attempt failed for a format or infrastructure reason, no evidence against the idea; "
                + ("it is tried again" if recoverable else "no attempt is left"),
            )
        if recoverable:
            return Assessment(Decision.REJECT, "the run failed; a retry starts clean")
        return Assessment(
            Decision.RESTART, "unrecoverable run; exploration re-opens from the root, away from this branch"
        )
    open_ = tuple(r.name for r in results if r.verdict != Verdict.SATISFIED)
    if not improves:
        if open_:
            return Assessment(Decision.REJECT, "no gain and constraints open", open_)
        return Assessment(Decision.REJECT, "no significant dev gain over trunk")
    if open_:
        details = "; ".join(f"{r.name}: {r.verdict} ({r.detail})" for r in results if r.name in open_)
        goal = f"Keep the mechanism ({mechanism}) and fix: {details}"
        return Assessment(Decision.REFINE, "improves but constraints are not met", open_, goal)
    return Assessment(Decision.ACCEPT, "improves and every constraint holds")
