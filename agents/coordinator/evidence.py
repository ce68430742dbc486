"""What the coordinator's steps read from the records: the tree view, one node's integration (AREX's call), candidates, retries, and what ideation is told."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from agents.coordinator.configuration import CoordinatorConfig
from agents.coordinator.ports import Integration, NodeRecord, Storage, StudyView
from agents.coordinator.records import RecordIndex, Records, index_of
from agents.failures import Blame
from agents.policies import widen
from agents.policies.base import IdeationInput, Judgement, NodeEvidence, Policy, RefineRequest
from agents.spec import Judge
from agents.tree import plateau
from agents.tree.gate import eligible
from agents.tree.model import Tree, TreeNode
from agents.tree.sequential import Plan
from agents.tree.stats import gain_over, summarize
from agents.tree.status import NodeStatus, Origin
from agents.verify.arex import Assessment, Decision, assess
from agents.verify.constraints import ConstraintResult, ConstraintRule, Verdict, all_satisfied, verify_all
from agents.verify.state import ImprovementState

# Storage hands back the same record object while a node is unchanged, and the same list while
# nothing changed: each study's last view is kept with its records (by object identity), and a new
# view re-makes only the tree nodes of records it has not seen. Views are found by the root's id and
# then by records they share, so studies whose roots have the same id (in different databases) do
# not evict each other's view.
_Views = list[tuple[list[NodeRecord], dict[int, NodeRecord], Tree]]


_LAST_TREE: dict[int, _Views] = {}  # by the root's node id


def tree_of(records: list[NodeRecord]) -> Tree:
    """Build the pure tree view from node records (the same records give the same view back)."""
    if isinstance(records, Records):  # updated from the last list's view by what changed since
        if records.tree is None:
            before = records.previous
            if before is not None and before.tree is not None:
                records.tree = before.tree.updated(map(_tree_node, records.changed))
            else:
                records.tree = Tree.of(map(_tree_node, records))
            records.previous, records.changed = None, []
        return records.tree  # type: ignore[no-any-return]
    key = records[0].evidence.id if records else 0
    views = _LAST_TREE.setdefault(key, [])
    last = next((v for v in views if v[0] is records), None)
    if last is not None:
        return last[2]
    last = next((v for v in views if any(v[1].get(id(r)) is r for r in records[:16])), None)
    by_object = {id(r): r for r in records}
    tree: Tree | None = None
    if last is not None:
        fresh = [by_object[k] for k in by_object.keys() - last[1].keys()]
        replaced = {last[1][k].evidence.id for k in last[1].keys() - by_object.keys()}
        if replaced <= {r.evidence.id for r in fresh}:  # no node left the tree: update the last view
            tree = last[2].updated(map(_tree_node, fresh))
        views.remove(last)
    if tree is None:
        tree = Tree.of(map(_tree_node, records))
    if sum(len(v) for v in _LAST_TREE.values()) > 64:
        _LAST_TREE.clear()
        views = _LAST_TREE.setdefault(key, [])
    views.insert(0, (records, by_object, tree))
    del views[4:]
    return tree


def _tree_node(r: NodeRecord) -> TreeNode:
    return TreeNode(
        id=r.evidence.id,
        parent_id=r.evidence.parent_id,
        depth=r.evidence.depth,
        status=NodeStatus(r.evidence.status),
        prior=r.prior,
        gain=r.evidence.gain,
        gain_lcb=r.evidence.gain_lcb,
        summary=r.evidence.summary,
        insight=r.evidence.insight,
        order=r.completed_order,
        origin=r.evidence.origin,
        number=r.evidence.number,
    )


def _rules(study: StudyView) -> list[ConstraintRule]:
    return [
        ConstraintRule(c.name, c.metric, c.min, c.max)
        for c in study.spec.constraints
        if c.judge == Judge.METRIC
    ]


def soft_results(study: StudyView, judgement: Judgement) -> list[ConstraintResult]:
    """Turn the verifier's confidences into verdicts: satisfied only at or above each threshold."""
    out = []
    for c in study.spec.constraints:
        if c.judge != Judge.LLM:
            continue
        if c.name not in judgement.verdicts:
            out.append(
                ConstraintResult(c.name, Verdict.UNKNOWN, None, None, "the verifier gave no judgement")
            )
            continue
        confidence, reason = judgement.verdicts[c.name]
        verdict = Verdict.SATISFIED if confidence >= c.threshold else Verdict.VIOLATED
        detail = f"confidence {confidence}/100 (needs {c.threshold}): {reason}"[:500]
        out.append(ConstraintResult(c.name, verdict, float(confidence), None, detail))
    return out


