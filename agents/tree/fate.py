"""A node's fate: one line saying what became of it, computed here and shown everywhere."""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

from agents.tree.status import NodeStatus
from agents.verify.arex import Decision


class Facts(NamedTuple):
    """What a node's fate is told from (its row, its refine children and the study's trunk)."""

    status: str
    reason: str = ""  # given with the node's last status change
    by: str = ""  # who made that change (a human's name, "auto", a token's name)
    is_root: bool = False
    gain_lcb: float | None = None
    min_gain: float = 0.0
    decision: str = ""  # AREX's call at integration: accept, refine, restart, reject
    open_constraints: tuple[str, ...] = ()
    refined_as: tuple[int, ...] = ()  # numbers of the refine children that took up its open constraints
    gated: bool = False
    gate_reason: str = ""
    failure: str = ""
    on_trunk: bool = True  # built on the current trunk
    revisited_as: tuple[int, ...] = ()  # numbers of the nodes that measure its change again on a newer trunk


class Rejection(StrEnum):
    """Who or what rejected a node: the mark the tree gives it."""

    HUMAN = "human"  # a person's decision
    CONSTRAINT = "constraint"  # verification left constraints open (or found them violated)
    GATE = "gate"  # the sealed held-out gate
    DEV = "dev"  # its dev evidence: no gain, a refused change, nothing to measure


def rejection(f: Facts) -> Rejection | None:
    """Return why a rejected node was rejected (None for a node that was not), as `fate` words it."""
    if f.status != NodeStatus.REJECTED or f.is_root:
        return None
    if f.by and f.by != "auto":
        return Rejection.HUMAN
    if f.decision in (Decision.REFINE, Decision.RESTART) and f.open_constraints:
        return Rejection.CONSTRAINT
    if f.gated and f.gate_reason:
        return Rejection.GATE
    return Rejection.DEV if f.reason or f.failure else Rejection.CONSTRAINT


def candidate(f: Facts) -> bool:
    """Return whether a node is a gate candidate, as `fate` words it: a dev gain above the bar on trunk."""
    bar = max(f.min_gain, 0.0)
    return (
        f.status == NodeStatus.EVALUATED
        and not f.is_root
        and not f.gated
        and f.gain_lcb is not None
        and f.gain_lcb > bar
        and f.decision in ("", Decision.ACCEPT)
        and f.on_trunk
    )


def _lcb(x: float) -> str:
    return f"{x:+.3g}".replace("-", "\u2212")


def fate(f: Facts) -> str:
    """Return the node's fate in one line, e.g. 'rejected by ada: too risky'."""
    if f.is_root:
        return "the baseline: trunk at the study's start"
    if f.status == NodeStatus.MERGED:
        return f"merged by {f.by}" if f.by else "merged into trunk"
    if f.status == NodeStatus.AWAITING_APPROVAL:
        return "passed the held-out gate; waiting for a human decision"
    if f.status in (NodeStatus.PROPOSED, NodeStatus.QUEUED, NodeStatus.RUNNING):
        return {"proposed": "proposed, not run yet", "queued": "queued", "running": "running"}[f.status]
    if f.status == NodeStatus.FAILED:
        return f"failed: {f.failure or f.reason or 'no result'}"
    if f.status == NodeStatus.PRUNED:
        who = f" by {f.by}" if f.by else ""
        return f"pruned{who}: {f.reason or 'its direction stopped improving'}"
    if f.status == NodeStatus.CANCELLED:
        return f"cancelled: {f.reason or 'the study ended first'}"
    if f.status == NodeStatus.REJECTED:
        return _rejected(f)
    return _evaluated(f)


def _rejected(f: Facts) -> str:
    if f.by and f.by != "auto":
        return f"rejected by {f.by}: {f.reason or 'no reason given'}"
    if f.decision in (Decision.REFINE, Decision.RESTART) and f.open_constraints:
        opened = ", ".join(f.open_constraints)
        noun = "constraint" if len(f.open_constraints) == 1 else "constraints"
        if f.refined_as:
            return f"{noun} {opened} open \u2192 refined as " + ", ".join(f"n{i}" for i in f.refined_as)
        if f.decision == Decision.RESTART:
            return f"{noun} {opened} open \u2192 abandoned; exploration restarts elsewhere"
        return f"{noun} {opened} open \u2192 to be refined"
    if f.gated and f.gate_reason:
        return f"held-out gate: {f.gate_reason}"
    return f"rejected: {f.reason or f.failure or 'constraints not met'}"


def _evaluated(f: Facts) -> str:
    if f.gated:
        return f"held-out gate: {f.gate_reason or 'passed'}"
    bar = max(f.min_gain, 0.0)  # the gate asks LCB > 0; improving asks LCB > plateau.min_gain
    if f.gain_lcb is not None and f.gain_lcb <= bar:
        return f"not a gate candidate: dev LCB {_lcb(f.gain_lcb)} \u2264 {bar:g}"
    if f.decision and f.decision != Decision.ACCEPT:
        return f"not a gate candidate: verification's call was {f.decision}"
    if f.gain_lcb is None:
        return "evaluated"
    if not f.on_trunk:
        where = f"dev LCB {_lcb(f.gain_lcb)} on the older trunk it was built on"
        if f.revisited_as:
            return f"{where} \u2192 measured again on a newer trunk as " + ", ".join(
                f"n{i}" for i in f.revisited_as
            )
        return f"not a gate candidate: {where}"
    return f"gate candidate: dev LCB {_lcb(f.gain_lcb)} > {bar:g}"
