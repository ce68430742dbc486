"""Node statuses and their legal transitions (DESIGN §5)."""

from __future__ import annotations

from enum import StrEnum


class NodeStatus(StrEnum):
    PROPOSED = "proposed"
    QUEUED = "queued"
    RUNNING = "running"
    EVALUATED = "evaluated"
    AWAITING_APPROVAL = "awaiting_approval"
    MERGED = "merged"
    REJECTED = "rejected"
    FAILED = "failed"
    PRUNED = "pruned"
    CANCELLED = "cancelled"


S = NodeStatus

TRANSITIONS: dict[NodeStatus, frozenset[NodeStatus]] = {
    S.PROPOSED: frozenset({S.QUEUED, S.PRUNED, S.CANCELLED}),
    # queued -> queued re-dispatches a job whose worker was lost.
    S.QUEUED: frozenset({S.QUEUED, S.RUNNING, S.FAILED, S.CANCELLED, S.PRUNED}),
    S.RUNNING: frozenset({S.QUEUED, S.EVALUATED, S.REJECTED, S.FAILED, S.CANCELLED}),
    S.EVALUATED: frozenset({S.AWAITING_APPROVAL, S.MERGED, S.REJECTED, S.PRUNED}),
    S.AWAITING_APPROVAL: frozenset({S.MERGED, S.REJECTED, S.CANCELLED}),
    S.MERGED: frozenset(),
    S.REJECTED: frozenset({S.PRUNED}),
    # A failed attempt is retried as a new attempt of the same node.
    S.FAILED: frozenset({S.QUEUED, S.PRUNED}),
    S.PRUNED: frozenset(),
    S.CANCELLED: frozenset(),
}

TERMINAL = frozenset({S.MERGED, S.PRUNED, S.CANCELLED})
ACTIVE = frozenset({S.QUEUED, S.RUNNING})
COMPLETED = frozenset({S.EVALUATED, S.AWAITING_APPROVAL, S.MERGED, S.REJECTED, S.FAILED})


class IllegalTransition(ValueError):
    """A status change that the node lifecycle does not allow."""

    def __init__(self, node_id: int, old: NodeStatus, new: NodeStatus) -> None:
        self.node_id, self.old, self.new = node_id, old, new
        super().__init__(f"node {node_id}: illegal transition {old} -> {new}")


def check_transition(node_id: int, old: NodeStatus | str, new: NodeStatus | str) -> NodeStatus:
    """Return the new status, or raise `IllegalTransition` if `old -> new` is not allowed."""
    o, n = NodeStatus(old), NodeStatus(new)
    if n not in TRANSITIONS[o]:
        raise IllegalTransition(node_id, o, n)
    return n
