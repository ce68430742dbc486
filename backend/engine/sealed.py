"""Sealed evaluations as jobs: the baseline and the held-out gate, run by a worker, not the coordinator.

The coordinator (`SealedJobs`, its `Gatekeeper` under Celery) creates a `baseline`, `heldout` or
`gate` job; a `cpu` or `gpu` worker (the study's queue) runs it here with the same code the
single-process runner calls directly (`LocalGatekeeper`), then wakes the coordinator, which reads
the verdict from the node. Nothing is integrated before the `baseline` job (trunk's dev runs)
ends, and nothing proposed before it where the policy reads trunk's value; the `heldout` job
(trunk's held-out runs) then runs beside the experiments, as gates do, and only a gate waits
for it. Sealed jobs use attempt 0 (`heldout` -1: the same node as
`baseline`) and never count as experiments.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from sqlmodel import select

from agents.coordinator.ports import Pending
from agents.tree.status import StopRule
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Job, Node, Study
from backend.core.states import JobKind, JobStatus
from backend.engine import environment
from backend.engine.gatekeeper import BaselineError, LocalGatekeeper, SealedRunner
from backend.engine.jobstore import DbStore, Superseded, Unreachable
from backend.engine.site import Site
from backend.services import lifecycle
from backend.services.records import add_event

__all__ = ["MAX_TRIES", "SealedJobs", "run"]
MAX_TRIES = 3  # a sealed job whose worker dies this often (killed, out of memory) fails


def run(site: Site, job_id: int, token: str) -> str:
    """Run a sealed job whose token is current; return its final status ("superseded" once it is not)."""
    try:
        return _run(site, job_id, token)
    except Superseded:
        return "superseded"  # cancelled (the study stopped) or taken over: nothing more is written
    finally:
        environment.release()


def _run(site: Site, job_id: int, token: str) -> str:
    claimed = site.claim_sealed(job_id, token)
    if claimed is None:
        return "superseded"
    job, store = claimed
    tries = int(job.outcome.get("tries", 1))
    outcome: dict[str, object] = {"tries": tries}
    if tries > MAX_TRIES:
        reason = f"its worker died {MAX_TRIES} times (time limit, memory?)"
        if job.kind == JobKind.GATE:
            store.gate_crashed(reason)
        return store.finish_sealed("failed", {**outcome, "reason": reason})
    try:
        runner = SealedRunner(site.settings, store, site.repo(store.study(), job_id, token, sealed=True))
        if job.kind in (
            JobKind.BASELINE,
            JobKind.HELDOUT,
        ):  # the dev runs the study waits for; then, beside it, held-out
            runner.baseline(dev=job.kind == JobKind.BASELINE, heldout=job.kind == JobKind.HELDOUT)
        else:
            outcome["passed"] = runner.gate(job.node_id)
        status = "done"
    except BaselineError as exc:
        status, outcome["reason"], outcome["step"] = "failed", str(exc), str(exc.step)
    except (Unreachable, Superseded):
        raise  # the API is out of reach (tried again later), or the job is no longer ours
    except Exception as exc:  # recorded with its reason: the coordinator must not wait forever
        traceback.print_exc()
        status, outcome["reason"] = "failed", f"{type(exc).__name__}: {exc}"[:2000]
        if job.kind == JobKind.GATE:
            store.gate_crashed(str(outcome["reason"]))
    return store.finish_sealed(status, outcome)


def _gate_crashed(settings: Settings, study_id: int, node_id: int, reason: str) -> None:
    DbStore(settings, study_id, node_id).gate_crashed(reason)


class SealedJobs:
    """A gatekeeper that hands the baseline and each gate to a job on the study's worker queue."""

    def __init__(self, settings: Settings, submit: Callable[[int], None]) -> None:
        self.settings, self.submit = settings, submit
        self.local = LocalGatekeeper(settings)  # trunk moves, approvals and the report stay here

    def _job(self, study_id: int, node_id: int, kind: str) -> Job:
        """Return the node's job of this kind, created once (attempt 0; -1 for trunk's second, the held-out one)."""
        with db.session(self.settings.db_url) as s:
            job = s.exec(select(Job).where(Job.node_id == node_id, Job.kind == kind)).first()
            if job is None:
                job = Job(
                    study_id=study_id,
                    node_id=node_id,
                    attempt=-1 if kind == JobKind.HELDOUT else 0,
                    kind=kind,
                )
                s.add(job)
                s.flush()
                add_event(s, study_id, f"{kind}.queued", node_id, job_id=job.id)
            return job

    def baseline(self, study_id: int) -> Pending | None:
        """Measure the baseline in jobs: dev first (blocking), then held-out beside the study; None once both are in.

        The held-out job is created here but sent by the graph once the experiments have their
        slots, so that it takes a worker slot only after them.
        """
        return self._baseline(study_id, send_held_out=False)

    def _baseline(self, study_id: int, send_held_out: bool) -> Pending | None:
        with db.session(self.settings.db_url) as s:
            st = s.get(Study, study_id)
            assert st is not None
        if st.baseline_dev and st.baseline_heldout:
            return None
        if not st.baseline_dev:
            with db.session(self.settings.db_url) as s:
                lifecycle.start(s, study_id)
        kind = JobKind.HELDOUT if st.baseline_dev else JobKind.BASELINE
        job = self._job(study_id, st.trunk_node_id or 0, kind)
        if job.status in (JobStatus.DONE, JobStatus.FAILED):
            said = job.outcome.get("step")  # the step a baseline job failed on, if it was a known one
            step = next((r for r in StopRule if r == said), None)
            raise BaselineError(
                str(job.outcome.get("reason") or "the baseline job ended without a baseline"), step
            )
        # A running job is the reconciler's, should its worker die.
        if job.status == JobStatus.QUEUED and (kind == JobKind.BASELINE or send_held_out):
            self.submit(job.id or 0)
        return Pending(job.id or 0, blocking=kind == JobKind.BASELINE)

    def gate(self, study_id: int, node_id: int) -> bool | Pending:
        """Gate the node in a job; its verdict once the job has recorded one."""
        with db.session(self.settings.db_url) as s:
            node = s.get(Node, node_id)
            assert node is not None
            gated = node.gated
        if gated:
            return self.local.gate(study_id, node_id)  # reads the recorded verdict, runs nothing
        pending = self._baseline(study_id, send_held_out=True)  # the gate compares with the held-out baseline
        if pending is not None:
            return Pending(pending.job_id)
        job = self._job(study_id, node_id, "gate")
        if job.status in (JobStatus.DONE, JobStatus.FAILED):
            _gate_crashed(
                self.settings, study_id, node_id, str(job.outcome.get("reason") or "no verdict recorded")
            )
            return False
        self.submit(job.id or 0)
        return Pending(job.id or 0)

    def await_approval(self, study_id: int, node_id: int) -> None:
        """Open the approval of a gate-passed node."""
        self.local.await_approval(study_id, node_id)

    def decision(self, study_id: int, node_id: int) -> dict[str, Any] | None:
        """Return the human decision on a node's open approval, or None."""
        return self.local.decision(study_id, node_id)

    def withdraw(self, study_id: int, node_id: int, reason: str) -> bool:
        """Close a node's open approval without a decision; False if a decision came first."""
        return self.local.withdraw(study_id, node_id, reason)

    def merge(self, study_id: int, node_id: int, by: str) -> None:
        """Move trunk to the node's tested merge commit."""
        self.local.merge(study_id, node_id, by)

    def reject(self, study_id: int, node_id: int, reason: str, by: str) -> None:
        """Record a human rejection."""
        self.local.reject(study_id, node_id, reason, by)

    def finalize(self, study_id: int, reason: str, rule: StopRule | None) -> None:
        """Close the study and write its report."""
        self.local.finalize(study_id, reason, rule)
