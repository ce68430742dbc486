"""The writes of sealed jobs: trunk's baseline and held-out values, test queries, gate verdicts."""

from __future__ import annotations

from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, select

from agents.tree.gate import heldout_decision
from agents.tree.sequential import Plan
from agents.tree.stats import same_every_seed, summarize
from backend.core import db
from backend.core.models import Job, Node, ReceiptRow, Study, TrunkClaim, now
from backend.core.states import JobKind, JobStatus, RunKind
from backend.engine import policing
from backend.engine.jobs.base import StoreBase
from backend.engine.jobs.claims import (
    Refused,
    Superseded,
)
from backend.engine.jobs.verdicts import Bound, local_repo, out_of_bounds, record_verdict, unrecorded
from backend.services.records import add_event, spec_of


class SealedWrites(StoreBase):
    """The writes of sealed jobs: trunk's baseline and held-out values, test queries, gate verdicts."""

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
            why = out_of_bounds(spec, values) or (
                "" if self.job_id is None
                else unrecorded(s, spec, ReceiptRow.job_id == self.job_id, values, study.base_commit)
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
        if why := out_of_bounds(spec, values):
            return why, None
        if self.job_id is not None and values:
            mine = ReceiptRow.job_id == self.job_id
            if why := unrecorded(s, spec, mine, values, commit if passed else ""):
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
                why = out_of_bounds(spec, values) or unrecorded(
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
