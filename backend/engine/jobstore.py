"""A job's reads and writes of Grove's records: the seam between a worker and the database.

Engine code that runs on a worker (an experiment, a sealed baseline or gate) reaches Grove's
records only through a `JobStore` bound to its study (and job). `DbStore` writes the database
directly (the single-process runner, a worker beside the API); `backend.worker.remote.ApiStore`
sends the same calls to the API, which runs them here, so a worker on another machine needs no
database and no shared data directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, func, select

from agents.failures import Blame
from agents.tree.gate import heldout_decision
from agents.tree.sequential import Plan
from agents.tree.stats import same_every_seed, summarize
from agents.tree.status import NodeStatus
from agents.verify.arex import Decision
from backend.core import db
from backend.core.config import Settings
from backend.core.gitops import Repo
from backend.core.models import Job, LlmCall, LlmHold, Node, ReceiptRow, Study, Trajectory, TrunkClaim, now
from backend.core.states import JobKind, JobStatus, RunKind
from backend.engine import policing
from backend.services.records import add_event, latest_insight, mark_unsandboxed, spec_of, transition
from backend.services.storage import experiments_used

SEALED = ("baseline", "heldout", "gate")  # the baseline's dev runs, its held-out runs, a gate


class Superseded(RuntimeError):
    """This job's token is no longer current; another run owns it."""


class Unreachable(RuntimeError):
    """The records could not be reached (the API is down or failed): the job is tried again later."""


class Refused(ValueError):
    """A call named a node of another study, or a ref outside the study's namespace."""


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
HOLD_LIFETIME = timedelta(hours=1)  # a hold older than this belongs to a call that died
LLM_FIELDS = frozenset({"node_id", "role", "model", "base_id", "base_len", "messages", "response",
                        "tokens_in", "tokens_out", "usd", "seconds"})  # fmt: skip


