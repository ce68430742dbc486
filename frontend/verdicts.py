"""A node's verification in words: what the held-out gate and AREX decided, and why."""

from __future__ import annotations

import re

from client.models import Decision, NodeDetail, NodeStatus, NodeSummary, Verdict

WAITS = {
    "awaiting_approval": "waits for your decision: it passed the held-out gate",
    "running": "is running its dev evaluation",
    "queued": "waits for a free executor",
    "proposed": "waits to be run",
}


def arex(n: NodeDetail) -> str:
    """Return AREX's call on a node in words, e.g. 'refined as n8 because size: 4608 > 2048'."""
    v = n.get("verification") or {}
    decision = v.get("decision")
    cons = n.get("constraints") or []
    if not decision:
        return ""
    if decision == Decision.ACCEPT:
        if not cons:
            return "accepted: the goal sets no constraint; gain kept"
        return f"accepted: every constraint holds ({', '.join(str(c['name']) for c in cons)}); gain kept"
    open_ = [c for c in cons if c.get("verdict") != Verdict.SATISFIED]
    why = "; ".join(f"{c['name']}: {c.get('detail') or c.get('verdict')}" for c in open_) or ", ".join(
        v.get("open_constraints") or []
    )
    if decision == Decision.REFINE:
        refined = ", ".join(f"n{i}" for i in n.get("refined_as") or [])
        head = f"refined as {refined}" if refined else "to be refined"
        return f"{head} because {why}" if why else head
    if decision == Decision.RESTART:
        return f"abandoned, exploration restarts elsewhere, because {why}" if why else "abandoned"
    return f"rejected: {v.get('reason') or why or 'the gain is not kept'}"


def gate(n: NodeDetail) -> str:
    """Return the held-out gate's call on a node in words ('' if it never reached the gate)."""
    reason = str(n.get("gate_reason") or "")
    if not reason:
        return ""
    if n["status"] in (NodeStatus.MERGED, NodeStatus.AWAITING_APPROVAL):
        return f"passed the held-out gate: {reason.removeprefix('passed: ')}"
    return f"held-out gate: {reason}"


def heldout_lcb(n: NodeDetail) -> tuple[str, float] | None:
    """Return the held-out gain's lower bound the gate recorded, with its level ('97.3%')."""
    lcb, level = n.get("heldout_lcb"), n.get("heldout_level")
    if lcb is None or level is None:
        return None
    return f"{100 * level:.3g}%", lcb


def diff_summary(n: NodeDetail) -> str:
    """Return '2 files, +3 −3: config.toml, model.py' for a node's change."""
    stats = n.get("diff_stats") or {}
    paths = re.findall(r"^\+\+\+ b/(.+)$", str(n.get("diff") or ""), flags=re.M)
    if not stats and not paths:
        return "no change"
    files = stats.get("files", len(paths))
    head = f"{files} file{'s' if files != 1 else ''}, +{stats.get('insertions', 0)} \u2212{stats.get('deletions', 0)}"
    shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
    return f"{head}: {shown}" if shown else head


def in_play(nodes: list[NodeSummary]) -> NodeSummary | None:
    """Return the best candidate not yet merged: a node waiting for approval, else the best dev LCB."""
    waiting = [n for n in nodes if n["status"] == NodeStatus.AWAITING_APPROVAL]
    if waiting:
        return max(waiting, key=lambda n: n.get("heldout_gain") or 0.0)
    live = [
        n
        for n in nodes
        if n["parent_id"] is not None
        and n["status"] == NodeStatus.EVALUATED
        and n.get("gain_lcb") is not None
        and n.get("candidate")
    ]
    return max(live, key=lambda n: n["gain_lcb"] or 0.0) if live else None


def waits_for(n: NodeSummary) -> str:
    """Return what a candidate in play waits for."""
    if n["status"] in WAITS:
        return WAITS[n["status"]]
    return f"waits for the held-out gate ({n.get('fate')})"
