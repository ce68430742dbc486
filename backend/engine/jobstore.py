"""A job's reads and writes of Grove's records: the seam between a worker and the database.

Engine code that runs on a worker (an experiment, a sealed baseline or gate) reaches Grove's
records only through a `JobStore` bound to its study (and job). `DbStore` writes the database
directly (the single-process runner, a worker beside the API); `backend.worker.remote.ApiStore`
sends the same calls to the API, which runs them here, so a worker on another machine needs no
database and no shared data directory.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

from sqlmodel import Session, col, select

from agents.failures import Blame
from agents.tree.status import NodeStatus
from agents.verify.arex import Decision
from backend.core import db
from backend.core.gitops import Repo
from backend.core.models import Job, Node, ReceiptRow, Study, Trajectory, now
from backend.core.states import SEALED_KINDS, JobKind
from backend.engine.jobs.claims import Refused as Refused
from backend.engine.jobs.claims import Superseded as Superseded
from backend.engine.jobs.claims import Unreachable as Unreachable
from backend.engine.jobs.claims import claim_experiment as claim_experiment
from backend.engine.jobs.claims import claim_sealed as claim_sealed
from backend.engine.jobs.claims import host as host
from backend.engine.jobs.claims import job_of as job_of
from backend.engine.jobs.claims import locked_job as locked_job
from backend.engine.jobs.claims import same_token as same_token
from backend.engine.jobs.claims import token_hash as token_hash
from backend.engine.jobs.ledger import LlmLedger
from backend.engine.jobs.sealed import SealedWrites
from backend.engine.jobs.verdicts import local_repo as local_repo
from backend.services.records import add_event, latest_insight, mark_unsandboxed, spec_of, transition
from backend.services.storage import experiments_used


class JobStore(Protocol):
    """What a running job may read and write; every call is scoped to its study."""

    def study(self) -> Study: ...
    def node(self, node_id: int) -> Node: ...
    def event(self, kind: str, node_id: int | None, payload: dict[str, Any]) -> None: ...
    def finish(self, status: str, extra_runs: int, fields: dict[str, Any]) -> None: ...
    def crash(self, reason: str) -> None: ...
    def finish_sealed(self, status: str, outcome: dict[str, Any]) -> str: ...
    def gate_crashed(self, reason: str) -> None: ...
    def insights(self) -> list[str]: ...
    def reflections(self) -> list[str]: ...
    def save_trajectory(self, trajectory: dict[str, Any]) -> None: ...
    def relabel(self, old: str, new: str) -> None: ...
    def add_receipts(self, node_id: int | None, receipts: list[dict[str, Any]]) -> None: ...
    def not_worth_it(self, mean: float, spent: int, more: int) -> str: ...
    def keep_trunk_dev(self, base_commit: str, have: int, values: list[float]) -> None: ...
    def claim_trunk_seeds(self, base_commit: str, upto: int) -> bool: ...
    def baseline_running(self) -> bool: ...
    def baseline_dev(self, values: list[float]) -> None: ...
    def not_deterministic(self) -> None: ...
    def baseline_heldout(self, values: list[float]) -> None: ...
    def test_query(self) -> None: ...
    def verdict(
        self, passed: bool, reason: str, commit: str, values: list[float], gain: float | None
    ) -> None: ...
    def keep_trunk_heldout(self, trunk_commit: str, values: list[float]) -> None: ...
    def llm_reserve(self, usd: float, tokens: int) -> dict[str, Any]: ...
    def llm_release(self, hold: int) -> None: ...
    def llm_record(self, call: dict[str, Any], hold: int | None = None) -> int: ...
    def mark_unsandboxed(self) -> None: ...
    def publish(self, repo: Repo, ref: str, commit: str) -> None: ...


# The calls a remote worker's job may make, by its kind (the API runs exactly these on a `DbStore`).
_COMMON = frozenset({"study", "node", "add_receipts", "mark_unsandboxed"})
CALLS: dict[str, frozenset[str]] = {
    "experiment": _COMMON | {
        "event", "finish", "crash", "insights", "reflections", "save_trajectory", "relabel", "not_worth_it",
        "keep_trunk_dev", "claim_trunk_seeds", "llm_reserve", "llm_release", "llm_record", "baseline_running",
        "not_deterministic",
    },
    "baseline": _COMMON | {"finish_sealed", "baseline_dev"},
    "heldout": _COMMON | {"finish_sealed", "baseline_heldout", "test_query"},
    "gate": _COMMON | {"finish_sealed", "gate_crashed", "test_query", "verdict", "keep_trunk_heldout"},
}  # fmt: skip
# The only events a job writes by name.
EVENTS = frozenset({"node.repeated", "node.not_repeated", "llm.refused"})
REFLECTIONS = 5  # related reflections an executor is given


class DbStore(SealedWrites, LlmLedger):
    """A `JobStore` that writes the database (scoped to one study, and to one job when it has one)."""

    # reads ---------------------------------------------------------------------

    def insights(self) -> list[str]:
        """Return the newest insight of each ancestor of the job's node, root first."""
        out: list[str] = []
        with db.session(self.settings.db_url) as s:
            parent = self._node(s, self.node_id).parent_id
            while parent is not None:
                anc = s.get(Node, parent)
                if anc is None:
                    break
                text = latest_insight(s, parent)
                if text:
                    out.append(f"n{anc.number}: {text}")
                parent = anc.parent_id
        return list(reversed(out))

    def reflections(self) -> list[str]:
        """Return the reflections of failed attempts on related nodes (the parent and its children), newest first."""
        with db.session(self.settings.db_url) as s:
            node = self._node(s, self.node_id)
            related = s.exec(
                select(Node)
                .where(
                    Node.study_id == self.study_id,
                    Node.id != node.id,
                    Node.reflection != "",
                    (Node.parent_id == node.parent_id) | (Node.id == node.parent_id),
                )
                .order_by(col(Node.updated_at).desc())
                .limit(REFLECTIONS)
            ).all()
            return [f"n{n.number} ({n.title}): {n.reflection[-1500:]}" for n in related]

    def not_worth_it(self, mean: float, spent: int, more: int) -> str:
        """Return why more dev seeds are not worth running for the job's node now, or ''."""
        with db.session(self.settings.db_url) as s:
            node = self._node(s, self.node_id)
            study = s.get(Study, self.study_id)
            assert study is not None
            spec = spec_of(study)
            sign = 1.0 if spec.maximize else -1.0
            others = s.exec(
                select(Node.number, Node.dev_mean, Node.verification).where(
                    Node.study_id == self.study_id, Node.id != node.id, Node.base_commit == node.base_commit,
                    col(Node.status).in_(["evaluated", "awaiting_approval"]),
                ).order_by(col(Node.id))
            ).all()  # fmt: skip
            better = [
                number for number, dev_mean, verification in others
                if dev_mean is not None and sign * dev_mean > sign * mean
                and (verification or {}).get("decision") == Decision.ACCEPT
            ]  # fmt: skip
            if better:
                return f"n{better[0]} is better on dev and already a candidate"
            # This job's own runs so far, and at most `more` of the node's and of trunk's for the next look.
            used = experiments_used(s, self.study_id, spec.evaluate.repeats, pending_runs=spent + 2 * more)
        if used > spec.budget.experiments:
            return "the experiment budget would be overspent"
        return ""

    # writes --------------------------------------------------------------------

    def event(self, kind: str, node_id: int | None, payload: dict[str, Any]) -> None:
        """Append an event of the study (of the kinds a job writes)."""
        if kind not in EVENTS or set(payload) & {"s", "study_id", "type_", "node_id"}:
            raise Refused(f"a job may not write a {kind!r} event with keys {sorted(payload)}")
        with db.session(self.settings.db_url) as s:
            self._current(s)  # as the API refuses it: a job no longer running writes no event
            if node_id is not None:
                self._node(s, node_id)
            add_event(s, self.study_id, kind, node_id, **payload)

    def finish(self, status: str, extra_runs: int, fields: dict[str, Any]) -> None:
        """End the experiment job with its node's new status and fields; raise Superseded if not ours."""
        allowed = {
            "commit",
            "diff_stats",
            "failure",
            "blame",
            "reflection",
            "dev_values",
            "dev_mean",
            "dev_std",
            "dev_n",
        }
        if status not in (NodeStatus.EVALUATED, NodeStatus.FAILED, NodeStatus.REJECTED):
            raise Refused(f"an experiment ends evaluated, failed or rejected, not {status!r}")
        if set(fields) - allowed:
            raise Refused(f"an experiment may not set {sorted(set(fields) - allowed)}")
        with db.session(self.settings.db_url) as s:
            job = self._job(s)
            if job.kind != JobKind.EXPERIMENT:
                raise Refused(f"job {job.id} is a {job.kind} job, not an experiment")
            node = self._node(s, job.node_id)
            if "blame" in fields and fields["blame"] not in set(Blame):
                raise Refused(f"blame: {fields['blame']!r} is not one of {', '.join(Blame)}")
            for k, v in fields.items():
                setattr(node, k, v)
            if node.status != status:
                transition(s, node, status, job_id=job.id, reason=str(fields.get("failure", "")))
            job.status, job.finished_at = ("done" if status == NodeStatus.EVALUATED else "failed"), now()
            job.outcome = {
                "status": status,
                "reason": str(fields.get("failure", "")),
                "detail": str(fields.get("reflection", "")),
            }
            job.extra_runs = extra_runs
            s.add_all([job, node])

    def crash(self, reason: str) -> None:
        """Mark an experiment whose process died (or ran out of time) as failed."""
        with contextlib.suppress(Superseded):
            self.finish(NodeStatus.FAILED, 0, {"failure": reason, "blame": Blame.IDEA})
        with db.session(self.settings.db_url) as s:
            job = s.get(Job, self.job_id)
            if job is not None:
                add_event(s, job.study_id, "job.crashed", job.node_id, job_id=self.job_id, reason=reason)

    def save_trajectory(self, trajectory: dict[str, Any]) -> None:
        """Keep the executor's transcript of this attempt (once)."""
        with db.session(self.settings.db_url) as s:
            job = self._job(s)
            if s.exec(select(Trajectory).where(Trajectory.job_id == job.id)).first() is None:
                s.add(
                    Trajectory(
                        study_id=job.study_id, node_id=job.node_id, job_id=job.id or 0, attempt=job.attempt,
                        messages=list(trajectory.get("messages", [])), feedback=list(trajectory.get("feedback", [])),
                        report=str(trajectory.get("report", "")),
                    )
                )  # fmt: skip

    def relabel(self, old: str, new: str) -> None:
        """Give the job's node the title of its real diff (trunk may have moved since it was proposed)."""
        with db.session(self.settings.db_url) as s:
            self._current(s)
            node = self._node(s, self.node_id)
            node.title = new
            node.hypothesis = {k: v.replace(old, new) for k, v in node.hypothesis.items()}
            s.add(node)
            add_event(s, node.study_id, "node.relabeled", node.id, old=old, new=new)

    def add_receipts(self, node_id: int | None, receipts: list[dict[str, Any]]) -> None:
        """Store evaluation receipts of one of the study's nodes (this job's).

        An experiment job writes dev receipts only: of its own node, or of the trunk node it was built
        on (trunk's extra seeds, on that node's commit). Held-out receipts come from sealed jobs alone.
        """
        with db.session(self.settings.db_url) as s:
            job = self._job(s) if self.job_id is not None else None
            if job is not None and job.kind not in SEALED_KINDS:
                if node_id is None:
                    raise Refused(f"job {self.job_id} writes receipts of a node only")
                self._own_dev_receipts(s, self._node(s, node_id), receipts)
            elif node_id is not None:
                self._node(s, node_id)
            # Trunk's extra runs belong to trunk's node, not to the job that ran them.
            job_id = self.job_id if node_id == self.node_id else None
            for r in receipts:
                row = {k: r[k] for k in r if k in ReceiptRow.model_fields and k not in ("id", "created_at")}
                s.add(
                    ReceiptRow.model_validate(
                        {**row, "study_id": self.study_id, "node_id": node_id, "job_id": job_id}
                    )
                )

    def _own_dev_receipts(self, s: Session, target: Node, receipts: list[dict[str, Any]]) -> None:
        """Refuse receipts an experiment job cannot have made: another kind, or another node's."""
        odd = sorted({str(r.get("kind")) for r in receipts} - {"dev"})
        if odd:
            raise Refused(f"an experiment job writes dev receipts only, not {', '.join(odd)}")
        if target.id == self.node_id:
            return
        own = self._node(s, self.node_id)
        trunk_at = {target.commit, target.gate_commit} - {""}
        if not own.base_commit or own.base_commit not in trunk_at or target.status != NodeStatus.MERGED:
            raise Refused(f"job {self.job_id} does not write receipts for node {target.id}")
        if any(r.get("commit") != own.base_commit for r in receipts):
            raise Refused(
                f"trunk's receipts from job {self.job_id} are of its base commit {own.base_commit[:10]}"
            )

    def mark_unsandboxed(self) -> None:
        """Record that the study's code ran without the sandbox on this machine."""
        with db.session(self.settings.db_url) as s:
            mark_unsandboxed(s, self.study_id)

    def publish(self, repo: Repo, ref: str, commit: str) -> None:
        """Make a commit made in `repo` reachable in Grove's clone (it already is: the same repository)."""
