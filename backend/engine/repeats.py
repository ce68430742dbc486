"""Adaptive dev repeats inside an experiment job (`agents/tree/sequential.py` holds the rule).

An unclear node is re-run on more seeds, and so is trunk where it has fewer paired seeds than
the node needs; trunk's extra values are kept on the study, so the next node pairs with them
for free. Every extra run is a receipt (the node's own, or trunk's) and is charged to the
experiment budget through the job's outcome. A study's first round may run beside trunk's dev
job: its first look then waits for trunk's values while that job runs. Where trunk's dev runs
agreed exactly on every seed (`Study.dev_deterministic`), a node runs one seed; one that beats
trunk runs a second as a check, and where the two differ the study is taken as noisy from then on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from agents.spec import Judge, Spec
from agents.tree.sequential import Plan, Step, worth_racing
from agents.tree.stats import same_every_seed
from agents.tree.status import StudyStatus
from agents.verify.constraints import ConstraintRule, Verdict, verify_all
from backend.core.config import Settings
from backend.core.gitops import Repo
from backend.core.models import Job, Node, Study
from backend.engine import evaluation, runs, workspace
from backend.engine.jobstore import JobStore


@dataclass
class DevRuns:
    receipts: list[evaluation.Receipt]
    extra_runs: int = 0  # runs beyond `repeats`, the node's and trunk's together


def dev_runs(
    settings: Settings, store: JobStore, repo: Repo, study: Study, spec: Spec, node: Node, job: Job, *,
    worktree_label: str, commit: str,
) -> DevRuns:  # fmt: skip
    """Run the node's dev evaluation, then more paired seeds while its gain over trunk is unclear."""
    path = workspace.worktree_path(settings, study, worktree_label)

    def evaluate(seeds: range | None) -> list[evaluation.Receipt]:
        return runs.run_repeats(
            settings, store, repo, study, spec, kind="dev", worktree=path, commit=commit,
            label=worktree_label, node_id=node.id, seeds=seeds,
        )  # fmt: skip

    sign = 1.0 if spec.maximize else -1.0
    metric = spec.objective.metric
    if study.dev_deterministic:
        run = DevRuns(evaluate(range(1)))  # every seed gives the same values: one run is the measurement
        if not _worth_a_check(store, spec, node, run.receipts):
            return run
        # A change may make the evaluation depend on the seed (dropout switched on, say): a
        # candidate is run on a second seed, and where the two differ the study is noisy after all.
        run.receipts += evaluate(range(1, 2))
        if not all(r.ok for r in run.receipts) or same_every_seed(
            [r.metrics or {} for r in run.receipts], spec.judged_metrics()
        ):
            return run
        store.not_deterministic()
    else:
        run = DevRuns(evaluate(None))
    plan = Plan(spec.evaluate.repeats, spec.evaluate.most_repeats)
    gate = Plan(spec.gate.test_repeats, 3 * spec.gate.test_repeats)
    while all(r.ok for r in run.receipts):
        values = [r.objective(metric) or 0.0 for r in run.receipts]
        n = len(values)
        now = store.study()
        if not now.baseline_dev:
            now = _await_baseline(store, now, spec)
        trunk = list(now.trunk_dev) if now.trunk_commit == node.base_commit else None
        if trunk is None or len(trunk) < n:
            # Trunk moved (this node cannot be a gate candidate), or its dev values are not in:
            # more seeds would not help, or could not be judged.
            break
        if _violates(spec, run.receipts):
            break  # not admissible whatever its gain: AREX refines it instead
        # Improving means beating trunk by plateau.min_gain, as integration judges it.
        diffs = [sign * (v - t) - spec.plateau.min_gain for v, t in zip(values, trunk, strict=False)]
        if plan.step(diffs) != Step.MORE:
            break
        at_gate = [d + spec.plateau.min_gain - spec.gate.margin for d in diffs]  # the gate's own bar
        if not (worth_racing(diffs, plan) and worth_racing(at_gate, gate)):
            # Racing: more seeds go to gains that could pass, here and at the sealed gate.
            store.event("node.not_repeated", node.id, {"seeds": n, "reason": "gain too small to confirm"})
            break
        target = plan.next_n(n)
        if store.not_worth_it(sum(values) / n, run.extra_runs, target - n):
            break
        if len(trunk) < target:
            # A sibling running the same seeds takes about as long as this node's own runs did.
            patience = 3 * max(r.duration for r in run.receipts) * (target - len(trunk)) + PATIENCE
            ran, added = _extend_trunk(
                settings, store, repo, study, spec, node, job, len(trunk), target, patience
            )
            run.extra_runs += ran
            if added < target - len(trunk):
                break  # trunk's own run failed on a new seed: judge on what is paired
        more = evaluate(range(n, target))
        run.receipts += more
        run.extra_runs += len(more)
        store.event("node.repeated", node.id, {"seeds": target, "reason": f"gain unclear at {n} seeds"})
    return run


