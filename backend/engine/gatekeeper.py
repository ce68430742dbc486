"""The sealed held-out gate, trunk moves, and the study's final report.

Held-out numbers are written to the database and the report only; the coordinator gets
pass/fail.
"""

from __future__ import annotations

from sqlmodel import Session, select

from agents.tree.gate import heldout_decision
from agents.tree.sequential import Plan, Step
from agents.tree.status import NodeStatus
from backend.core import db
from backend.core.config import Settings
from backend.core.gitops import GitError, MergeConflict
from backend.core.models import Approval, Node, Study, now
from backend.engine import workspace
from backend.services import lifecycle, report
from backend.services.records import add_event, spec_of, transition


class BaselineError(RuntimeError):
    """The unchanged repository does not evaluate cleanly, so no gain can be measured."""


def record_verdict(
    s: Session,
    node: Node,
    passed: bool,
    reason: str,
    commit: str = "",
    values: list[float] | None = None,
    gain: float | None = None,
) -> None:
    """Store a node's gate verdict with its event; a failed gate rejects the node."""
    node.gated, node.gate_reason, node.gate_commit = True, reason, commit
    node.heldout_values, node.heldout_gain = values or [], gain
    s.add(node)
    add_event(s, node.study_id, "node.gate_passed" if passed else "node.gate_failed", node.id, passed=passed)
    if not passed:
        transition(s, node, NodeStatus.REJECTED, reason="held-out gate failed")