def token_hash(token: str) -> str:
    """Return what the database keeps of a job's token: its SHA-256, in hex (a copy of the rows holds no token)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def same_token(held: str, given: str) -> bool:
    """Return whether a presented token is the one whose hash the job keeps (compared in constant time; never an empty one)."""
    return bool(held) and bool(given) and secrets.compare_digest(held, token_hash(given))


def locked_job(s: Session, job_id: int | None) -> Job | None:
    """Return a job's row read under its write lock, so that a check of it holds until the commit.

    pysqlite reads outside a transaction until the first write, and PostgreSQL reads the last
    committed row: a cancellation committed between a check and the write after it would be
    overwritten. PostgreSQL locks the row as it reads it (`FOR UPDATE`); SQLite has no row locks,
    so a no-op update first takes the database's write lock.
    """
    if job_id is None:
        return None
    if s.get_bind().dialect.name == "sqlite":
        s.connection().execute(update(Job).where(col(Job.id) == job_id).values(status=Job.status))
        return s.get(Job, job_id, populate_existing=True)
    return s.get(Job, job_id, populate_existing=True, with_for_update=True)


def claim_experiment(
    settings: Settings, job_id: int, token: str, host: str, pid: int
) -> tuple[Job, Node, Study]:
    """Mark an experiment job running (its node too) and return its rows; raise Superseded if not ours."""
    with db.session(settings.db_url) as s:
        job = locked_job(s, job_id)
        if (
            job is None
            or job.kind != JobKind.EXPERIMENT
            or not same_token(job.token, token)
            or job.status not in (JobStatus.QUEUED, JobStatus.RUNNING)
        ):
            raise Superseded(f"job {job_id} is not ours to run")
        node = s.get(Node, job.node_id)
        study = s.get(Study, job.study_id)
        assert node is not None and study is not None
        job.status, job.started_at, job.pid = "running", now(), pid
        s.add(job)
        add_event(
            s, job.study_id, "job.started", job.node_id, job_id=job_id, attempt=job.attempt, pid=pid, host=host
        )  # fmt: skip
        if node.status == NodeStatus.QUEUED:
            transition(s, node, NodeStatus.RUNNING, job_id=job_id, attempt=job.attempt)
        s.flush()
        for row in (job, node, study):
            s.refresh(row)
            s.expunge(row)
        return job, node, study


def claim_sealed(settings: Settings, job_id: int, token: str) -> Job | None:
    """Mark a sealed job running and count the try; None if it is not ours to run."""
    with db.session(settings.db_url) as s:
        job = locked_job(s, job_id)
        if (
            job is None
            or job.kind not in SEALED
            or not same_token(job.token, token)
            or job.status not in (JobStatus.QUEUED, JobStatus.RUNNING)
        ):
            return None
        tries = int(job.outcome.get("tries", 0)) + 1
        job.status, job.started_at, job.outcome = "running", now(), {**job.outcome, "tries": tries}
        s.add(job)
        s.flush()
        s.refresh(job)
        s.expunge(job)
        return job


def job_of(settings: Settings, job_id: int, token: str) -> Job | None:
    """Return a job while this token is current and the job is running (a remote worker's right to call)."""
    with db.session(settings.db_url) as s:
        job = s.get(Job, job_id)
        if job is None or not same_token(job.token, token) or job.status != JobStatus.RUNNING:
            return None
        s.expunge(job)
        return job


def host() -> tuple[str, int]:
    """Return this process's host name and pid, as a claim records them."""
    return socket.gethostname(), os.getpid()


class DbStore:
    """A `JobStore` that writes the database (scoped to one study, and to one job when it has one)."""

    def __init__(
        self,
        settings: Settings,
        study_id: int,
        node_id: int | None,
        job_id: int | None = None,
        token: str = "",
    ) -> None:
        self.settings, self.study_id, self.node_id = settings, study_id, node_id
        self.job_id, self.token = job_id, token

    # reads ---------------------------------------------------------------------

    def study(self) -> Study:
        """Return the study as it is now."""
        with db.session(self.settings.db_url) as s:
            st = s.get(Study, self.study_id)
            assert st is not None
            s.expunge(st)
            return st

    def node(self, node_id: int) -> Node:
        """Return one of the study's nodes as it is now."""
        with db.session(self.settings.db_url) as s:
            node = self._node(s, node_id)
            s.expunge(node)
            return node

    def _node(self, s: Session, node_id: int | None) -> Node:
        node = s.get(Node, node_id) if node_id is not None else None
        if node is None or node.study_id != self.study_id:
            raise Refused(f"node {node_id} is not a node of study {self.study_id}")
        return node

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

    def _job(self, s: Session) -> Job:
        job = locked_job(s, self.job_id)
        if job is None or not same_token(job.token, self.token) or job.status != JobStatus.RUNNING:
            raise Superseded(f"job {self.job_id} was taken over")
        return job

    def _current(self, s: Session) -> None:
        """Refuse a job's write once the job is no longer running under this token (cancelled, taken over).

        A store without a job (the single-process gatekeeper) writes for the coordinator itself.
        """
        if self.job_id is not None:
            self._job(s)

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

    def finish_sealed(self, status: str, outcome: dict[str, Any]) -> str:
        """Record a sealed job's end unless someone else ended it meanwhile (a stop cancels it)."""
        if status not in (JobStatus.DONE, JobStatus.FAILED):
            raise Refused(f"a sealed job ends done or failed, not {status!r}")
        with db.session(self.settings.db_url) as s:
            try:
                job = self._job(s)
            except Superseded:
                return "superseded"
            job.status, job.finished_at, job.outcome = status, now(), outcome
            s.add(job)
        return status

    def gate_crashed(self, reason: str) -> None:
        """Fail the gate of the job's node, unless it already has a verdict."""
        with db.session(self.settings.db_url) as s:
            self._current(s)
            node = self._node(s, self.node_id)
            if not node.gated:
                record_verdict(s, node, False, f"failed: the gate job crashed: {reason}"[:2000])

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
            if job is not None and job.kind not in SEALED:
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

    def keep_trunk_dev(self, base_commit: str, have: int, values: list[float]) -> None:
        """Keep trunk's extra dev values (seeds `have..`) unless trunk moved; another job may have added some."""
        with db.session(self.settings.db_url) as s:
            self._current(s)
            st = s.get(Study, self.study_id)
            assert st is not None
            if st.trunk_commit == base_commit and have <= len(st.trunk_dev) < have + len(values):
                st.trunk_dev = [*st.trunk_dev, *values[len(st.trunk_dev) - have :]]
                root = s.get(Node, st.trunk_node_id)
                if root is not None and len(root.dev_values) < len(st.trunk_dev):
                    root.dev_values = list(st.trunk_dev)
                    summ = summarize(root.dev_values)
                    root.dev_mean, root.dev_std, root.dev_n = summ.mean, summ.std, summ.n
                    s.add(root)
                s.add(st)
                add_event(
                    s, self.study_id, "trunk.repeated", st.trunk_node_id, seeds=len(st.trunk_dev),
                    by_node=self.node_id,
                )  # fmt: skip

    def claim_trunk_seeds(self, base_commit: str, upto: int) -> bool:
        """Claim the running of trunk's dev seeds up to `upto` on `base_commit`; False if a sibling has."""
        try:
            with db.session(self.settings.db_url) as s:
                self._current(s)
                s.add(
                    TrunkClaim(study_id=self.study_id, commit=base_commit, upto=upto, job_id=self.job_id or 0)
                )
        except IntegrityError:
            return False
        return True

    def _study_and_trunk(self, s: Session) -> tuple[Study, Node]:
        study = s.get(Study, self.study_id)
        assert study is not None
        root = s.get(Node, study.trunk_node_id)
        assert root is not None
        return study, root

    def baseline_running(self) -> bool:
        """Return whether the study's baseline dev job is running now (trunk's dev values are on their way)."""
        with db.session(self.settings.db_url) as s:
            found = s.exec(
                select(Job.id).where(
                    Job.study_id == self.study_id,
                    Job.kind == JobKind.BASELINE,
                    Job.status == JobStatus.RUNNING,
                )
            ).first()
            return found is not None

    def baseline_dev(self, values: list[float]) -> None:
        """Record the unchanged repository's dev values."""
        with db.session(self.settings.db_url) as s:
            self._current(s)
            study, root = self._study_and_trunk(s)
            study.baseline_dev = study.trunk_dev = values
            root.dev_values, root.dev_n = values, len(values)
            root.dev_mean = sum(values) / len(values)
            spec = spec_of(study)
            judged = spec.judged_metrics()
            runs = s.exec(
                select(ReceiptRow.metrics).where(
                    ReceiptRow.study_id == self.study_id, ReceiptRow.node_id == root.id, ReceiptRow.kind == RunKind.DEV,
                    ReceiptRow.commit == study.base_commit, ReceiptRow.ok == True,  # noqa: E712
                )
            ).all()  # fmt: skip
            study.dev_deterministic = same_every_seed([m or {} for m in runs], judged)
            s.add_all([study, root])
            add_event(s, self.study_id, "node.evaluated", root.id, dev=values, baseline=True)
            if study.dev_deterministic:
                add_event(s, self.study_id, "evaluator.deterministic", None, seeds=len(runs), metrics=judged)

    def not_deterministic(self) -> None:
        """Record that the job's node gave different dev values on two seeds: the study is noisy after all."""
        with db.session(self.settings.db_url) as s:
            self._current(s)
            study = s.get(Study, self.study_id)
            assert study is not None
            if study.dev_deterministic:
                study.dev_deterministic = False
                s.add(study)
                add_event(
                    s, self.study_id, "evaluator.noisy", self.node_id, reason="two seeds of this node differ"
                )

    def baseline_heldout(self, values: list[float]) -> None:
        """Record the unchanged repository's held-out values (each one a recorded run of this job)."""
        with db.session(self.settings.db_url) as s:
            self._current(s)
            study, root = self._study_and_trunk(s)
            spec = spec_of(study)
            why = _out_of_bounds(spec, values) or (
                "" if self.job_id is None
                else _unrecorded(s, spec, ReceiptRow.job_id == self.job_id, values, study.base_commit)
            )  # fmt: skip
            if not values or why:
                raise Refused(f"the baseline's held-out values: {why or 'none'}")
            study.baseline_heldout = study.trunk_heldout = values
            root.heldout_values = values
            s.add_all([study, root])

    def test_query(self) -> None:
        """Count one query of the sealed split."""
        with db.session(self.settings.db_url) as s:
            self._current(s)
            study = s.get(Study, self.study_id)
            assert study is not None
            study.test_queries += 1
            s.add(study)

    def verdict(
        self, passed: bool, reason: str, commit: str, values: list[float], gain: float | None
    ) -> None:
        """Record the gate verdict of the job's node, judged again here: a pass the server cannot confirm fails.

        The merge is recomputed from trunk and the node's recorded commit, the diff policed, the
        values bounded by the objective and matched with the job's receipts, and the held-out rule
        applied to them; a mismatch fails the gate and the job with the reason, and raises Refused.
        """
        with db.session(self.settings.db_url) as s:
            self._current(s)
            node = self._node(s, self.node_id)
            study = s.get(Study, self.study_id)
            assert study is not None
            spec = spec_of(study)
            if passed and self._trunk_moved(study, commit):  # stale, not forged: it could not merge anyway
                record_verdict(s, node, False, "failed: trunk moved while the gate ran", "", values, None)
                return
            why, bound = self._judge(
                s, study, node, spec, values, passed, commit
            )  # the worker's gain is not kept
            if not why:
                record_verdict(s, node, passed, reason, commit if passed else "", values, bound)
                return
            refused = f"failed: the server refused the gate's result: {why}"[:2000]
            record_verdict(s, node, False, refused, "", [], None)
            add_event(s, self.study_id, "gate.refused", node.id, reason=why[:2000])
            if self.job_id is not None:
                job = self._job(s)
                job.status, job.finished_at = "failed", now()
                job.outcome = {**job.outcome, "reason": refused}
                s.add(job)
        raise Refused(refused)

    @staticmethod
    def _trunk_moved(study: Study, commit: str) -> bool:
        """Return whether `commit` merged onto an earlier trunk of the study (trunk moved since)."""
        repo = local_repo(study)
        onto = (
            repo.git("rev-parse", "--verify", "--quiet", f"{commit}^1", check=False).strip() if commit else ""
        )
        return bool(onto) and onto != study.trunk_commit and repo.is_ancestor(onto, study.trunk_commit)

    def _judge(
        self, s: Session, study: Study, node: Node, spec: Any, values: list[float], passed: bool, commit: str
    ) -> tuple[str, Bound | None]:
        """Return why a reported gate result cannot be kept ('' if it can) and the held-out gain recomputed."""
        if why := _out_of_bounds(spec, values):
            return why, None
        if self.job_id is not None and values:
            mine = ReceiptRow.job_id == self.job_id
            if why := _unrecorded(s, spec, mine, values, commit if passed else ""):
                return why, None
        trunk = list(study.trunk_heldout)
        gain = None
        if values and len(trunk) >= len(values):
            plan = Plan(spec.gate.test_repeats, 3 * spec.gate.test_repeats)
            alpha = plan.alpha_at(len(values))
            d = heldout_decision(
                values, trunk[: len(values)], maximize=spec.maximize, margin=spec.gate.margin, alpha=alpha
            )
            gain = Bound(d.gain, d.gain_lcb, 1 - alpha)
            if passed and not d.passed:
                return f"the reported values do not pass the held-out rule ({d.reason})", gain
        elif passed:
            return "a pass needs at least as many trunk held-out values as the node's", None
        if not passed:
            return "", gain
        if not commit:
            return "a pass names no merged commit", gain
        why = policing.gate_mismatch(local_repo(study), spec, commit, study.trunk_commit, node.commit)
        return (f"{why} (trunk {study.trunk_commit[:12]} merged with n{node.number})" if why else ""), gain

    def keep_trunk_heldout(self, trunk_commit: str, values: list[float]) -> None:
        """Keep trunk's longer held-out values unless trunk moved meanwhile (each one a recorded run of trunk)."""
        with db.session(self.settings.db_url) as s:
            self._current(s)
            study = s.get(Study, self.study_id)
            assert study is not None
            if study.trunk_commit == trunk_commit and len(study.trunk_heldout) < len(values):
                spec, have = spec_of(study), len(study.trunk_heldout)
                if list(values[:have]) != study.trunk_heldout:
                    return  # another gate extended them first
                trunk_runs = ReceiptRow.node_id == study.trunk_node_id
                why = _out_of_bounds(spec, values) or _unrecorded(
                    s, spec, trunk_runs, values[have:], trunk_commit, first=have, latest=False
                )
                if why:
                    raise Refused(f"trunk's held-out values: {why}")
                study.trunk_heldout = list(values)
                root = s.get(Node, study.trunk_node_id)
                if root is not None:
                    root.heldout_values = list(values)
                    s.add(root)
                s.add(study)

    def llm_reserve(self, usd: float, tokens: int) -> dict[str, Any]:
        """Hold a call's worst case against the study's budgets: `{"hold": id}`, or `{"refused": why}`.

        Holds of one study are taken one at a time (the insert takes SQLite's write lock, the row
        lock on the study PostgreSQL's), so calls in flight together can never overspend.
        """
        if not all(isinstance(v, int | float) and v >= 0 for v in (usd, tokens)):
            raise Refused("a hold needs non-negative usd and tokens")
        with db.session(self.settings.db_url) as s:
            hold = LlmHold(study_id=self.study_id, usd=float(usd), tokens=int(tokens))
            s.add(hold)
            s.flush()
            study = s.exec(select(Study).where(Study.id == self.study_id).with_for_update()).one()
            budget = spec_of(study).budget
            spent_usd, spent_tokens = s.exec(
                select(
                    func.coalesce(func.sum(LlmCall.usd), 0.0),
                    func.coalesce(func.sum(LlmCall.tokens_in + LlmCall.tokens_out), 0),
                ).where(LlmCall.study_id == self.study_id)
            ).one()
            held_usd, held_tokens = s.exec(
                select(
                    func.coalesce(func.sum(LlmHold.usd), 0.0), func.coalesce(func.sum(LlmHold.tokens), 0)
                ).where(LlmHold.study_id == self.study_id, col(LlmHold.created_at) >= now() - HOLD_LIFETIME)
            ).one()
            why, spent = "", Blame.USD
            if budget.usd > 0 and float(spent_usd) + float(held_usd) > budget.usd:
                why = (
                    f"LLM budget spent: ${float(spent_usd):.4g} of ${budget.usd:.4g} charged, "
                    f"${float(held_usd) - usd:.4g} held by calls in flight, and this call may cost ${usd:.4g}"
                )
            elif budget.tokens and int(spent_tokens) + int(held_tokens) > budget.tokens:
                why, spent = (
                    (
                        f"LLM budget spent: {int(spent_tokens)} of {budget.tokens} tokens used, "
                        f"{int(held_tokens) - tokens} held by calls in flight, and this call may take {tokens}"
                    ),
                    Blame.TOKENS,
                )
            if why:
                s.delete(hold)
                return {"refused": why, "budget": spent}
            return {"hold": hold.id}

    def llm_release(self, hold: int) -> None:
        """Drop the hold of a call that failed (nothing to charge)."""
        with db.session(self.settings.db_url) as s:
            row = s.get(LlmHold, hold)
            if row is not None and row.study_id == self.study_id:
                s.delete(row)

    def llm_record(self, call: dict[str, Any], hold: int | None = None) -> int:
        """Store one LLM call (its new messages only), charge it to the node and the study, drop its hold."""
        bad = set(call) - LLM_FIELDS
        costs = [call.get(k, 0) for k in ("tokens_in", "tokens_out", "usd", "base_len", "seconds")]
        if bad or not all(isinstance(c, int | float) and math.isfinite(c) and c >= 0 for c in costs):
            raise Refused(f"an LLM call may not carry {sorted(bad)} or negative counts")
        with db.session(self.settings.db_url) as s:
            # The study's lock, as `llm_reserve` takes it: a hold becomes a charge in one step for it.
            s.exec(select(Study.id).where(Study.id == self.study_id).with_for_update()).one()
            held = s.get(LlmHold, hold) if hold is not None else None
            if held is not None and held.study_id == self.study_id:
                s.delete(held)
            node_id = call.get("node_id")
            if node_id is not None:
                self._node(s, node_id)
            base_id = call.get("base_id")
            base = s.get(LlmCall, base_id) if base_id is not None else None
            if base_id is not None and (base is None or base.study_id != self.study_id):
                raise Refused(f"LLM call {base_id} is not a call of study {self.study_id}")
            seconds = float(call.get("seconds", 0.0))  # how long the call took: in its event, not its row
            row = LlmCall.model_validate(
                {**{k: v for k, v in call.items() if k != "seconds"}, "study_id": self.study_id}
            )
            s.add(row)
            s.flush()
            assert row.id is not None
            if node_id is not None:
                node = s.get(Node, node_id)
                assert node is not None
                cost = dict(node.cost)
                cost["tokens"] = int(cost.get("tokens", 0)) + row.tokens_in + row.tokens_out
                cost["usd"] = float(cost.get("usd", 0.0)) + row.usd
                cost["calls"] = int(cost.get("calls", 0)) + 1
                node.cost = cost
                s.add(node)
            add_event(
                s, self.study_id, "llm.call", node_id, role=row.role, model=row.model,
                tokens=row.tokens_in + row.tokens_out, usd=row.usd, seconds=round(seconds, 3),
            )  # fmt: skip
            return row.id

    def mark_unsandboxed(self) -> None:
        """Record that the study's code ran without the sandbox on this machine."""
        with db.session(self.settings.db_url) as s:
            mark_unsandboxed(s, self.study_id)

    def publish(self, repo: Repo, ref: str, commit: str) -> None:
        """Make a commit made in `repo` reachable in Grove's clone (it already is: the same repository)."""


@dataclass(frozen=True)
class Bound:
    """A held-out gain with its lower confidence bound, at the level the gate judged it."""

    gain: float
    lcb: float
    level: float  # the bound's one-sided confidence, 1 - alpha (0.95 at the first look)


def record_verdict(
    s: Any,
    node: Node,
    passed: bool,
    reason: str,
    commit: str = "",
    values: list[float] | None = None,
    gain: Bound | None = None,
) -> None:
    """Store a node's gate verdict with its event; a failed gate rejects the node (if nothing ended it first)."""
    node.gated, node.gate_passed, node.gate_reason, node.gate_commit = True, passed, reason, commit
    node.heldout_values = values or []
    node.heldout_gain, node.heldout_lcb, node.heldout_level = (
        (gain.gain, gain.lcb, gain.level) if gain else (None, None, None)
    )
    s.add(node)
    add_event(s, node.study_id, "node.gate_passed" if passed else "node.gate_failed", node.id, passed=passed)
    if not passed and node.status == NodeStatus.EVALUATED:
        transition(s, node, NodeStatus.REJECTED, reason="held-out gate failed")


def local_repo(study: Study) -> Repo:
    """Return Grove's clone of a study's repository."""
    return Repo(Path(study.repo_path))


def _out_of_bounds(spec: Any, values: list[float]) -> str:
    """Return why held-out values cannot be a metric's ('' if they can): finite, within objective.bounds."""
    low, high = spec.objective.bounds or (-math.inf, math.inf)
    if all(isinstance(v, int | float) and math.isfinite(v) and low <= v <= high for v in values):
        return ""
    return f"held-out values {values[:12]} are not finite numbers within objective.bounds"


def _unrecorded(
    s: Session, spec: Any, which: Any, values: list[float], commit: str, first: int = 0, latest: bool = True
) -> str:
    """Return why `values` are not the metric of the recorded test runs `which` selects ('' if they are).

    Seeds start at `first`; where `commit` is named, only runs that evaluated it count. With
    `latest`, a seed's last run counts (a retried job runs them again); without, any of its runs
    (jobs running side by side each measure trunk's next seeds).
    """
    where = [which, ReceiptRow.kind == RunKind.TEST, col(ReceiptRow.ok)] + (
        [ReceiptRow.commit == commit] if commit else []
    )
    seen: dict[int, list[Any]] = {}
    for r in sorted(s.exec(select(ReceiptRow).where(*where)).all(), key=lambda r: r.id or 0):
        seen.setdefault(r.seed, []).append((r.metrics or {}).get(spec.objective.metric))
    seeds = [k for k in sorted(seen) if k >= first]
    if latest:
        fits = [seen[k][-1] for k in seeds] == list(values)
    else:
        fits = all(v in seen.get(first + i, ()) for i, v in enumerate(values))
    if not fits:
        at = f" of {commit[:12]}" if commit else ""
        return f"the held-out values are not those of the job's recorded test runs{at}"
    return ""