def integrate_one(
    study: StudyView,
    rec: NodeRecord,
    policy: Policy,
    istate: ImprovementState,
    records: dict[int, NodeRecord],
    config: CoordinatorConfig = CoordinatorConfig(),
) -> Integration:
    """Verify one finished node, decide AREX's call, and update the improvement state."""
    ev = rec.evidence
    spec = study.spec
    if ev.status in (NodeStatus.FAILED, NodeStatus.REJECTED, NodeStatus.CANCELLED) or not rec.dev_values:
        recoverable = ev.status == NodeStatus.FAILED and rec.attempts < attempts_of(rec, config)
        untested = ev.status == NodeStatus.FAILED and ev.blame != Blame.IDEA
        a = assess(succeeded=False, recoverable=recoverable, improves=False, results=[], mechanism=ev.title,
                   no_evidence=untested)  # fmt: skip
        if not untested:
            istate.reject(ev.id, ev.failure or a.reason)
        elif not recoverable:
            istate.concern(
                f"n{ev.number} untested: its attempts failed for format or infrastructure reasons "
                f"({ev.failure[:120]}), no evidence against the idea"
            )
        if a.decision == Decision.RESTART:
            istate.concern(
                f"restart: n{ev.number} abandoned ({ev.failure[:120]}); exploration re-opens from the root, "
                f"away from n{ev.number}'s branch"
            )
        _refine_outcome(ev, "failed: " + (ev.failure[:120] or "no result"), istate, records, resolved=False)
        status: NodeStatus = ev.status if ev.status != NodeStatus.EVALUATED else NodeStatus.FAILED
        summary = policy.summarise(_with(ev, status=status), spec.objective.metric, None)
        verification: dict[str, Any] = {"decision": str(a.decision), "reason": a.reason}
        return Integration(ev.id, status, None, None, [], verification, summary)
    # Paired by seed on the seeds both have, at the level of the look the node's seed count reached,
    # against the trunk the node was built on: a merge since then does not change what it did.
    plan = Plan(spec.evaluate.repeats, spec.evaluate.most_repeats)
    base = base_dev(study, rec, records)
    n = min(len(rec.dev_values), len(base))
    g = gain_over(
        rec.dev_values[:n],
        base[:n],
        maximize=spec.maximize,
        alpha=plan.alpha_at(len(rec.dev_values)),
    )
    measured = verify_all(_rules(study), rec.dev_receipts)
    soft = [c.model_dump() for c in spec.constraints if c.judge == Judge.LLM]
    improves = g.lcb > spec.plateau.min_gain
    first = assess(succeeded=True, recoverable=True, improves=improves, results=measured, mechanism=ev.title)
    judged = Judgement()
    if soft or first.decision == Decision.REFINE:
        judged = policy.verify(
            _with(ev, gain=g.mean, gain_lcb=g.lcb, constraints=[r.to_dict() for r in measured]), soft
        )
    results = measured + soft_results(study, judged)
    a = assess(succeeded=True, recoverable=True, improves=improves, results=results, mechanism=ev.title)
    if a.decision == Decision.REFINE and judged.call == "restart":
        a = Assessment(Decision.RESTART, f"verifier: {judged.why or 'unrecoverable'}", a.open_constraints)
        istate.concern(
            f"restart: n{ev.number} abandoned by the verifier ({judged.why[:160]}); exploration re-opens "
            f"from the root, away from n{ev.number}'s branch"
        )
    for r in results:
        istate.set_constraint(r.name, str(r.verdict), r.detail, ev.id)
    status = NodeStatus.EVALUATED
    if a.decision == Decision.ACCEPT:
        istate.add_finding(
            f"{ev.title}: {g.mean:+.4g} dev {spec.objective.metric} (LCB {g.lcb:+.4g}, n={g.n})", [ev.id]
        )
    elif a.decision in (Decision.REFINE, Decision.RESTART):
        status = NodeStatus.REJECTED
        istate.reject(ev.id, f"partially verified: {', '.join(a.open_constraints)} open; {a.decision}")
    elif not all_satisfied(results):
        status = NodeStatus.REJECTED
        istate.reject(ev.id, f"constraints open: {', '.join(a.open_constraints)}")
    cons = [r.to_dict() for r in results]
    verification = {
        "decision": str(a.decision),
        "reason": a.reason,
        "open_constraints": list(a.open_constraints),
        "refine_goal": a.refine_goal,
        "verifier": {"call": judged.call, "why": judged.why},
    }
    if (
        rec.base_commit != study.trunk_commit
    ):  # built on an older trunk: its gain there, and against trunk now
        m = min(len(rec.dev_values), len(study.trunk_dev))
        if m:
            now = gain_over(rec.dev_values[:m], study.trunk_dev[:m], maximize=spec.maximize)
            verification["trunk_gain"] = {"gain": now.mean, "trunk_node": study.trunk_node_id}
    if ev.origin == Origin.REFINE:
        outcome = {
            Decision.ACCEPT: "resolved: every constraint holds and the gain is kept",
            Decision.REFINE: f"still open: {', '.join(a.open_constraints)}",
            Decision.RESTART: "abandoned",
        }.get(a.decision, "gain lost: " + a.reason)
        verification["refine_outcome"] = outcome
        _refine_outcome(ev, outcome, istate, records, resolved=a.decision == Decision.ACCEPT)
    updated = _with(ev, status=status, gain=g.mean, gain_lcb=g.lcb, constraints=cons)
    summary = policy.summarise(updated, spec.objective.metric, records.get(ev.parent_id or -1, rec).evidence)
    return Integration(ev.id, status, g.mean, g.lcb, cons, verification, summary)


