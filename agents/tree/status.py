"""Node and study statuses and their legal transitions (see docs/architecture.md, "Life cycles")."""

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


class StudyStatus(StrEnum):
    CLONING = "cloning"
    CREATED = "created"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    FINISHED = "finished"
    FAILED = "failed"


St = StudyStatus

STUDY_TRANSITIONS: dict[StudyStatus, frozenset[StudyStatus]] = {
    # A study from a URL is cloned off the request path: cloning -> created, or failed with the reason.
    St.CLONING: frozenset({St.CREATED, St.FAILED}),
    # created -> running when the baseline is measured.
    St.CREATED: frozenset({St.RUNNING, St.PAUSED, St.STOPPING, St.FAILED}),
    St.RUNNING: frozenset({St.PAUSED, St.STOPPING, St.FINISHED, St.FAILED}),
    # A paused study whose budget runs out while it waits finishes without resuming.
    St.PAUSED: frozenset({St.RUNNING, St.STOPPING, St.FINISHED, St.FAILED}),
    St.STOPPING: frozenset({St.FINISHED, St.FAILED}),
    St.FINISHED: frozenset(),
    St.FAILED: frozenset(),
}

STUDY_ENDED = frozenset({St.FINISHED, St.FAILED})


class IllegalStudyTransition(ValueError):
    """A status change that the study life cycle does not allow."""

    def __init__(self, name: str, old: StudyStatus, new: StudyStatus) -> None:
        self.name, self.old, self.new = name, old, new
        super().__init__(f"study {name!r} is {old}; it cannot become {new}")


def check_study_transition(name: str, old: StudyStatus | str, new: StudyStatus | str) -> StudyStatus:
    """Return the new study status, or raise `IllegalStudyTransition` if `old -> new` is not allowed."""
    o, n = StudyStatus(old), StudyStatus(new)
    if n not in STUDY_TRANSITIONS[o]:
        raise IllegalStudyTransition(name, o, n)
    return n


class Origin(StrEnum):
    """Where a node's idea came from."""

    POLICY = "policy"  # the research policy proposed it
    HUMAN = "human"  # a person added it (the hypotheses route)
    REFINE = "refine"  # a narrower child of a partly verified candidate: served before new ideas
    RESTART = "restart"  # a fresh idea away from an abandoned branch
    REVISIT = "revisit"  # the same change measured again on a moved trunk
    BASELINE = "baseline"  # trunk's first measurement


class StopRule(StrEnum):
    """The rule that ended a study, or the step a failed one failed on (`stop_reason` says it in words)."""

    EXPERIMENTS = "experiments"  # the experiment budget was spent
    TIME = "time"  # the time budget was spent
    PLATEAU = "plateau"  # `plateau.stop` experiments in a row without improvement
    FRONTIER = "frontier"  # nothing left to try
    IDEATION = "ideation"  # ideation failed and nothing was left to run
    USER = "user"  # a person stopped it
    # What a failed study failed on, where a known step did:
    CLONE = "clone"  # cloning its repository from a URL
    SETUP = "setup"  # `[environment] setup`
    BASELINE_DEV = "baseline_dev"  # the dev evaluation of the unchanged repository
    BASELINE_TEST = "baseline_test"  # the sealed test evaluation of the unchanged repository