class LocalGatekeeper:
    """Runs sealed evaluations in worktrees of Grove's clone."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def _load(self, study_id: int) -> Study:
        with db.session(self.settings.db_url) as s:
            st = s.get(Study, study_id)
            assert st is not None
            return st

    def baseline(self, study_id: int) -> None:
        """Measure trunk at base on dev and held-out once (idempotent)."""
        st = self._load(study_id)
        spec = spec_of(st)
        repo = workspace.repo_of(st)
        with db.session(self.settings.db_url) as s:
            lifecycle.start(s, study_id)
        if not st.baseline_dev:
            path = workspace.worktree_path(self.settings, st, "baseline-dev")
            workspace.prepare(
                repo,
                path,
                f"grove/{st.name}/baseline",
                st.base_commit,
                sealed=spec.files.sealed,
                reason="baseline",
            )
            try:
                rs = workspace.run_repeats(
                    self.settings, st, spec, kind="dev", worktree=path, commit=st.base_commit,
                    label="baseline", node_id=st.trunk_node_id,
                )  # fmt: skip
            finally:
                repo.remove_worktree(path)
            if not all(r.ok for r in rs):
                bad = next(r for r in rs if not r.ok)
                raise BaselineError(
                    f"the dev evaluation fails on the unchanged repository: {bad.reason}\n{bad.stderr_tail[-1500:]}"
                )
            values = [r.objective(spec.objective.metric) or 0.0 for r in rs]
            with db.session(self.settings.db_url) as s:
                study = s.get(Study, study_id)
                root = s.get(Node, st.trunk_node_id)
                assert study is not None and root is not None
                study.baseline_dev = study.trunk_dev = values
                root.dev_values, root.dev_n = values, len(values)
                root.dev_mean = sum(values) / len(values)
                s.add_all([study, root])
                add_event(s, study_id, "node.evaluated", root.id, dev=values, baseline=True)
        if not st.baseline_heldout:
            values_t = self._heldout(st, spec, st.base_commit, "baseline-test", node_id=st.trunk_node_id)
            if values_t is None:
                raise BaselineError("the sealed test evaluation fails on the unchanged repository")
            with db.session(self.settings.db_url) as s:
                study = s.get(Study, study_id)
                root = s.get(Node, st.trunk_node_id)
                assert study is not None and root is not None
                study.baseline_heldout = study.trunk_heldout = values_t
                root.heldout_values = values_t
                s.add_all([study, root])

    def _heldout(  # type: ignore[no-untyped-def]
        self, st: Study, spec, commit: str, label: str, node_id: int | None, seeds: range | None = None
    ) -> list[float] | None:
        """Run the sealed test on `commit` (seeds `0..test_repeats-1` or `seeds`); None if a run failed.

        A first run is one sealed-split query; more seeds for the same question are not.
        """
        repo = workspace.repo_of(st)
        path = workspace.worktree_path(self.settings, st, label)
        workspace.prepare(repo, path, f"grove/{st.name}/{label}", commit, sealed=None, reason=label)
        try:
            rs = workspace.run_repeats(
                self.settings,
                st,
                spec,
                kind="test",
                worktree=path,
                commit=commit,
                label=label,
                node_id=node_id,
                seeds=seeds,
            )
        finally:
            repo.remove_worktree(path)
        if seeds is None:
            with db.session(self.settings.db_url) as s:
                study = s.get(Study, st.id)
                assert study is not None
                study.test_queries += 1
                s.add(study)
        if not all(r.ok for r in rs):
            return None
        return [r.objective(spec.objective.metric) or 0.0 for r in rs]

    def gate(self, study_id: int, node_id: int) -> bool:
        """Merge the candidate onto a copy of trunk, test the merged commit, return pass/fail."""
        st = self._load(study_id)
        spec = spec_of(st)
        repo = workspace.repo_of(st)
        with db.session(self.settings.db_url) as s:
            node = s.get(Node, node_id)
            assert node is not None
            if node.gated:
                return node.status in (NodeStatus.AWAITING_APPROVAL, NodeStatus.MERGED) or (
                    node.status == NodeStatus.EVALUATED and node.gate_reason.startswith("passed")
                )
            branch, title = node.branch, node.title
        label = f"gate-n{node_id}"
        path = workspace.worktree_path(self.settings, st, f"{label}-merge")
        passed, reason, merged, values, gain = False, "", "", None, None
        try:
            workspace.prepare(
                repo, path, f"grove/{st.name}/gate/n{node_id}", st.trunk_commit, sealed=None, reason=label
            )
            merged = repo.merge_into(path, branch, f"Grove: merge n{node_id} ({title})")
        except MergeConflict:
            reason = "failed: merge conflict with trunk"
        except GitError as exc:
            reason = f"failed: {exc}"
        finally:
            repo.remove_worktree(path)
        violation = workspace.diff_violation(repo, st.trunk_commit, merged, spec) if merged else ""
        if violation:
            reason = f"rejected: {violation}"
        elif merged:
            # The merged commit is tested in a fresh worktree that holds the sealed files.
            values = self._heldout(st, spec, merged, label, node_id=node_id)
            if values is not None:
                values, trunk = self._look_again(st, spec, merged, label, node_id, values)
            if values is None:
                reason = "failed: the sealed evaluation did not run cleanly on the merged commit"
            else:
                plan = Plan(spec.gate.test_repeats, 3 * spec.gate.test_repeats)
                d = heldout_decision(
                    values, trunk[: len(values)], maximize=spec.maximize, margin=spec.gate.margin,
                    alpha=plan.alpha_at(len(values)),
                )  # fmt: skip
                passed, gain = d.passed, d.gain
                reason = ("passed: " if d.passed else "failed: ") + d.reason
        with db.session(self.settings.db_url) as s:
            node = s.get(Node, node_id)
            assert node is not None
            record_verdict(s, node, passed, reason, merged if passed else "", values or [], gain)
        return passed

    def _look_again(  # type: ignore[no-untyped-def]
        self, st: Study, spec, merged: str, label: str, node_id: int, values: list[float]
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
                    st,
                    spec,
                    st.trunk_commit,
                    f"{label}-trunk",
                    st.trunk_node_id,
                    seeds=range(len(trunk), target),
                )
                if more_t is None:
                    break
                trunk += more_t
                with db.session(self.settings.db_url) as s:
                    study = s.get(Study, st.id)
                    assert study is not None
                    if study.trunk_commit == st.trunk_commit and len(study.trunk_heldout) < len(trunk):
                        study.trunk_heldout = list(trunk)
                        root = s.get(Node, study.trunk_node_id)
                        if root is not None:
                            root.heldout_values = list(trunk)
                            s.add(root)
                        s.add(study)
            more = self._heldout(st, spec, merged, label, node_id, seeds=range(n, target))
            if more is None:
                return None, trunk
            values = values + more
        return values, trunk

    def await_approval(self, study_id: int, node_id: int) -> None:
        """Mark a gate-passed node as waiting for a human and open an approval."""
        with db.session(self.settings.db_url) as s:
            node = s.get(Node, node_id)
            assert node is not None
            if node.status == NodeStatus.EVALUATED:
                transition(s, node, NodeStatus.AWAITING_APPROVAL)
            if not s.exec(select(Approval).where(Approval.node_id == node_id)).first():
                s.add(Approval(study_id=study_id, node_id=node_id))

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
            repo.set_branch(study.trunk_branch, node.gate_commit)
            study.trunk_commit = node.gate_commit
            study.trunk_dev = list(node.dev_values)
            study.trunk_heldout = list(node.heldout_values)
            study.trunk_node_id = node_id
            node.commit = node.commit or node.gate_commit
            s.add(study)
            transition(s, node, NodeStatus.MERGED, by=by, trunk=node.gate_commit)
            appr = s.exec(select(Approval).where(Approval.node_id == node_id)).first()
            if appr and appr.status in ("pending", "approving"):
                appr.status, appr.decided_by, appr.decided_at = "approved", appr.decided_by or by, now()
                s.add(appr)

    def reject(self, study_id: int, node_id: int, reason: str, by: str) -> None:
        """Reject a gate-passed node on a human's word."""
        with db.session(self.settings.db_url) as s:
            node = s.get(Node, node_id)
            assert node is not None
            if node.status in (NodeStatus.AWAITING_APPROVAL, NodeStatus.EVALUATED):
                transition(s, node, NodeStatus.REJECTED, reason=reason, by=by)
            appr = s.exec(select(Approval).where(Approval.node_id == node_id)).first()
            if appr and appr.status in ("pending", "rejecting"):
                appr.status, appr.decided_at = "rejected", now()
                appr.decided_by, appr.reason = appr.decided_by or by, appr.reason or reason
                s.add(appr)

    def finalize(self, study_id: int, reason: str) -> None:
        """Close the study and write REPORT.md (trunk's held-out score is already measured)."""
        with db.session(self.settings.db_url) as s:
            for n in s.exec(
                select(Node).where(Node.study_id == study_id, Node.status == NodeStatus.PROPOSED)
            ):
                transition(s, n, NodeStatus.CANCELLED, reason="study finished")
            lifecycle.finish(s, study_id, reason)
        # A process killed between a job's last write and its cleanup can leave a worktree behind.
        workspace.remove_study_worktrees(self.settings, self._load(study_id))
        path = report.write(self.settings, study_id)
        with db.session(self.settings.db_url) as s:
            study = s.get(Study, study_id)
            assert study is not None
            study.report_path = str(path)
            s.add(study)
