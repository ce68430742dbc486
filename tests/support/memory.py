"""In-memory doubles of the coordinator's ports: storage, dispatcher and gatekeeper in one object."""

from __future__ import annotations

from typing import Any

from agents.coordinator.configuration import CoordinatorContext
from agents.coordinator.ports import Integration, NodeRecord, StudyView
from agents.failures import Blame
from agents.policies.base import NodeEvidence, Proposal
from agents.spec import parse_spec
from agents.tree.insights import InsightUpdate
from agents.tree.status import StopRule
from tests.support.repos import tiny_files

# Half steps: enough untried values that exploring never runs out before the budget (the sampler
# reads the list as ordered, and finds x = 3 early on).
KNOB = "[0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5]"


class Memory:
    """Storage, dispatcher and gatekeeper in one deterministic in-memory double."""

    def __init__(self, mode: str = "approve", experiments: int = 4, gate_passes: bool = True) -> None:
        self.spec = parse_spec(tiny_files(mode=mode, experiments=experiments, values=KNOB)["grove.toml"])
        self.status = "running"
        self.rows: dict[int, dict[str, Any]] = {}
        self.jobs: dict[int, int] = {}
        self.events: list[str] = []
        self.told: set[tuple[str, int | None]] = set()
        self.submitted: list[int] = []
        self.gate_passes = gate_passes
        self.trunk = "c0"
        self.trunk_dev = [1.0, 1.01]
        self.trunk_node = 1
        self.state: dict[str, Any] = {}
        self.rounds: dict[int, list[int]] = {}
        self.answer: dict[str, Any] | None = None  # the human's decision, given after `decide_after` jobs
        self.decide_after = 0
        self.completed: list[int] = []  # node ids in the order their jobs finished
        self.opened: dict[int, int] = {}  # node -> jobs completed when its approval opened
        self.add(None, "baseline", {"config.toml:knob.x": 0}, status="merged", dev=[1.0, 1.01])

    def add(
        self,
        parent: int | None,
        title: str,
        edits: dict[str, Any],
        status: str = "proposed",
        dev: list[float] | None = None,
    ) -> int:
        nid = len(self.rows) + 1
        self.rows[nid] = dict(id=nid, parent=parent, title=title, edits=edits, status=status, dev=dev or [],
                               attempts=0, order=0, verification={}, gain=None, lcb=None, cons=[], gated=False,
                               base="", insight="")  # fmt: skip
        return nid

    # Storage
    def study(self, study_id: int) -> StudyView:
        return StudyView(
            id=study_id,
            name="tiny",
            status=self.status,
            spec=self.spec,
            trunk_commit=self.trunk,
            trunk_node_id=self.trunk_node,
            trunk_dev=self.trunk_dev,
            base_values={"config.toml:knob.x": 0},
            test_queries=0,
            experiments_used=len(self.jobs),
            elapsed_hours=0.0,
            improvement_state=self.state,
            plateau_level=0,
        )

    def nodes(self, study_id: int) -> list[NodeRecord]:
        out = []
        for n in self.rows.values():
            depth = 0 if n["parent"] is None else 1
            mean = sum(n["dev"]) / len(n["dev"]) if n["dev"] else None
            ev = NodeEvidence(
                id=n["id"],
                parent_id=n["parent"],
                depth=depth,
                status=n["status"],
                title=n["title"],
                edits=n["edits"],
                origin="policy",
                dev_mean=mean,
                dev_std=0.0,
                dev_n=len(n["dev"]),
                gain=n["gain"],
                gain_lcb=n["lcb"],
                dev_metrics={"size": n["edits"]["config.toml:knob.x"]},
                constraints=n["cons"],
                summary="",
                insight=n["insight"],
                lesson=n.get("lesson", ""),
            )
            receipts = [
                (i, {"score": v, "size": n["edits"]["config.toml:knob.x"]}) for i, v in enumerate(n["dev"])
            ]
            out.append(
                NodeRecord(
                    evidence=ev,
                    round_no=0,
                    prior=0.0,
                    base_commit=n["base"],
                    dev_values=n["dev"],
                    dev_receipts=receipts,
                    attempts=n["attempts"],
                    completed_order=n["order"],
                    verification=n["verification"],
                    gated=n["gated"],
                )
            )
        return out

    def add_proposals(self, study_id: int, round_no: int, proposals: list[Proposal]) -> list[int]:
        if round_no not in self.rounds:
            self.rounds[round_no] = [self.add(p.parent_id, p.title, p.edits) for p in proposals]
        return self.rounds[round_no]

    def enqueue(self, study_id: int, node_id: int) -> int:
        n = self.rows[node_id]
        if n["status"] == "queued":
            return next(j for j, nid in self.jobs.items() if nid == node_id)
        n["status"], n["attempts"], n["base"] = "queued", n["attempts"] + 1, self.trunk
        job = len(self.jobs) + 100
        self.jobs[job] = node_id
        return job

    def job_nodes(self, job_ids: list[int]) -> dict[int, int]:
        return {j: self.jobs[j] for j in job_ids}

    def record(self, study_id: int, result: Integration) -> None:
        n = self.rows[result.node_id]
        n.update(status=result.status, gain=result.gain, lcb=result.gain_lcb, cons=result.constraints,
                 verification=result.verification, insight=result.summary)  # fmt: skip
        n["order"] = max(m["order"] for m in self.rows.values()) + 1

    def add_insights(self, study_id: int, updates: list[InsightUpdate]) -> None:
        for u in updates:
            self.rows[u.node_id]["insight"] = u.text

    def save_state(self, study_id: int, state: dict[str, Any], plateau_level: int) -> None:
        self.state = state

    def prune(self, study_id: int, node_id: int, reason: str, lesson: str) -> None:
        self.rows[node_id]["status"] = "pruned"
        self.rows[node_id]["lesson"] = f"PRUNED ({reason}). Lesson: {lesson}"

    def event(self, study_id: int, type_: str, node_id: int | None, payload: dict[str, Any]) -> None:
        self.events.append(type_)
        self.told.add((type_, node_id))

    def said(self, study_id: int, type_: str, node_id: int) -> bool:
        return (type_, node_id) in self.told

    def cancel_active(self, study_id: int) -> None:
        for n in self.rows.values():
            if n["status"] in ("queued", "running", "proposed"):
                n["status"] = "cancelled"

    def pause(self, study_id: int, reason: str, spent: Blame) -> None:
        self.status = "paused"
        self.events.append(f"paused: {reason}")

    # Dispatcher
    def submit(self, job_id: int) -> None:
        self.submitted.append(job_id)

    def complete(self, job_id: int) -> None:
        """Play the executor: x close to 3 scores higher."""
        n = self.rows[self.jobs[job_id]]
        x = n["edits"]["config.toml:knob.x"]
        n["status"], n["dev"] = "evaluated", [10 - (x - 3) ** 2, 10 - (x - 3) ** 2 + 0.01]
        self.completed.append(n["id"])

    # Gatekeeper
    def baseline(self, study_id: int) -> None:
        self.events.append("baseline")

    def gate(self, study_id: int, node_id: int) -> bool:
        self.rows[node_id]["gated"] = True
        if not self.gate_passes:
            self.rows[node_id]["status"] = "rejected"
        return self.gate_passes

    def await_approval(self, study_id: int, node_id: int) -> None:
        self.rows[node_id]["status"] = "awaiting_approval"
        self.opened[node_id] = len(self.completed)
        self.events.append(f"approval opened for n{node_id}")

    def decision(self, study_id: int, node_id: int) -> dict[str, Any] | None:
        if self.answer is None or len(self.completed) - self.opened[node_id] < self.decide_after:
            return None
        return self.answer

    def withdraw(self, study_id: int, node_id: int, reason: str) -> bool:
        if self.decision(study_id, node_id) is not None:
            return False
        self.rows[node_id]["status"] = "cancelled"
        self.events.append(f"withdrawn: {reason}")
        return True

    def merge(self, study_id: int, node_id: int, by: str) -> None:
        n = self.rows[node_id]
        n["status"], self.trunk, self.trunk_dev, self.trunk_node = "merged", f"c{node_id}", n["dev"], node_id
        self.events.append(f"merged by {by}")

    def reject(self, study_id: int, node_id: int, reason: str, by: str) -> None:
        self.rows[node_id]["status"] = "rejected"
        self.events.append(f"rejected: {reason}")

    def finalize(self, study_id: int, reason: str, rule: StopRule | None) -> None:
        self.status = "finished"
        self.events.append(f"finished: {reason}")


def context(mem: Memory, policy: Any, dispatcher: Any = None) -> CoordinatorContext:
    """Return the run context of a graph over one in-memory double (its dispatcher may be another)."""
    return CoordinatorContext(storage=mem, dispatcher=dispatcher or mem, sealed=mem, trunk=mem, policy=policy)


def bare_record(i: int, parent: int | None, status: str, title: str) -> NodeRecord:
    """Return the record of a node with no evidence yet: an id, a parent, a status and a title."""
    ev = NodeEvidence(
        id=i, parent_id=parent, depth=0 if parent is None else 1, status=status, title=title, edits={},
        origin="policy", dev_mean=None, dev_std=None, dev_n=0, gain=None, gain_lcb=None, dev_metrics={},
        constraints=[], summary="", insight="", number=i,
    )  # fmt: skip
    return NodeRecord(evidence=ev, round_no=0, prior=0.0, base_commit="c0", dev_values=[], dev_receipts=[],
                      attempts=0, completed_order=0)  # fmt: skip