def base_dev(study: StudyView, rec: NodeRecord, records: dict[int, NodeRecord]) -> list[float]:
    """Return the dev values of the trunk a node was built on (trunk's own while it has not moved)."""
    if rec.base_commit and rec.base_commit != study.trunk_commit:
        made = next((r for r in records.values() if r.trunk_commit == rec.base_commit and r.dev_values), None)
        if made is not None:
            return made.dev_values
    return study.trunk_dev


def _refine_outcome(
    ev: NodeEvidence,
    outcome: str,
    istate: ImprovementState,
    records: dict[int, NodeRecord],
    *,
    resolved: bool,
) -> None:
    """Record what a refine child did to its source's open constraints in the improvement state."""
    if ev.origin != Origin.REFINE or ev.origin_ref is None:
        return
    source = records.get(ev.origin_ref)
    text = f"refine of n{source.evidence.number if source else '?'} by n{ev.number}: {outcome}"
    if resolved:
        istate.add_finding(text, [ev.origin_ref, ev.id])
    else:
        istate.concern(text)


def retries_of(records: list[NodeRecord], config: CoordinatorConfig) -> list[int]:
    """Return the ids of failed nodes that get another attempt, oldest first."""
    failed = index_of(records).failed_below(config.max_attempts + config.blameless_attempts)
    return [r.evidence.id for r in failed if retryable(r, config)]


def attempts_of(rec: NodeRecord, config: CoordinatorConfig) -> int:
    """Return the attempts a failed node may have: more while its failures are no evidence on its idea."""
    return config.max_attempts + (config.blameless_attempts if rec.evidence.blame != Blame.IDEA else 0)


def retryable(rec: NodeRecord, config: CoordinatorConfig) -> bool:
    """Return whether a failed, integrated node gets another clean attempt (Reflexion-style)."""
    ev = rec.evidence
    return (
        ev.status == NodeStatus.FAILED
        and rec.completed_order > 0
        and rec.attempts < attempts_of(rec, config)
        and ev.parent_id is not None
    )


def _with(ev: NodeEvidence, **changes: Any) -> NodeEvidence:
    return replace(ev, **changes)


def gate_candidates(study: StudyView, records: list[NodeRecord]) -> list[int]:
    """Return node ids that may query the sealed split now, best dev LCB first."""
    out: list[tuple[float, int]] = []
    for r in index_of(records).by_status.get(NodeStatus.EVALUATED, {}).values():
        ev = r.evidence
        if (
            r.gated
            or r.base_commit != study.trunk_commit
            or r.verification.get("decision") != Decision.ACCEPT
        ):
            continue  # gated already, built on an older trunk (never eligible), or not accepted
        e = eligible(
            dev_gain_lcb=ev.gain_lcb,
            constraints_hold=all(c.get("verdict") == Verdict.SATISFIED for c in ev.constraints),
            on_current_trunk=r.base_commit == study.trunk_commit,
            # The baseline is not a gate query, nor is a passed gate's own query still to be acted on.
            queries_used=max(study.test_queries - 1 - int(r.passed_unread), 0),
            max_queries=study.spec.gate.max_test_runs,
        )
        if e.ok and ev.gain_lcb is not None:
            out.append((ev.gain_lcb, ev.id))
    return [nid for _, nid in sorted(out, key=lambda t: (-t[0], t[1]))]


