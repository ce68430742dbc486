"""The coordinator's control state: ids and phase (the database holds the rest), and the ideas the
last rounds dropped, which the next ideation is told of."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from typing_extensions import TypedDict


class Wait(StrEnum):
    """What a coordinator step waits for: its interrupt's `kind` (the value: checkpoints hold plain data)."""

    JOBS = "await_jobs"  # jobs ending (or a decision on the open approval, or a stop)
    APPROVAL = "approve"  # a human decision on a gate-passed node
    RESUME = "paused"  # the study resuming


class CoordinatorState(TypedDict, total=False):
    study_id: int
    round_no: int
    pending: list[int]  # job ids dispatched and not yet integrated
    selected: list[int]  # node ids chosen for dispatch
    finished: list[int]  # job ids reported done by the last wait
    candidates: list[int]  # node ids eligible for the gate, best first
    gate_node: int | None
    gating: int | None  # the candidate whose sealed gate job runs while the study explores on
    gate_job: int | None  # that job, until it finishes (then `gate` reads the verdict)
    baseline_dev_job: int | None  # the baseline's dev job while the first experiments run beside it
    baseline_job: int | None  # the baseline's held-out job while it runs beside the first experiments
    baseline_sent: bool  # its task was sent (by `dispatch`, after the first experiments')
    awaiting: int | None  # a gate-passed node whose approval is open while the study explores on
    approved_by: str  # who approved the gate node ("auto" in auto mode)
    stop_reason: str
    stop_rule: str  # a StopRule's value: the rule that ended the study
    ideation_error: str  # the last ideation failure, reported if nothing is left to run
    empty_rounds: int  # rounds in a row that left nothing to run (asked again up to `EMPTY_ROUNDS`)
    dropped: list[dict[str, Any]]  # the latest dropped proposals: {"title", "reason", "round", "parent_id"}
