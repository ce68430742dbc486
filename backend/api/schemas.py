"""Request and response bodies of the REST API."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    data: list[T]
    count: int


class StudyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    spec: str = Field(description="the grove.toml text", min_length=1)
    repository: str = Field(description="a local path or git URL of the repository", min_length=1)


class DraftRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    repository: str = Field(description="a local path or git URL of the repository", min_length=1)
    goal: str = Field(default="", description="what should improve, in words", max_length=4000)
    use_model: bool = Field(
        default=True,
        description="let the service's model (if one is set) read the evaluator, configs and README; "
        "never the files the draft seals",
    )


class Draft(BaseModel):
    spec: str = Field(description="the drafted grove.toml text, commented")
    notes: list[str] = Field(description="why each choice was made")
    model: str | None = Field(description="the model that refined Grove's own analysis, if any")
    files: dict[str, str] = Field(
        default_factory=dict,
        description="files the draft needs in the repository beside grove.toml (path -> text): the "
        "evaluator adapter `grove init` writes for a repository without an evaluator, and its data split",
    )


class StudyPublic(BaseModel):
    id: int
    name: str
    goal: str
    status: str
    stop_reason: str
    stop_rule: str  # the StopRule that ended it, or the step a failed study failed on ('' if none)
    source: str
    policy: str
    reads_memory: bool  # its policy reads the lab memory of earlier studies
    trunk_branch: str
    trunk_commit: str
    base_commit: str
    nodes: int
    experiments_used: int  # units of the experiment budget spent: experiments_run + extra_dev_runs // repeats
    experiments_budget: int
    experiments_run: int  # experiment jobs, one unit each
    extra_dev_runs: int  # adaptive repeats beyond `repeats`, charged to the budget `repeats` to a unit
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
    direction: str  # maximize | minimize
    improvement_state: dict[str, Any]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class NodeSummary(BaseModel):
    id: int  # the node's key in paths (`/studies/{study_id}/nodes/{id}`), unique across studies
    number: int  # its place in its study, 1 for the root: what every page and text calls it (`n{number}`)
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
    fate: str  # what became of the node, in one line (agents/tree/fate.py)
    rejection: str = ""  # who or what rejected it: human, constraint, gate or dev ('' unless rejected)
    candidate: bool = False  # a gate candidate: a dev gain above the bar, on trunk, verified


class NodeRef(BaseModel):
    id: int
    number: int


class Tree(BaseModel):
    study_id: int
    trunk_node_id: int | None
    nodes: list[NodeSummary]


class ReceiptPublic(BaseModel):
    id: int
    kind: str
    seed: int
    command: str
    commit: str
    exit_code: int | None
    duration: float
    timed_out: bool
    ok: bool
    reason: str
    metrics: dict[str, Any] | None
    stdout_tail: str
    stderr_tail: str
    fingerprint: str


class InsightPublic(BaseModel):
    version: int
    text: str
    cites: list[int]  # the ids of the nodes it cites
    cited: list[int] = []  # the numbers of those still in the study
    created_at: datetime


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
    heldout_lcb: float | None  # the gate's lower bound on the held-out gain
    heldout_level: float | None  # that bound's one-sided confidence
    gate_reason: str
    refined_as: list[int]  # the numbers of the refine children that took up its open constraints
    cost: dict[str, Any]
    receipts: list[ReceiptPublic]
    insights: list[InsightPublic]
    children: list[NodeRef]
    parent_number: int | None
    history: list[EventPublic]


class HypothesisCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str = Field(min_length=1, max_length=200)
    mechanism: str = ""
    hypothesis: str = ""
    observable: str = ""
    risks: str = ""
    edits: dict[str, Any] = Field(
        default_factory=dict, description="search keys to set, e.g. {'config.toml:a.b': 3}"
    )


class Reason(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(default="", max_length=2000)


class ApprovalPublic(BaseModel):
    id: int
    study_id: int
    node_id: int
    node_number: int
    status: str
    decided_by: str
    reason: str
    created_at: datetime
    decided_at: datetime | None
    title: str
    dev_gain: float | None
    dev_gain_lcb: float | None
    dev_n: int
    heldout_gain: float | None
    margin: float
    constraints: list[dict[str, Any]]


class EventPublic(BaseModel):
    id: int
    study_id: int
    node_id: int | None
    type: str
    payload: dict[str, Any]
    time: datetime


class Message(BaseModel):
    message: str


class LiveOutput(BaseModel):
    node_id: int
    status: str
    run: str  # the file the tail is from, e.g. "dev-seed1.stdout" or "tools/run3.stderr"; "" if none
    tail: str
    updated_at: datetime | None
    note: str  # why there is nothing to show, when there is not


class Me(BaseModel):
    name: str
    roles: list[str]


class ProgressPoint(BaseModel):
    experiment: int = Field(description="1-based count of evaluated nodes so far")
    node_id: int
    node_number: int = Field(description="the node's number in its study (n1 is the root)")
    status: str = Field(description="the node's status now")
    dev: float | None = Field(description="the node's mean dev score")
    trunk_dev: float | None = Field(description="trunk's mean dev score after this experiment")
    trunk_heldout: float | None = Field(description="trunk's mean held-out score after this experiment")


class Progress(BaseModel):
    baseline_dev: float | None
    baseline_heldout: float | None
    points: list[ProgressPoint]


class SearchPoint(BaseModel):
    node_id: int
    node_number: int
    status: str
    dev: float
    values: dict[str, Any]  # every [search] key's value in this node's configuration


class SearchSpace(BaseModel):
    keys: list[str]
    metric: str
    points: list[SearchPoint]


class Curve(BaseModel):
    receipt_id: int
    seed: int
    records: list[dict[str, float]]  # each with its `step`, in the order the run printed them


class Curves(BaseModel):
    keys: list[str]  # the numeric keys besides `step` that some record holds
    curves: list[Curve]  # one per dev run that printed step records


class Importance(BaseModel):
    key: str
    importance: float  # how much it sets the best tenth of the measured nodes apart; the shares sum to 1


class Importances(BaseModel):
    metric: str
    method: str
    measured: int  # the measured configurations it was computed from
    keys: list[Importance]  # most important first; empty until three configurations differ in score


class LearningJobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["distill", "sparse_eval", "sparse_train"]
    params: dict[str, Any] = Field(default_factory=dict, description="overrides of the job's defaults")
    study_id: int | None = Field(default=None, ge=1, le=2**31 - 1, description="the study it belongs to")


class LearningEventPublic(BaseModel):
    type: str
    payload: dict[str, Any]
    time: datetime


class LearningJobPublic(BaseModel):
    id: int
    study_id: int | None
    kind: str
    params: dict[str, Any]
    status: str
    progress: float
    device: str
    host: str = Field(description="the machine that ran the job, which keeps its artifact folder")
    artifact: str
    result: dict[str, Any]
    error: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    events: list[LearningEventPublic]


NodeDetail.model_rebuild()


class MemoryEntryPublic(BaseModel):
    """One lab-memory entry: what a finished study learned, with where it came from."""

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
    created_at: datetime
