"""The seams between the coordinator and the outside world: storage, dispatch, the gate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from agents.failures import Blame
from agents.policies.base import NodeEvidence, Proposal
from agents.spec import Spec
from agents.tree.insights import InsightUpdate
from agents.tree.status import NodeStatus, StopRule, StudyStatus


@dataclass(frozen=True, kw_only=True)
class StudyView:
    id: int
    name: str
    status: StudyStatus
    spec: Spec
    trunk_commit: str
    trunk_node_id: int
    trunk_dev: list[float]
    base_values: dict[str, Any]
    test_queries: int
    experiments_used: int
    elapsed_hours: float
    improvement_state: dict[str, Any]
    plateau_level: int
    seed: int = 0
    usd_spent: float = 0.0


@dataclass(frozen=True, kw_only=True)
class NodeRecord:
    evidence: NodeEvidence
    round_no: int
    prior: float
    base_commit: str
    dev_values: list[float]
    dev_receipts: list[tuple[int, dict[str, Any]]]
    attempts: int
    completed_order: int
    verification: dict[str, Any] = field(default_factory=dict)
    gated: bool = False
    passed_unread: bool = (
        False  # the gate passed it (its query counted) and the coordinator has not acted yet
    )
    trunk_commit: str = ""  # the trunk this node made (the root's base, a merged node's gate commit)


@dataclass(frozen=True)
class Pending:
    """A sealed evaluation handed to a job: wait for the job, then ask again.

    A baseline that is not `blocking` (its held-out run) lets the study explore meanwhile; a
    blocking one (its dev runs) holds up every integration, and the first proposals too where the
    policy reads it.
    """

    job_id: int
    blocking: bool = True


@dataclass(frozen=True)
class Integration:
    node_id: int
    status: NodeStatus
    gain: float | None
    gain_lcb: float | None
    constraints: list[dict[str, Any]]
    verification: dict[str, Any]
    summary: str


class Storage(Protocol):
    """Where studies, nodes, insights and events live (the database in production)."""

    def study(self, study_id: int) -> StudyView: ...

    def nodes(self, study_id: int) -> list[NodeRecord]: ...

    def memory(self, study_id: int) -> list[str]: ...

    def change(self, study_id: int, node_id: int) -> str: ...

    def repo_map(self, study_id: int) -> dict[str, Any]: ...

    def add_proposals(self, study_id: int, round_no: int, proposals: list[Proposal]) -> list[int]: ...

    def enqueue(self, study_id: int, node_id: int) -> int: ...

    def job_nodes(self, job_ids: list[int]) -> dict[int, int]: ...

    def record(self, study_id: int, result: Integration) -> None: ...

    def add_insights(self, study_id: int, updates: list[InsightUpdate]) -> None: ...

    def save_state(self, study_id: int, state: dict[str, Any], plateau_level: int) -> None: ...

    def prune(self, study_id: int, node_id: int, reason: str, lesson: str) -> None: ...

    def event(self, study_id: int, type_: str, node_id: int | None, payload: dict[str, Any]) -> None: ...

    def said(self, study_id: int, type_: str, node_id: int) -> bool: ...

    def cancel_active(self, study_id: int) -> None: ...

    def pause(self, study_id: int, reason: str, spent: Blame) -> None: ...


class Dispatcher(Protocol):
    """Runs experiment jobs somewhere (a local process pool, Celery workers)."""

    def submit(self, job_id: int) -> None: ...


class SealedTests(Protocol):
    """Runs the sealed held-out evaluations; returns pass or fail only, never a held-out number."""

    def baseline(self, study_id: int) -> Pending | None: ...

    def gate(self, study_id: int, node_id: int) -> bool | Pending: ...


class Trunk(Protocol):
    """Moves the trunk: opens and reads approvals, merges or rejects a gate-passed node, ends the study."""

    def await_approval(self, study_id: int, node_id: int) -> None: ...

    def decision(self, study_id: int, node_id: int) -> dict[str, Any] | None: ...

    def merge(self, study_id: int, node_id: int, by: str) -> None: ...

    def reject(self, study_id: int, node_id: int, reason: str, by: str) -> None: ...

    def withdraw(self, study_id: int, node_id: int, reason: str) -> bool: ...

    def finalize(self, study_id: int, reason: str, rule: StopRule | None) -> None: ...


class Gatekeeper(SealedTests, Trunk, Protocol):
    """Both sides of the gate in one object, as the engine's gatekeepers implement them."""