def next_plan(records: list[NodeRecord], level: plateau.PlateauLevel) -> list[str]:
    """Return the next-step plan derived from the tree."""
    plan = []
    index = index_of(records)
    refined = index.refs["refine"]
    refine = [r for r in index.decided("refine") if r.evidence.id not in refined]
    for r in refine[-3:]:
        plan.append(f"refine n{r.evidence.number}: {r.verification.get('refine_goal', '')}")
    if level >= plateau.PlateauLevel.CHANGE:
        plan.append("change approach: explore directions far from the current best")
    elif level >= plateau.PlateauLevel.WARN:
        plan.append("progress is slowing: combine the best moves or leap further")
    else:
        plan.append("exploit around the best nodes; keep one exploratory direction")
    return plan


def ideation_input(study: StudyView, records: list[NodeRecord], *, k: int, round_no: int) -> IdeationInput:
    """Build ideation's input from dev-side evidence only (never a held-out number)."""
    nodes = [r.evidence for r in records]
    index = index_of(records)
    max_depth = study.spec.policy.max_depth
    refine = [
        RefineRequest(
            r.evidence.id,
            tuple(r.verification.get("open_constraints", [])),
            r.verification.get("refine_goal", ""),
        )
        for r in index.decided("refine")
        if r.evidence.id not in index.refs["refine"]
        and index.reach(r.evidence.id) < max_depth  # a refine chain ends at the depth limit
    ]
    sign = 1.0 if study.spec.maximize else -1.0
    trunk_mean = trunk_dev_mean(study)
    # A change that improved the trunk it was built on is tried once more on the current trunk (only
    # nodes on it may query the gate). The `search` policy writes a whole assignment, so its change on
    # the new trunk is itself: worth it only where it beats trunk. Other policies merge it onto trunk.
    whole = study.spec.capabilities.whole_assignments
    held = set() if whole else in_trunk(index)
    stale = [
        r for r in index.decided("accept")
        if r.evidence.status == NodeStatus.EVALUATED
        and r.base_commit != study.trunk_commit and r.evidence.id not in index.refs["revisit"]
        and (whole or r.evidence.id not in held)
        and (not whole or (r.evidence.dev_mean is not None and trunk_mean is not None
                           and sign * (r.evidence.dev_mean - trunk_mean) > 0))
    ]  # fmt: skip
    if whole:
        stale.sort(key=lambda r: -sign * (r.evidence.dev_mean or 0.0))
    else:
        stale.sort(key=lambda r: -(r.evidence.gain_lcb or 0.0))
    revisit = [r.evidence.id for r in stale]
    restart = [r.evidence.id for r in index.decided("restart") if r.evidence.id not in index.refs["restart"]]
    trunk = index.by_id.get(study.trunk_node_id)
    istate = study.improvement_state
    return IdeationInput(
        goal=study.spec.study.goal,
        metric=study.spec.objective.metric,
        maximize=study.spec.maximize,
        search_space=search_space(study, records),
        base_values=dict(study.base_values),
        trunk_node_id=study.trunk_node_id,
        trunk_dev_mean=trunk.evidence.dev_mean if trunk else None,
        nodes=nodes,
        improvement_state=dict(istate),
        pruned_lessons=pruned_lessons(index),
        validated_findings=[f["text"] for f in istate.get("verified_findings", [])],
        refine=refine,
        plateau_level=study.plateau_level,
        k=k,
        round_no=round_no,
        seed=study.seed,
        constraints=[c.model_dump() for c in study.spec.constraints],
        editable=list(study.spec.files.editable),
        restart=restart,
        max_depth=max_depth,
        reach=index.reaches(),
        revisit=revisit,
        budget=study.spec.budget.experiments,
        budget_left=max(study.spec.budget.experiments - study.experiments_used, 0),
        finish=study.spec.policy.finish,
    )


