"""Adaptive dev repeats inside an experiment job (`agents/tree/sequential.py` holds the rule).

An unclear node is re-run on more seeds, and so is trunk where it has fewer paired seeds than
the node needs; trunk's extra values are kept on the study, so the next node pairs with them
for free. Every extra run is a receipt (the node's own, or trunk's) and is charged to the
experiment budget through the job's outcome.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlmodel import col, select

from agents.spec import Spec
from agents.tree.sequential import Plan, Step
from agents.tree.stats import summarize
from agents.verify.constraints import ConstraintRule, Verdict, verify_all
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Job, Node, Study
from backend.engine import evaluation, workspace
from backend.services.records import add_event
from backend.services.storage import experiments_used


@dataclass
class DevRuns:
    receipts: list[evaluation.Receipt]
    extra_runs: int = 0  # runs beyond `repeats`, the node's and trunk's together


def dev_runs(
    settings: Settings, study: Study, spec: Spec, node: Node, job: Job, *, worktree_label: str, commit: str
) -> DevRuns:
    """Run the node's dev evaluation, then more paired seeds while its gain over trunk is unclear."""
    path = workspace.worktree_path(settings, study, worktree_label)
    run = DevRuns(
        workspace.run_repeats(
            settings,
            study,
            spec,
            kind="dev",
            worktree=path,
            commit=commit,
            label=worktree_label,
            node_id=node.id,
            job_id=job.id,
        )
    )
    plan = Plan(spec.evaluate.repeats, spec.evaluate.most_repeats)
    sign = 1.0 if spec.maximize else -1.0
    metric = spec.objective.metric
    while all(r.ok for r in run.receipts):
        values = [r.objective(metric) or 0.0 for r in run.receipts]
        n = len(values)
        trunk = _trunk_values(settings, study.id or 0, node.base_commit)
        if trunk is None or len(trunk) < n:
            break  # trunk moved: this node cannot be a gate candidate, more seeds would not help
        if _violates(spec, run.receipts):
            break  # not admissible whatever its gain: AREX refines it instead
        # Improving means beating trunk by plateau.min_gain, as integration judges it.
        diffs = [sign * (v - t) - spec.plateau.min_gain for v, t in zip(values, trunk, strict=False)]
        if plan.step(diffs) != Step.MORE:
            break
        target = plan.next_n(n)
        if _not_worth_it(settings, study, spec, node, sum(values) / n, run.extra_runs, target - n):
            break
        if len(trunk) < target:
            ran, added = _extend_trunk(settings, study, spec, node, job, len(trunk), target)
            run.extra_runs += ran
            if added < target - len(trunk):
                break  # trunk's own run failed on a new seed: judge on what is paired
        more = workspace.run_repeats(
            settings, study, spec, kind="dev", worktree=path, commit=commit, label=worktree_label,
            node_id=node.id, job_id=job.id, seeds=range(n, target),
        )  # fmt: skip
        run.receipts += more
        run.extra_runs += len(more)
        with db.session(settings.db_url) as s:
            add_event(
                s, study.id or 0, "node.repeated", node.id, seeds=target, reason=f"gain unclear at {n} seeds"
            )
    return run


def _not_worth_it(
    settings: Settings, study: Study, spec: Spec, node: Node, mean: float, spent: int, more: int
) -> str:
    """Return why more seeds are not worth running for this node now, or ''."""
    sign = 1.0 if spec.maximize else -1.0
    with db.session(settings.db_url) as s:
        others = s.exec(
            select(Node).where(
                Node.study_id == study.id, Node.id != node.id, Node.base_commit == node.base_commit,
                col(Node.status).in_(["evaluated", "awaiting_approval"]),
            )
        ).all()  # fmt: skip
        better = [
            o for o in others
            if o.dev_mean is not None and sign * o.dev_mean > sign * mean
            and o.verification.get("decision") == "accept"
        ]  # fmt: skip
        if better:
            return f"n{better[0].id} is better on dev and already a candidate"
        # This job's own runs so far, and at most `more` of the node's and of trunk's for the next look.
        used = experiments_used(s, study.id or 0, spec.evaluate.repeats, pending_runs=spent + 2 * more)
    if used > spec.budget.experiments:
        return "the experiment budget would be overspent"
    return ""


def _violates(spec: Spec, receipts: list[evaluation.Receipt]) -> bool:
    rules = [ConstraintRule(c.name, c.metric, c.min, c.max) for c in spec.constraints if c.judge == "metric"]
    results = verify_all(rules, [(i, r.metrics or {}) for i, r in enumerate(receipts)])
    return any(r.verdict == Verdict.VIOLATED for r in results)


def _trunk_values(settings: Settings, study_id: int, base_commit: str) -> list[float] | None:
    with db.session(settings.db_url) as s:
        st = s.get(Study, study_id)
        assert st is not None
        return list(st.trunk_dev) if st.trunk_commit == base_commit else None


def _extend_trunk(
    settings: Settings, study: Study, spec: Spec, node: Node, job: Job, have: int, want: int
) -> tuple[int, int]:
    """Run trunk's dev evaluation on seeds `have..want-1` and keep them on the study; return (runs, values)."""
    label = f"n{node.id}-a{job.attempt}-trunk"
    path = workspace.worktree_path(settings, study, label)
    repo = workspace.repo_of(study)
    branch = f"grove/{study.name}/{label}"
    with db.session(settings.db_url) as s:
        st = s.get(Study, study.id)
        assert st is not None
        if st.trunk_commit != node.base_commit:
            return 0, 0
        trunk_node = st.trunk_node_id
    workspace.prepare(repo, path, branch, node.base_commit, sealed=spec.files.sealed, reason=f"job {job.id}")
    try:
        rs = workspace.run_repeats(
            settings, study, spec, kind="dev", worktree=path, commit=node.base_commit, label=label,
            node_id=trunk_node, seeds=range(have, want),
        )  # fmt: skip
    finally:
        repo.remove_worktree(path)
        repo.git("branch", "-D", branch, check=False)
    ok = [r.objective(spec.objective.metric) or 0.0 for r in rs if r.ok]
    with db.session(settings.db_url) as s:
        st = s.get(Study, study.id)
        assert st is not None
        # Another job may have extended trunk meanwhile: keep whatever of ours lies beyond its values.
        if st.trunk_commit == node.base_commit and have <= len(st.trunk_dev) < have + len(ok):
            st.trunk_dev = [*st.trunk_dev, *ok[len(st.trunk_dev) - have :]]
            root = s.get(Node, st.trunk_node_id)
            if root is not None and len(root.dev_values) < len(st.trunk_dev):
                root.dev_values = list(st.trunk_dev)
                summ = summarize(root.dev_values)
                root.dev_mean, root.dev_std, root.dev_n = summ.mean, summ.std, summ.n
                s.add(root)
            s.add(st)
            add_event(
                s, study.id or 0, "trunk.repeated", st.trunk_node_id, seeds=len(st.trunk_dev), by_node=node.id
            )
    return len(rs), len(ok)