def _worth_a_check(store: JobStore, spec: Spec, node: Node, receipts: list[evaluation.Receipt]) -> bool:
    """Return whether a one-seed node of a deterministic study beats trunk within the constraints."""
    if not all(r.ok for r in receipts) or _violates(spec, receipts):
        return False
    now = store.study()
    if now.trunk_commit != node.base_commit or not now.trunk_dev:
        return False
    sign = 1.0 if spec.maximize else -1.0
    value = receipts[0].objective(spec.objective.metric) or 0.0
    return sign * (value - now.trunk_dev[0]) > spec.plateau.min_gain


POLL = 0.05  # seconds between looks for trunk's dev values
PATIENCE = 10.0  # seconds more a job waits for a sibling's run of trunk's seeds before running them


def _await_baseline(store: JobStore, now: Study, spec: Spec) -> Study:
    """Wait for trunk's dev values while the baseline's dev job runs beside this first round.

    Its job ends within its own runs' time (`timeout` per seed); a job not yet running (no free
    slot) is not waited for, nor is a study that stopped.
    """
    deadline = time.monotonic() + spec.evaluate.timeout * spec.evaluate.repeats
    while not now.baseline_dev and now.status == StudyStatus.RUNNING and time.monotonic() < deadline:
        if not store.baseline_running():
            return store.study()  # ended just now (read its values), or not running: judge without
        time.sleep(POLL)
        now = store.study()
    return now


def _violates(spec: Spec, receipts: list[evaluation.Receipt]) -> bool:
    rules = [
        ConstraintRule(c.name, c.metric, c.min, c.max) for c in spec.constraints if c.judge == Judge.METRIC
    ]
    results = verify_all(rules, [(i, r.metrics or {}) for i, r in enumerate(receipts)])
    return any(r.verdict == Verdict.VIOLATED for r in results)


def _extend_trunk(
    settings: Settings, store: JobStore, repo: Repo, study: Study, spec: Spec, node: Node, job: Job,
    have: int, want: int, patience: float,
) -> tuple[int, int]:  # fmt: skip
    """Run trunk's dev evaluation on seeds `have..want-1` and keep them on the study; return (runs, values).

    Siblings that need the same seeds at once run them once: the first to claim them runs them (and
    is charged); the others wait up to `patience` seconds for the values, then run what is missing.
    """
    first = have
    if not store.claim_trunk_seeds(node.base_commit, want):
        deadline = time.monotonic() + patience
        st = store.study()
        while (
            st.trunk_commit == node.base_commit and len(st.trunk_dev) < want and time.monotonic() < deadline
        ):
            time.sleep(POLL)
            st = store.study()
        if st.trunk_commit != node.base_commit:
            return 0, 0
        if len(st.trunk_dev) >= want:
            return 0, want - have  # a sibling ran them: kept on the study, charged to its job
        have = len(st.trunk_dev)  # its run failed or died: run what is still missing
    label = f"n{node.id}-a{job.attempt}-trunk"
    path = workspace.worktree_path(settings, study, label)
    branch = f"grove/{study.name}/{label}"
    st = store.study()
    if st.trunk_commit != node.base_commit:
        return 0, 0
    workspace.prepare(repo, path, branch, node.base_commit, sealed=spec.files.sealed, reason=f"job {job.id}")
    try:
        rs = runs.run_repeats(
            settings, store, repo, study, spec, kind="dev", worktree=path, commit=node.base_commit, label=label,
            node_id=st.trunk_node_id, seeds=range(have, want),
        )  # fmt: skip
    finally:
        repo.remove_worktree(path)
        repo.git("branch", "-D", branch, check=False)
    ok = [r.objective(spec.objective.metric) or 0.0 for r in rs if r.ok]
    store.keep_trunk_dev(node.base_commit, have, ok)
    return len(rs), have - first + len(ok)
