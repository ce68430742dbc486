"""The JSON bodies the API answers with, as typed dictionaries (times are ISO-8601 strings).

They mirror the API's response schemas field for field (`tests/unit/test_client.py` keeps them equal).
The states their `status`, `kind`, `decision` and `verdict` fields hold are the service's own enums,
re-exported here: a member equals the string the JSON carries.
"""

from __future__ import annotations

from typing import Any, TypedDict

from agents.tree.status import NodeStatus as NodeStatus
from agents.tree.status import StopRule as StopRule
from agents.tree.status import StudyStatus as StudyStatus
from agents.verify.arex import Decision as Decision
from agents.verify.constraints import Verdict as Verdict
from backend.core.states import ApprovalStatus as ApprovalStatus
from backend.core.states import JobStatus as JobStatus
from backend.core.states import RunKind as RunKind


class Message(TypedDict):
    message: str


class Study(TypedDict):
    id: int
    name: str
    goal: str
    status: str
    stop_reason: str
    stop_rule: str
    source: str
    policy: str
    reads_memory: bool
    trunk_branch: str
    trunk_commit: str
    base_commit: str
    nodes: int
    experiments_used: int
    experiments_budget: int
    experiments_run: int
    extra_dev_runs: int
    pending_approvals: int
    best_dev: float | None
    baseline_dev: float | None
    trunk_dev: float | None
    baseline_heldout: float | None
    trunk_heldout: float | None
    test_queries: int
    llm_calls: int
    llm_tokens: int
    llm_usd: float
    budget_usd: float
    budget_hours: float
    parallel: int
    running_jobs: int
    gate_mode: str
    margin: float
    metric: str
    direction: str
    improvement_state: dict[str, Any]
    created_at: str
    started_at: str | None
    finished_at: str | None


class NodeSummary(TypedDict):
    id: int
    number: int
    parent_id: int | None
    depth: int
    status: str
    title: str
    origin: str
    dev_mean: float | None
    dev_n: int
    gain: float | None
    gain_lcb: float | None
    heldout_gain: float | None
    attempts: int
    fate: str
    rejection: str  # human, constraint, gate or dev ('' unless rejected)
    candidate: bool  # a gate candidate: what its fate calls one


class NodeRef(TypedDict):
    id: int
    number: int


class Tree(TypedDict):
    study_id: int
    trunk_node_id: int | None
    nodes: list[NodeSummary]


class Event(TypedDict):
    id: int
    study_id: int
    node_id: int | None
    type: str
    payload: dict[str, Any]
    time: str


class NodeDetail(NodeSummary):
    hypothesis: dict[str, Any]
    edits: dict[str, Any]
    base_commit: str
    branch: str
    commit: str
    diff_stats: dict[str, Any]
    diff: str
    dev_values: list[float]
    dev_std: float | None
    constraints: list[dict[str, Any]]
    verification: dict[str, Any]
    summary: str
    failure: str
    reflection: str
    heldout_values: list[float]
    heldout_lcb: float | None
    heldout_level: float | None
    gate_reason: str
    refined_as: list[int]
    cost: dict[str, Any]
    receipts: list[dict[str, Any]]
    insights: list[dict[str, Any]]
    children: list[NodeRef]
    parent_number: int | None
    history: list[Event]


class Approval(TypedDict):
    id: int
    study_id: int
    node_id: int
    node_number: int
    status: str
    decided_by: str
    reason: str
    created_at: str
    decided_at: str | None
    title: str
    dev_gain: float | None
    dev_gain_lcb: float | None
    dev_n: int
    heldout_gain: float | None
    margin: float
    constraints: list[dict[str, Any]]


class Progress(TypedDict):
    baseline_dev: float | None
    baseline_heldout: float | None
    points: list[dict[str, Any]]


class LearningJob(TypedDict):
    id: int
    study_id: int | None
    kind: str
    params: dict[str, Any]
    status: str
    progress: float
    device: str
    host: str
    artifact: str
    result: dict[str, Any]
    error: str
    created_at: str
    started_at: str | None
    finished_at: str | None
    events: list[dict[str, Any]]


class MemoryEntry(TypedDict):
    id: int
    kind: str
    text: str
    repository: str
    objective: str
    name: str
    study_id: int | None
    study_name: str
    node_numbers: list[int]
    dev_effect: float | None
    diff: str
    provenance: str
    created_at: str
