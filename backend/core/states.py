"""Job and approval statuses, job and run kinds, and their legal transitions (docs/architecture.md).

Like `NodeStatus` and `StudyStatus` (`agents/tree/status.py`) these are `StrEnum`s: their columns stay
text, and a member equals the string it stores.
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


J = JobStatus

JOB_TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    # queued -> queued re-dispatches a job whose worker was lost; running -> queued requeues it.
    J.QUEUED: frozenset({J.QUEUED, J.RUNNING, J.FAILED}),
    J.RUNNING: frozenset({J.QUEUED, J.DONE, J.FAILED}),
    J.DONE: frozenset(),
    J.FAILED: frozenset(),
}

JOB_OPEN = frozenset({J.QUEUED, J.RUNNING})
JOB_ENDED = frozenset({J.DONE, J.FAILED})


class JobKind(StrEnum):
    EXPERIMENT = "experiment"  # a node's attempt on a worker
    BASELINE = "baseline"  # trunk's first dev and held-out measurement
    GATE = "gate"  # a candidate's sealed held-out test
    HELDOUT = "heldout"  # trunk's held-out score at the end


SEALED_KINDS = frozenset({JobKind.BASELINE, JobKind.GATE, JobKind.HELDOUT})


class RunKind(StrEnum):
    """Which evaluator a run (and its receipt) used: the development one or the sealed held-out one."""

    DEV = "dev"
    TEST = "test"


class ApprovalStatus(StrEnum):
    PENDING = "pending"  # waits for a human
    APPROVING = "approving"  # a human approved; the merge has not happened yet
    REJECTING = "rejecting"  # a human rejected; the node has not been rejected yet
    APPROVED = "approved"
    REJECTED = "rejected"
    WITHDRAWN = "withdrawn"  # closed without a decision (the study ended, the node went away)


A = ApprovalStatus

APPROVAL_TRANSITIONS: dict[ApprovalStatus, frozenset[ApprovalStatus]] = {
    A.PENDING: frozenset({A.APPROVING, A.REJECTING, A.WITHDRAWN, A.APPROVED, A.REJECTED}),
    A.APPROVING: frozenset({A.APPROVED}),
    A.REJECTING: frozenset({A.REJECTED}),
    A.APPROVED: frozenset(),
    A.REJECTED: frozenset(),
    A.WITHDRAWN: frozenset(),
}

APPROVAL_SAID_YES = frozenset({A.APPROVING, A.APPROVED})


def may_become(old: ApprovalStatus | str, new: ApprovalStatus | str) -> bool:
    """Return whether an approval may go from `old` to `new`."""
    return ApprovalStatus(new) in APPROVAL_TRANSITIONS[ApprovalStatus(old)]
