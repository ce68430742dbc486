"""The sealed held-out gate, trunk moves, and the study's final report.

Held-out numbers are written to the database and the report only; the coordinator gets
pass/fail.
"""

from __future__ import annotations

from typing import Any

from sqlmodel import select

from agents.spec import Spec
from agents.tree.gate import heldout_decision
from agents.tree.sequential import Plan, Step
from agents.tree.status import NodeStatus, StopRule
from agents.verify.state import ImprovementState
from backend.core import db
from backend.core.config import Settings
from backend.core.gitops import GitError, MergeConflict, Repo
from backend.core.models import Node, Study
from backend.engine import environment, policing, runs, workspace
from backend.engine.jobstore import DbStore, JobStore, local_repo
from backend.services import approvals, lifecycle, notify, report
from backend.services.approvals import answer_of, withdraw_approval
from backend.services.records import add_event, spec_of, transition


class BaselineError(RuntimeError):
    """The unchanged repository does not evaluate cleanly, so no gain can be measured."""

    def __init__(self, message: str, step: StopRule | None) -> None:
        super().__init__(message)
        self.step = step


class SealedRunner:
    """Runs a study's sealed evaluations (the baseline, a gate) wherever its job landed."""

    def __init__(self, settings: Settings, store: JobStore, repo: Repo) -> None:
        self.settings, self.store, self.repo = settings, store, repo

    def _unboxed(self) -> None:
        """Record on the study that its code is about to run without the sandbox here."""
        if self.settings.sandbox == "none":
            self.store.mark_unsandboxed()

    def baseline(self, dev: bool = True, heldout: bool = True) -> None:
        """Measure trunk at base on dev and (or) held-out once (idempotent)."""
        st = self.store.study()
        dev, heldout = dev and not st.baseline_dev, heldout and not st.baseline_heldout
        if dev or heldout:
            self._unboxed()
        spec = spec_of(st)
        if dev:
            path = workspace.worktree_path(self.settings, st, "baseline-dev")
            workspace.prepare(
                self.repo, path, f"grove/{st.name}/baseline", st.base_commit, sealed=spec.files.sealed,
                reason="baseline",
            )  # fmt: skip
            try:
                rs = runs.run_repeats(
                    self.settings, self.store, self.repo, st, spec, kind="dev", worktree=path,
                    commit=st.base_commit, label="baseline", node_id=st.trunk_node_id,
                )  # fmt: skip
            except environment.SetupFailed as exc:
                raise BaselineError(str(exc), StopRule.SETUP) from None
            finally:
                self.repo.remove_worktree(path)
            if not all(r.ok for r in rs):
                bad = next(r for r in rs if not r.ok)
                raise BaselineError(
                    f"the dev evaluation fails on the unchanged repository: {bad.reason}\n{bad.stderr_tail[-1500:]}",
                    StopRule.BASELINE_DEV,
                )
            self.store.baseline_dev([r.objective(spec.objective.metric) or 0.0 for r in rs])
        if heldout:
            values_t = self._heldout(st, spec, st.base_commit, "baseline-test", node_id=st.trunk_node_id)
            if values_t is None:
                raise BaselineError(
                    "the sealed test evaluation fails on the unchanged repository", StopRule.BASELINE_TEST
                )
            self.store.baseline_heldout(values_t)

    def _heldout(
        self, st: Study, spec: Spec, commit: str, label: str, node_id: int | None, seeds: range | None = None
    ) -> list[float] | None:
        """Run the sealed test on `commit` (seeds `0..test_repeats-1` or `seeds`); None if a run failed.

        A first run is one sealed-split query; more seeds for the same question are not.
        """
        path = workspace.worktree_path(self.settings, st, label)
        workspace.prepare_test(self.repo, path, f"grove/{st.name}/{label}", commit, st, spec, reason=label)
        try:
            rs = runs.run_repeats(
                self.settings, self.store, self.repo, st, spec, kind="test", worktree=path, commit=commit,
                label=label, node_id=node_id, seeds=seeds,
            )  # fmt: skip
        finally:
            self.repo.remove_worktree(path)
        if seeds is None:
            self.store.test_query()
        if not all(r.ok for r in rs):
            return None
        return [r.objective(spec.objective.metric) or 0.0 for r in rs]

    def gate(self, node_id: int) -> bool:
        """Merge the candidate onto a copy of trunk, test the merged commit, return pass/fail."""
        node = self.store.node(node_id)
        if node.gated:
            return passed_gate(node)
        st = self.store.study()
        if not st.baseline_heldout:  # a study resumed in one process before its held-out job ran
            self.baseline(dev=False)
            st = self.store.study()
        spec = spec_of(st)
        self._unboxed()
        label = f"gate-n{node_id}"
        gate_branch = f"grove/{st.name}/gate/n{node_id}"
        passed, reason, merged, values, gain = False, "", "", None, None
        try:
            message = f"Grove: merge n{node.number} ({node.title})"
            merged = self.repo.merge_onto(gate_branch, st.trunk_commit, node.commit or node.branch, message)
        except MergeConflict:
            reason = "failed: merge conflict with trunk"
        except GitError as exc:
            reason = f"failed: {exc}"
        violation = policing.diff_violation(self.repo, st.trunk_commit, merged, spec) if merged else ""
        if violation:
            reason = f"rejected: {violation}"
        elif merged:
            # The merged commit is tested in a fresh worktree that holds the sealed files.
            setup = ""
            try:
                values = self._heldout(st, spec, merged, label, node_id=node_id)
                if values is not None:
                    values, trunk = self._look_again(st, spec, merged, label, node_id, values)
            except environment.SetupFailed as exc:  # the merged commit's dependencies do not install
                values, setup = None, str(exc).splitlines()[0]
            if values is None:
                reason = (
                    f"failed: {setup}"
                    if setup
                    else "failed: the sealed evaluation did not run cleanly on the merged commit"
                )
            else:
                plan = Plan(spec.gate.test_repeats, 3 * spec.gate.test_repeats)
                d = heldout_decision(
                    values, trunk[: len(values)], maximize=spec.maximize, margin=spec.gate.margin,
                    alpha=plan.alpha_at(len(values)),
                )  # fmt: skip
                passed, gain = d.passed, d.gain
                reason = ("passed: " if d.passed else "failed: ") + d.reason
        if passed:
            self.store.publish(self.repo, gate_branch, merged)  # trunk moves to it once approved
        self.store.verdict(passed, reason, merged if passed else "", values or [], gain)
        return passed

    def _look_again(
        self, st: Study, spec: Spec, merged: str, label: str, node_id: int, values: list[float]
    ) -> tuple[list[float] | None, list[float]]:
        """Give an unclear held-out gain more paired test seeds, trunk's too (up to 3 x test_repeats).

        The same sequential rule as dev repeats: each look tests at its share of the 5%.
        """
        plan = Plan(spec.gate.test_repeats, 3 * spec.gate.test_repeats)
        sign = 1.0 if spec.maximize else -1.0
        trunk = list(st.trunk_heldout)
        while len(trunk) >= len(values):
            n = len(values)
            diffs = [sign * (v - t) - spec.gate.margin for v, t in zip(values, trunk, strict=False)]
            if plan.step(diffs) != Step.MORE:
                break
            target = plan.next_n(n)
            if len(trunk) < target:
                more_t = self._heldout(
                    st, spec, st.trunk_commit, f"{label}-trunk", st.trunk_node_id, seeds=range(len(trunk), target)
                )  # fmt: skip
                if more_t is None:
                    break
                trunk += more_t
                self.store.keep_trunk_heldout(st.trunk_commit, trunk)
            more = self._heldout(st, spec, merged, label, node_id, seeds=range(n, target))
            if more is None:
                return None, trunk
            values = values + more
        return values, trunk


