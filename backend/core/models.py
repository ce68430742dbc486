"""Database tables: studies, nodes, jobs, receipts, insight versions, events, approvals."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, Column, Connection, Index, Table, Text, UniqueConstraint, event, false, update
from sqlmodel import Field, SQLModel


def now() -> datetime:
    """Return the current UTC time."""
    return datetime.now(UTC)


def _json(default: Any = None) -> Any:
    factory = (lambda: list(default)) if isinstance(default, list) else (lambda: dict(default or {}))
    if default is None:
        return Field(default=None, sa_column=Column(JSON, nullable=True))
    return Field(default_factory=factory, sa_column=Column(JSON, nullable=False))


class Study(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True)
    goal: str = ""
    spec_toml: str = Field(sa_column=Column(Text, nullable=False))
    source: str
    repo_path: str = ""
    status: str = "created"  # a StudyStatus; changed only by services/lifecycle
    base_commit: str = ""
    # The repository's own base commit, which alone holds the sealed files ('' where base_commit does):
    # trunk starts from a parentless copy of it without them, so no worker's fetch brings a sealed byte.
    sealed_commit: str = Field(default="", sa_column_kwargs={"server_default": ""})
    trunk_branch: str = ""
    trunk_commit: str = ""
    trunk_node_id: int | None = None
    nodes_numbered: int = 0  # the last `Node.number` handed out (`_number_node` below)
    seed: int = 0
    base_values: dict[str, Any] = _json({})
    baseline_dev: list[float] = _json([])
    # The dev evaluation gave the same objective and constraint values on every seed of the
    # unchanged repository: a node then runs one seed (more would repeat the same number).
    dev_deterministic: bool = Field(default=False, sa_column_kwargs={"server_default": false()})
    trunk_dev: list[float] = _json([])
    baseline_heldout: list[float] = _json([])
    trunk_heldout: list[float] = _json([])
    test_queries: int = 0
    improvement_state: dict[str, Any] = _json({})
    plateau_level: int = 0
    stop_reason: str = ""
    stop_rule: str = Field(default="", sa_column_kwargs={"server_default": ""})  # a StopRule once finished
    report_path: str = ""
    # "bwrap"; "none" once any run went unsandboxed (GROVE_SANDBOX=none); "unknown" from before sandboxing.
    sandbox: str = "bwrap"
    # The repository's identity across clones and paths: its root commit (lab memory is keyed by it).
    repository_key: str = ""
    created_at: datetime = Field(default_factory=now)
    started_at: datetime | None = None
    finished_at: datetime | None = None


class Node(SQLModel, table=True):
    # The coordinator asks for a study's nodes changed since its last look (`recordcache.RecordCache`).
    __table_args__ = (
        Index("ix_node_study_updated", "study_id", "updated_at"),
        Index("uq_node_study_number", "study_id", "number", unique=True),
        Index("ix_node_study_round", "study_id", "round_no"),  # a replayed ideation round finds its nodes
    )
    id: int | None = Field(default=None, primary_key=True)
    study_id: int = Field(index=True, foreign_key="study.id")
    number: int = 0  # the node's place in its study, 1 for the root: what every text calls it (`n{number}`)
    parent_id: int | None = Field(default=None, foreign_key="node.id")
    depth: int = 0
    round_no: int = 0
    title: str = ""
    hypothesis: dict[str, Any] = _json({})
    origin: str = "policy"  # policy|human|refine|restart|baseline
    origin_ref: int | None = None
    status: str = "proposed"
    # Why and by whom the status last changed (`records.transition`): the words of the node's fate.
    status_reason: str = Field(
        default="", sa_column=Column(Text, nullable=False, default="", server_default="")
    )
    status_by: str = Field(default="", sa_column_kwargs={"server_default": ""})
    prior: float = 0.0
    edits: dict[str, Any] = _json({})
    base_commit: str = ""
    # What the node starts from besides trunk (`storage.enqueue`): {"commit": the merge of trunk and
    # its parent's change, "parent": its number, "title", "diff", "effect", "conflict", "goal"}.
    inherited: dict[str, Any] = _json({})
    branch: str = ""
    commit: str = ""
    diff_stats: dict[str, Any] = _json({})
    dev_values: list[float] = _json([])
    dev_mean: float | None = None
    dev_std: float | None = None
    dev_n: int = 0
    gain: float | None = None
    gain_lcb: float | None = None
    constraints: list[dict[str, Any]] = _json([])
    verification: dict[str, Any] = _json({})
    summary: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    attempts: int = 0
    reflection: str = ""
    failure: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    # What the failure says about the idea (an `agents.failures.Blame`); "idea" unless told otherwise.
    blame: str = Field(default="idea", sa_column_kwargs={"server_default": "idea"})
    # What pruning its branch taught, on the top of a pruned branch (the ideator reads these first).
    lesson: str = Field(default="", sa_column=Column(Text, nullable=False, default="", server_default=""))
    gate_commit: str = ""
    gated: bool = False
    gate_passed: bool = Field(default=False, sa_column_kwargs={"server_default": false()})
    heldout_values: list[float] = _json([])
    heldout_gain: float | None = None
    heldout_lcb: float | None = None  # the gate's lower bound on the held-out gain
    heldout_level: float | None = None  # that bound's confidence (1 - alpha)
    gate_reason: str = ""
    completed_order: int = 0
    cost: dict[str, Any] = _json({})
    created_at: datetime = Field(default_factory=now)
    # Bumped by every ORM update of the row: the coordinator re-reads only the nodes that changed.
    updated_at: datetime = Field(default_factory=now, sa_column_kwargs={"onupdate": now})


class TrunkClaim(SQLModel, table=True):
    """A job's claim to run trunk's dev seeds up to `upto` on `commit`: siblings that need the same
    seeds wait for its values instead of running (and paying for) them again."""

    __tablename__ = "trunk_claim"
    __table_args__ = (UniqueConstraint("study_id", "commit", "upto"),)
    id: int | None = Field(default=None, primary_key=True)
    study_id: int = Field(index=True, foreign_key="study.id")
    commit: str
    upto: int
    job_id: int
    created_at: datetime = Field(default_factory=now)


class Job(SQLModel, table=True):
    __table_args__ = (
        UniqueConstraint("node_id", "attempt"),
        Index("ix_job_study_created", "study_id", "created_at"),
    )
    id: int | None = Field(default=None, primary_key=True)
    study_id: int = Field(index=True, foreign_key="study.id")
    node_id: int = Field(foreign_key="node.id")
    attempt: int = 1  # sealed jobs: 0, and -1 for `heldout` (its node is `baseline`'s)
    kind: str = "experiment"  # experiment | baseline | heldout | gate
    status: str = "queued"  # queued|running|done|failed
    token: str = ""  # the SHA-256 (hex) of the token its worker presents, sent with its task; never the token
    # Its attempt's Celery task id (`job-<id>-a<attempt>-<nonce>`; not a secret), to revoke the task by.
    task_id: str = ""
    pid: int | None = None
    extra_runs: int = 0  # adaptive repeats beyond `repeats` (the node's and trunk's), charged to the budget
    outcome: dict[str, Any] = _json({})
    created_at: datetime = Field(default_factory=now)
    started_at: datetime | None = None
    finished_at: datetime | None = None


class ReceiptRow(SQLModel, table=True):
    __tablename__ = "receipt"
    __table_args__ = (Index("ix_receipt_study_created", "study_id", "created_at"),)
    id: int | None = Field(default=None, primary_key=True)
    study_id: int = Field(index=True, foreign_key="study.id")
    node_id: int | None = Field(default=None, foreign_key="node.id")
    job_id: int | None = None
    kind: str = "dev"
    seed: int = 0
    command: str = ""
    commit: str = ""
    exit_code: int | None = None
    duration: float = 0.0
    timed_out: bool = False
    ok: bool = False
    reason: str = ""
    metrics: dict[str, Any] | None = _json(None)
    stdout_path: str = ""
    stderr_path: str = ""
    stdout_tail: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    stderr_tail: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    fingerprint: str = ""
    created_at: datetime = Field(default_factory=now)


class InsightVersion(SQLModel, table=True):
    __table_args__ = (Index("ix_insightversion_study_created", "study_id", "created_at"),)
    id: int | None = Field(default=None, primary_key=True)
    study_id: int = Field(index=True, foreign_key="study.id")
    node_id: int = Field(index=True, foreign_key="node.id")
    version: int = 1
    text: str = Field(sa_column=Column(Text, nullable=False))
    cites: list[int] = _json([])
    created_at: datetime = Field(default_factory=now)


class Event(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    study_id: int = Field(index=True, foreign_key="study.id")
    node_id: int | None = None
    type: str
    payload: dict[str, Any] = _json({})
    time: datetime = Field(default_factory=now)


class Approval(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    study_id: int = Field(index=True, foreign_key="study.id")
    node_id: int = Field(foreign_key="node.id", unique=True)
    status: str = "pending"  # pending|approved|rejected
    decided_by: str = ""
    reason: str = ""
    created_at: datetime = Field(default_factory=now)
    decided_at: datetime | None = None


class ApiToken(SQLModel, table=True):
    __tablename__ = "api_token"
    id: int | None = Field(default=None, primary_key=True)
    name: str = ""
    roles: str = "viewer"  # comma separated: viewer, operator, approver
    token_hash: str = Field(index=True, unique=True)
    created_at: datetime = Field(default_factory=now)
    expires_at: datetime | None = None
    revoked: bool = False


class LlmCall(SQLModel, table=True):
    __tablename__ = "llm_call"
    id: int | None = Field(default=None, primary_key=True)
    study_id: int = Field(index=True, foreign_key="study.id")
    node_id: int | None = Field(default=None, foreign_key="node.id")
    role: str
    model: str
    # The prompt is stored once: this call's prompt is the first `base_len` messages of call
    # `base_id`'s prompt followed by `messages` (`backend.services.ledger.prompt_of`).
    base_id: int | None = None
    base_len: int = 0
    messages: list[dict[str, Any]] = _json([])
    response: dict[str, Any] = _json({})
    tokens_in: int = 0
    tokens_out: int = 0
    usd: float = 0.0
    created_at: datetime = Field(default_factory=now)


class MemoryEntry(SQLModel, table=True):
    """What a finished study learned, for later studies of the same repository and objective.

    Dev-side evidence only: a finding's effect is its dev gain, never a held-out number.
    """

    __tablename__ = "memory_entry"
    id: int | None = Field(default=None, primary_key=True)
    repository: str = Field(index=True)  # Study.repository_key
    objective: str  # "<metric>:<direction>"
    name: str = Field(default="", index=True)  # a named memory the study opted into ([memory] name)
    kind: str  # "finding" (a merged change or a verified finding) or "lesson" (a pruned direction)
    text: str = Field(sa_column=Column(Text, nullable=False))
    study_id: int | None = None  # no foreign key: memory outlives the study it came from
    study_name: str = ""
    node_numbers: list[int] = _json([])
    dev_effect: float | None = None  # dev gain over the parent, in metric units
    diff: str = ""  # the merged change in brief: files, insertions, deletions
    created_at: datetime = Field(default_factory=now)


class LlmHold(SQLModel, table=True):
    """A model call in flight: its worst-case cost, held against the budget until the call is charged."""

    __tablename__ = "llm_hold"
    id: int | None = Field(default=None, primary_key=True)
    study_id: int = Field(index=True, foreign_key="study.id")
    usd: float = 0.0
    tokens: int = 0
    created_at: datetime = Field(default_factory=now)


class Trajectory(SQLModel, table=True):
    __table_args__ = (Index("ix_trajectory_study_created", "study_id", "created_at"),)
    id: int | None = Field(default=None, primary_key=True)
    study_id: int = Field(index=True, foreign_key="study.id")
    node_id: int = Field(foreign_key="node.id")
    job_id: int = Field(foreign_key="job.id", unique=True)
    attempt: int = 1
    outcome: str = ""
    messages: list[dict[str, Any]] = _json([])
    feedback: list[str] = _json([])
    report: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    created_at: datetime = Field(default_factory=now)


class LearningJob(SQLModel, table=True):
    """A learning-module job on the `gpu` queue: self-distillation or a sparse-attention evaluation."""

    __tablename__ = "learning_job"
    id: int | None = Field(default=None, primary_key=True)
    study_id: int | None = Field(default=None, index=True, foreign_key="study.id")
    kind: str  # distill | sparse_eval
    params: dict[str, Any] = _json({})
    status: str = "queued"  # queued|running|done|failed
    token: str = ""  # the SHA-256 (hex) of what the worker that runs it presents (sent with its task)
    host: str = ""  # the machine that ran it, which keeps its artifact
    progress: float = 0.0
    device: str = ""
    artifact: str = ""
    result: dict[str, Any] = _json({})
    error: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    created_at: datetime = Field(default_factory=now)
    started_at: datetime | None = None
    finished_at: datetime | None = None


class LearningEvent(SQLModel, table=True):
    """Append-only progress of a learning job."""

    __tablename__ = "learning_event"
    id: int | None = Field(default=None, primary_key=True)
    job_id: int = Field(index=True, foreign_key="learning_job.id")
    type: str  # learning.queued|started|progress|finished|failed
    payload: dict[str, Any] = _json({})
    time: datetime = Field(default_factory=now)


@event.listens_for(Node, "before_insert")
def _number_node(mapper: Any, connection: Connection, node: Node) -> None:
    """Give a new node the next number of its study (the update keeps the study row locked until commit)."""
    study: Table = Study.__table__  # type: ignore[attr-defined]
    node.number = connection.execute(
        update(study)
        .where(study.c.id == node.study_id)
        .values(nodes_numbered=study.c.nodes_numbered + 1)
        .returning(study.c.nodes_numbered)
    ).scalar_one()
