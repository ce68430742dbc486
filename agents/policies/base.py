"""The policy interface: who thinks (ideate, implement, summarise, verify).

Ideation inputs are built from dev-side evidence only; they have no field that could carry
a held-out number.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agents.capabilities import Capabilities
from agents.failures import Blame, NoEvidence
from agents.tree.status import NodeStatus, Origin


@dataclass(frozen=True, kw_only=True)
class NodeEvidence:
    """What ideation and summaries may know about a node: dev evidence, never held-out."""

    id: int
    parent_id: int | None
    depth: int
    status: NodeStatus
    title: str
    edits: dict[str, Any]
    origin: Origin
    dev_mean: float | None
    dev_std: float | None
    dev_n: int
    gain: float | None
    gain_lcb: float | None
    dev_metrics: dict[str, float]
    constraints: list[dict[str, Any]]
    summary: str
    insight: str
    failure: str = ""
    blame: Blame = Blame.IDEA  # what the failure says about the idea (machinery failures: nothing)
    lesson: str = ""  # what pruning its branch taught, on the top of a pruned branch
    report: str = ""  # the executor's own account of what it did (llm policy)
    origin_ref: int | None = None  # the node a refine or restart child answers
    number: int = 0  # the node's place in its study (n1 is the root): what texts call it
    diff: str = ""  # the node's change, filled for the node being verified (llm policy)
    mechanism: str = ""  # what the node's hypothesis changes, in its proposer's words


@dataclass(frozen=True)
class RefineRequest:
    node_id: int
    open_constraints: tuple[str, ...]
    goal: str


@dataclass(frozen=True, kw_only=True)
class IdeationInput:
    goal: str
    metric: str
    maximize: bool
    search_space: dict[str, dict[str, Any]]
    base_values: dict[str, Any]
    trunk_node_id: int
    trunk_dev_mean: float | None
    nodes: list[NodeEvidence]
    improvement_state: dict[str, Any]
    pruned_lessons: list[str]
    validated_findings: list[str]
    refine: list[RefineRequest]
    plateau_level: int
    k: int
    round_no: int
    seed: int
    constraints: list[dict[str, Any]] = field(default_factory=list)
    restart: list[int] = field(default_factory=list)  # nodes whose branch was abandoned (AREX restart)
    max_depth: int = 6  # no node may sit more steps than this below its nearest merged ancestor
    # Candidates built on an older trunk that improved it, best first, to be tried again on the
    # current trunk (for the `search` policy only those that beat the current trunk on dev).
    revisit: list[int] = field(default_factory=list)
    free: int = 0  # experiments that can start now (a sampler asks for no more, so none go stale)
    # Lab memory: what earlier studies of this repository learned, one line each with its provenance.
    memory: list[str] = field(default_factory=list)
    editable: list[str] = field(default_factory=list)  # `files.editable`: what a change may touch
    repo_map: dict[str, Any] = field(default_factory=dict)  # trunk's files, symbols, editable text (llm)
    # Ideas the last rounds dropped, oldest first: {"title", "parent_id" (a node id or None), "reason"}.
    dropped: list[dict[str, Any]] = field(default_factory=list)
    # The latest finished nodes' executor reports and diffs, newest first: {"id", "report", "diff"} (llm).
    recent: list[dict[str, Any]] = field(default_factory=list)
    # Node id -> steps below its nearest merged ancestor (0 when merged): what `max_depth` bounds.
    reach: dict[int, int] = field(default_factory=dict)
    # The experiment budget, what is left of it (running experiments counted as spent), and the
    # share of it kept for the finishing phase: local search around the best node (`search` policy).
    budget: int = 0
    budget_left: int = 0
    finish: float = 0.0

    def finishing(self) -> bool:
        """Return whether the study is in its finishing phase (the last `finish` share of the budget)."""
        return (
            self.budget > 0 and self.finish > 0 and self.budget_left <= math.ceil(self.finish * self.budget)
        )

    def takes_children(self, node: NodeEvidence) -> bool:
        """Return whether a child may hang under `node` (it is less than `max_depth` below trunk's line)."""
        return self.reach.get(node.id, node.depth) < self.max_depth

    def to_dict(self) -> dict[str, Any]:
        """Return the whole input as plain data (what a prompt could be built from)."""
        return asdict(self)


@dataclass(frozen=True)
class Proposal:
    parent_id: int
    title: str
    hypothesis: dict[str, str]
    prior: float
    edits: dict[str, Any]
    origin: Origin = Origin.POLICY
    origin_ref: int | None = None
    dropped: str = ""  # why the policy dropped it (a duplicate, an unknown parent): logged, never added


@dataclass(frozen=True, kw_only=True)
class ImplementInput:
    node_id: int
    title: str
    hypothesis: dict[str, str]
    edits: dict[str, Any]
    reflection: str
    editable: list[str]
    context: dict[str, Any] = field(default_factory=dict)  # goal, metric, direction, ancestor insights
    targets: dict[str, list[str]] = field(default_factory=dict)  # `[search]` key -> its `FILE:dotted` targets
    formats: dict[str, str] = field(default_factory=dict)  # `[files.formats]`
    runtime: Any = None  # agents.executor.tools.Runtime, provided by the host
    trajectory: dict[str, Any] = field(default_factory=dict)  # filled by executors that keep one
    number: int = 0  # the node's number in its study (what texts call it)


@dataclass(frozen=True)
class Judgement:
    """The verifier's answer: a 0-100 confidence per soft constraint, and AREX's call with its reason."""

    verdicts: dict[str, tuple[int, str]] = field(default_factory=dict)
    call: str = ""  # "", "accept", "refine" or "restart"
    why: str = ""


class ImplementationError(RuntimeError):
    """The implementer could not realise the hypothesis in the worktree."""


class AnswerFormatError(ImplementationError, NoEvidence):
    """The model's answers could not be used (no runnable action): a failure of format, not evidence on the idea."""


class Policy(Protocol):
    """Ideate children, implement a node in its worktree, summarise evidence into insights."""

    name: str
    capabilities: Capabilities

    def ideate(self, ctx: IdeationInput) -> list[Proposal]: ...

    def implement(self, worktree: Path, node: ImplementInput) -> str: ...

    def summarise(self, node: NodeEvidence, ctx_metric: str, parent: NodeEvidence | None) -> str: ...

    def synthesize(self, ancestor: NodeEvidence, children: list[NodeEvidence], metric: str) -> str: ...

    def verify(self, node: NodeEvidence, soft: list[dict[str, Any]]) -> Judgement: ...

    def update_state(
        self,
        state: dict[str, Any],
        recent: list[NodeEvidence],
        numbers: dict[int, int] | None = None,
        accepted: frozenset[int] | None = None,
    ) -> dict[str, Any]: ...