def passed_gate(node: Node) -> bool:
    """Return whether a gated node's recorded verdict is a pass."""
    return node.status in (NodeStatus.AWAITING_APPROVAL, NodeStatus.MERGED) or (
        node.status == NodeStatus.EVALUATED and node.gate_passed
    )


class LocalGatekeeper:
    """Runs sealed evaluations in worktrees of Grove's clone, and moves trunk."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def _load(self, study_id: int) -> Study:
        with db.session(self.settings.db_url) as s:
            st = s.get(Study, study_id)
            assert st is not None
            return st

    def _runner(self, study_id: int, node_id: int | None) -> SealedRunner:
        store = DbStore(self.settings, study_id, node_id)
        return SealedRunner(self.settings, store, local_repo(self._load(study_id)))

    def baseline(self, study_id: int) -> None:
        """Measure trunk at base on dev and held-out once (idempotent)."""
        with db.session(self.settings.db_url) as s:
            lifecycle.start(s, study_id)
        try:
            self._runner(study_id, None).baseline()
        finally:
            environment.release()  # this process runs on: the builds it used may go when the disk needs room

    def gate(self, study_id: int, node_id: int) -> bool:
        """Merge the candidate onto a copy of trunk, test the merged commit, return pass/fail."""
        try:
            return self._runner(study_id, node_id).gate(node_id)
        finally:
            environment.release()

    def await_approval(self, study_id: int, node_id: int) -> None:
        """Mark a gate-passed node as waiting for a human and open an approval."""
        opened = False
        with db.session(self.settings.db_url) as s:
            node = s.get(Node, node_id)
            assert node is not None
            if node.status == NodeStatus.EVALUATED:
                transition(s, node, NodeStatus.AWAITING_APPROVAL)
            opened = approvals.open_for(s, study_id, node_id)
        if opened:
            notify.approval_opened(self.settings, study_id, node_id)

    def decision(self, study_id: int, node_id: int) -> dict[str, Any] | None:
        """Return the human decision on a node's open approval, or None while there is none."""
        with db.session(self.settings.db_url) as s:
            return answer_of(s, node_id)

    def withdraw(self, study_id: int, node_id: int, reason: str) -> bool:
        """Close a node's open approval without a decision (the node is cancelled); False if one came first."""
        with db.session(self.settings.db_url) as s:
            if not withdraw_approval(s, node_id, reason):
                node = s.get(Node, node_id)
                return node is None or node.status != NodeStatus.AWAITING_APPROVAL
            node = s.get(Node, node_id)
            assert node is not None
            if node.status == NodeStatus.AWAITING_APPROVAL:
                transition(s, node, NodeStatus.CANCELLED, reason=reason)
            return True

    def merge(self, study_id: int, node_id: int, by: str) -> None:
        """Move trunk to the exact commit the gate tested (idempotent)."""
        st = self._load(study_id)
        repo = workspace.repo_of(st)
        with db.session(self.settings.db_url) as s:
            node = s.get(Node, node_id)
            study = s.get(Study, study_id)
            assert node is not None and study is not None
            if node.status == NodeStatus.MERGED:
                return
            if not repo.is_ancestor(study.trunk_commit, node.gate_commit):
                transition(s, node, NodeStatus.REJECTED, reason="trunk moved since the gate ran")
                return
            # Trunk moves only to the merge the server itself makes of trunk and the node's commit.
            why = policing.gate_mismatch(
                repo, spec_of(study), node.gate_commit, study.trunk_commit, node.commit
            )
            if why:
                add_event(s, study_id, "gate.refused", node_id, reason=why[:2000])
                transition(
                    s, node, NodeStatus.REJECTED, reason=f"the gate's commit was refused: {why}"[:2000]
                )
                return
            repo.set_branch(study.trunk_branch, node.gate_commit)
            study.trunk_commit = node.gate_commit
            study.trunk_dev = list(node.dev_values)
            study.trunk_heldout = list(node.heldout_values)
            study.trunk_node_id = node_id
            s.add(study)
            transition(s, node, NodeStatus.MERGED, by=by, trunk=node.gate_commit)
            approvals.close_approved(s, node_id, by)

    def reject(self, study_id: int, node_id: int, reason: str, by: str) -> None:
        """Reject a gate-passed node on a human's word."""
        with db.session(self.settings.db_url) as s:
            node = s.get(Node, node_id)
            assert node is not None
            if node.status in (NodeStatus.AWAITING_APPROVAL, NodeStatus.EVALUATED):
                transition(s, node, NodeStatus.REJECTED, reason=reason, by=by)
            study = s.get(Study, study_id)
            assert study is not None
            istate = ImprovementState.from_dict(study.improvement_state)
            istate.retract(node_id, f"rejected by {by or 'a human'}: {reason}")
            study.improvement_state = istate.to_dict()
            s.add(study)
            approvals.close_rejected(s, node_id, by, reason)

    def finalize(self, study_id: int, reason: str, rule: StopRule | None) -> None:
        """Close the study and write REPORT.md (trunk's held-out score is already measured)."""
        with db.session(self.settings.db_url) as s:
            for n in s.exec(
                select(Node).where(Node.study_id == study_id, Node.status == NodeStatus.PROPOSED)
            ):
                transition(s, n, NodeStatus.CANCELLED, reason="study finished")
            lifecycle.finish(s, study_id, reason, rule)
        # A process killed between a job's last write and its cleanup can leave a worktree behind.
        workspace.remove_study_worktrees(self.settings, self._load(study_id))
        path = report.write(self.settings, study_id)
        with db.session(self.settings.db_url) as s:
            study = s.get(Study, study_id)
            assert study is not None
            study.report_path = str(path)
            s.add(study)