def search_space(study: StudyView, records: list[NodeRecord]) -> dict[str, dict[str, Any]]:
    """Return the `[search]` dimensions, widened where merged values sat on a bound (`policy.widen`)."""
    return _widened(study, records)[0] if study.spec.policy.widen else _dims(study)


def widenings(study: StudyView, records: list[NodeRecord]) -> list[widen.Widening]:
    """Return every bound the merged nodes moved out, in merge order (none unless `policy.widen`)."""
    return _widened(study, records)[1] if study.spec.policy.widen else []


def _widened(
    study: StudyView, records: list[NodeRecord]
) -> tuple[dict[str, dict[str, Any]], list[widen.Widening]]:
    # Each node's first look (`repeats` seeds): trunk's later seeds would change what an earlier
    # widening was decided on, and every ideation decides them all again.
    first = max(study.spec.evaluate.repeats, 1)
    history = [
        widen.Measured(r.evidence.id, r.completed_order, dict(r.evidence.edits), *_first_look(r.dev_values[:first]))
        for r in records  # the root (the unchanged repository) is known from the start: order 0
        if (r.completed_order or r.evidence.parent_id is None)
        and r.dev_values and r.evidence.status != NodeStatus.FAILED
    ]  # fmt: skip
    return widen.widen(
        _dims(study), _merged(records), history, base=dict(study.base_values), maximize=study.spec.maximize
    )


def _first_look(values: list[float]) -> tuple[float, float]:
    """Return the mean of some dev values and its standard error (0 for one value)."""
    s = summarize(values)
    return s.mean, s.std / math.sqrt(s.n)


def _dims(study: StudyView) -> dict[str, dict[str, Any]]:
    return {k: d.model_dump() for k, d in study.spec.search.items()}


def _merged(records: list[NodeRecord]) -> list[tuple[int, int, dict[str, Any]]]:
    done = [r.evidence for r in records if r.evidence.status == NodeStatus.MERGED and r.evidence.parent_id]
    return [(ev.id, ev.number, dict(ev.edits)) for ev in sorted(done, key=lambda ev: ev.number)]


RECENT = 4  # finished nodes whose executor reports and diffs the ideator reads


def recent(storage: Storage, study_id: int, records: list[NodeRecord]) -> list[dict[str, Any]]:
    """Return the latest finished nodes' executor reports and diffs, newest first."""
    done = sorted((r for r in records if r.completed_order and r.evidence.parent_id is not None),
                  key=lambda r: -r.completed_order)  # fmt: skip
    return [
        {"id": r.evidence.id, "report": r.evidence.report, "diff": storage.change(study_id, r.evidence.id)}
        for r in done[:RECENT]
    ]


def in_trunk(index: RecordIndex) -> set[int]:
    """Return the nodes whose change trunk holds: the merged ones, their ancestors and what they revisited."""
    held: set[int] = set()
    todo = list(index.by_status.get(NodeStatus.MERGED, {}))
    while todo:
        nid = todo.pop()
        r = index.by_id.get(nid)
        if nid in held or r is None:
            continue
        held.add(nid)
        todo += [x for x in (r.evidence.parent_id, r.evidence.origin_ref if r.evidence.origin == Origin.REVISIT else None)
                 if x is not None]  # fmt: skip
    return held


PRUNED_LESSONS = 30  # the lessons of pruned branches an ideator reads at most


def pruned_lessons(index: RecordIndex) -> list[str]:
    """Return the lessons of the latest pruned branches (their tops carry one), then other pruned nodes'."""
    pruned = index.status(NodeStatus.PRUNED)
    chosen = [r for r in pruned if r.evidence.lesson][-PRUNED_LESSONS:]
    room = PRUNED_LESSONS - len(chosen)
    if room > 0:
        have = {r.evidence.id for r in chosen}
        chosen += [r for r in pruned if r.evidence.id not in have][-room:]
    return [
        f"n{r.evidence.number} {r.evidence.title}: {r.evidence.insight or r.evidence.summary}"
        for r in sorted(chosen, key=lambda r: r.evidence.id)
    ]


def trunk_dev_mean(study: StudyView) -> float | None:
    """Return the mean of trunk's dev values on the seeds every node has (the first `repeats`)."""
    values = study.trunk_dev[: study.spec.evaluate.repeats]
    return sum(values) / len(values) if values else None
