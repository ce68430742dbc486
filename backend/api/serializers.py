"""Turn database rows into API bodies."""

from __future__ import annotations

import statistics
from typing import Any

from sqlmodel import Session, col, func, or_, select

from backend.api import schemas
from backend.core.models import Approval, Event, Job, LlmCall, Node, Study
from backend.core.states import ApprovalStatus, JobKind, JobStatus
from backend.services.fates import Told
from backend.services.records import spec_of
from backend.services.storage import BudgetSpent


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def study_public(s: Session, st: Study) -> schemas.StudyPublic:
    """Return a study with its counters."""
    return study_publics(s, [st])[0]


def _grouped(s: Session, query: Any) -> dict[int, Any]:
    """Return a `select(study_id, ...).group_by(study_id)` query's rows by study id."""
    return {row[0]: row[1:] if len(row) > 2 else row[1] for row in s.exec(query)}


def study_publics(s: Session, studies: list[Study]) -> list[schemas.StudyPublic]:
    """Return studies with their counters, in a fixed number of queries however many they are."""
    ids = [st.id for st in studies]
    if not ids:
        return []
    of = col(Node.study_id).in_(ids)
    nodes = _grouped(s, select(Node.study_id, func.count()).where(of).group_by(col(Node.study_id)))
    jobs = _grouped(
        s,
        select(Job.study_id, func.count(col(Job.id)), func.coalesce(func.sum(Job.extra_runs), 0))
        .where(col(Job.study_id).in_(ids), Job.kind == JobKind.EXPERIMENT)
        .group_by(col(Job.study_id)),
    )  # what each budget is charged (`storage.budget_spent`)
    pending = _grouped(
        s,
        select(Approval.study_id, func.count())
        .where(col(Approval.study_id).in_(ids), Approval.status == ApprovalStatus.PENDING)
        .group_by(col(Approval.study_id)),
    )
    running = _grouped(
        s,
        select(Job.study_id, func.count())
        .where(col(Job.study_id).in_(ids), Job.status == JobStatus.RUNNING)
        .group_by(col(Job.study_id)),
    )
    # The best of trunk's root and the nodes whose every constraint held (AREX accepted or rejected
    # them on their gain); one that broke a constraint is no candidate, however good its dev.
    admissible = or_(
        col(Node.parent_id).is_(None),
        col(Node.verification)["decision"].as_string().in_(["accept", "reject"]),
    )
    best = _grouped(
        s,
        select(Node.study_id, func.max(Node.dev_mean), func.min(Node.dev_mean))
        .where(of, admissible)
        .group_by(col(Node.study_id)),
    )
    llm = _grouped(
        s,
        select(
            LlmCall.study_id,
            func.count(col(LlmCall.id)),
            func.coalesce(func.sum(LlmCall.tokens_in + LlmCall.tokens_out), 0),
            func.coalesce(func.sum(LlmCall.usd), 0.0),
        )
        .where(col(LlmCall.study_id).in_(ids))
        .group_by(col(LlmCall.study_id)),
    )
    out = []
    for st in studies:
        sid = st.id or 0
        spec = spec_of(st)
        experiments, extra = jobs.get(sid, (0, 0))
        high, low = best.get(sid, (None, None))
        calls, tokens, usd = llm.get(sid, (0, 0, 0.0))
        out.append(
            schemas.StudyPublic(
                id=sid,
                name=st.name,
                goal=st.goal,
                status=st.status,
                stop_reason=st.stop_reason,
                stop_rule=st.stop_rule,
                source=st.source,
                policy=spec.policy_kind,
                reads_memory=spec.capabilities.reads_context,
                trunk_branch=st.trunk_branch,
                trunk_commit=st.trunk_commit,
                base_commit=st.base_commit,
                nodes=nodes.get(sid, 0),
                experiments_used=BudgetSpent(experiments, int(extra), spec.evaluate.repeats).units,
                experiments_run=experiments,
                extra_dev_runs=int(extra),
                experiments_budget=spec.budget.experiments,
                pending_approvals=pending.get(sid, 0),
                best_dev=high if spec.maximize else low,
                baseline_dev=_mean(st.baseline_dev),
                trunk_dev=_mean(st.trunk_dev),
                baseline_heldout=_mean(st.baseline_heldout),
                trunk_heldout=_mean(st.trunk_heldout),
                test_queries=st.test_queries,
                llm_calls=calls,
                llm_tokens=int(tokens),
                llm_usd=float(usd),
                budget_usd=spec.budget.usd,
                budget_hours=spec.budget.hours,
                parallel=spec.budget.parallel,
                running_jobs=running.get(sid, 0),
                gate_mode=spec.gate.mode,
                margin=spec.gate.margin,
                metric=spec.objective.metric,
                direction=spec.objective.direction,
                improvement_state=st.improvement_state,
                created_at=st.created_at,
                started_at=st.started_at,
                finished_at=st.finished_at,
            )
        )
    return out


def node_summary(n: Node, told: Told) -> schemas.NodeSummary:
    """Return the tree view of a node."""
    return schemas.NodeSummary(
        id=n.id or 0,
        number=n.number,
        parent_id=n.parent_id,
        depth=n.depth,
        status=n.status,
        title=n.title,
        origin=n.origin,
        dev_mean=n.dev_mean,
        dev_n=n.dev_n,
        gain=n.gain,
        gain_lcb=n.gain_lcb,
        heldout_gain=n.heldout_gain,
        attempts=n.attempts,
        fate=told.fate,
        rejection=told.rejection,
        candidate=told.candidate,
    )


def event_public(e: Event) -> schemas.EventPublic:
    """Return an event body."""
    return schemas.EventPublic(
        id=e.id or 0, study_id=e.study_id, node_id=e.node_id, type=e.type, payload=e.payload, time=e.time
    )


def approval_public(s: Session, a: Approval) -> schemas.ApprovalPublic:
    """Return an approval card: the candidate's evidence and gate outcome."""
    node = s.get(Node, a.node_id)
    study = s.get(Study, a.study_id)
    assert node is not None and study is not None
    return schemas.ApprovalPublic(
        id=a.id or 0,
        study_id=a.study_id,
        node_id=a.node_id,
        node_number=node.number,
        status=a.status,
        decided_by=a.decided_by,
        reason=a.reason,
        created_at=a.created_at,
        decided_at=a.decided_at,
        title=node.title,
        dev_gain=node.gain,
        dev_gain_lcb=node.gain_lcb,
        dev_n=node.dev_n,
        heldout_gain=node.heldout_gain,
        margin=spec_of(study).gate.margin,
        constraints=node.constraints,
    )


def events_after(
    s: Session, study_id: int, after: int, limit: int = 500, newest: bool = False
) -> list[Event]:
    """Return a study's events with id > after, oldest first (with `newest`, the last `limit` of them)."""
    order = col(Event.id).desc() if newest else col(Event.id)
    q = select(Event).where(Event.study_id == study_id, col(Event.id) > after).order_by(order).limit(limit)
    rows = list(s.exec(q))
    return rows[::-1] if newest else rows


def progress(s: Session, st: Study) -> schemas.Progress:
    """Return each evaluated node once, in order, with trunk's scores after it (from the event log).

    A node is `node.evaluated` twice (its job finished, then the coordinator judged it): the first
    event places it, so the points are one per evaluated experiment.
    """
    nodes = {n.id: n for n in s.exec(select(Node).where(Node.study_id == st.id))}
    placed: set[int] = set()
    trunk_dev, trunk_heldout = _mean(st.baseline_dev), _mean(st.baseline_heldout)
    points: list[schemas.ProgressPoint] = []
    rows = s.exec(
        select(Event)
        .where(Event.study_id == st.id, col(Event.type).in_(["node.evaluated", "node.merged"]))
        .order_by(col(Event.id))
    )
    for e in rows:
        n = nodes.get(e.node_id)
        if n is None or n.parent_id is None:
            continue
        if e.type == "node.merged":
            trunk_dev, trunk_heldout = n.dev_mean, _mean(n.heldout_values)
            if points:
                points[-1].trunk_dev, points[-1].trunk_heldout = trunk_dev, trunk_heldout
            continue
        if n.id in placed:
            continue
        placed.add(n.id or 0)
        points.append(
            schemas.ProgressPoint(
                experiment=len(points) + 1,
                node_id=n.id or 0,
                node_number=n.number,
                status=n.status,
                dev=n.dev_mean,
                trunk_dev=trunk_dev,
                trunk_heldout=trunk_heldout,
            )
        )
    return schemas.Progress(
        baseline_dev=_mean(st.baseline_dev), baseline_heldout=_mean(st.baseline_heldout), points=points
    )


def search_space(s: Session, st: Study) -> schemas.SearchSpace:
    """Return each measured node's full configuration over the `[search]` keys with its dev score.

    A node's edits change its parent's configuration: the values are the study's base values with
    the edits of every node on the way down applied in order.
    """
    spec = spec_of(st)
    keys = list(spec.search)
    nodes = {n.id: n for n in s.exec(select(Node).where(Node.study_id == st.id))}
    config: dict[int, dict[str, Any]] = {}

    def of(node_id: int) -> dict[str, Any]:
        path = []
        cur: int | None = node_id
        while cur is not None and cur not in config and cur in nodes:
            path.append(cur)
            cur = nodes[cur].parent_id
        values = (
            dict(config[cur])
            if cur is not None and cur in config
            else {k: st.base_values.get(k) for k in keys}
        )
        for nid in reversed(path):
            values = {**values, **{k: v for k, v in nodes[nid].edits.items() if k in keys}}
            config[nid] = values
        return config[node_id]

    points = [
        schemas.SearchPoint(
            node_id=n.id or 0, node_number=n.number, status=n.status, dev=n.dev_mean, values=of(n.id or 0)
        )
        for n in sorted(nodes.values(), key=lambda n: n.id or 0)
        if n.dev_mean is not None and n.id is not None
    ]
    return schemas.SearchSpace(keys=keys, metric=spec.objective.metric, points=points)


IMPORTANCE_POINTS = 2000


def importances(s: Session, st: Study) -> schemas.Importances:
    """Return how much each `[search]` key tells the best measured nodes apart (PED-ANOVA)."""
    from agents.policies import optuna_bridge  # optuna loads only when asked
    from agents.policies.space import Space

    space, spec = search_space(s, st), spec_of(st)
    dims = {k: d.model_dump() for k, d in spec.search.items()}
    measured = [(p.values, p.dev) for p in space.points]
    if len(measured) > IMPORTANCE_POINTS:  # an even sample of a long history
        step = len(measured) / IMPORTANCE_POINTS
        measured = [measured[int(i * step)] for i in range(IMPORTANCE_POINTS)]
    found = (
        optuna_bridge.importances(Space(dims, dict(st.base_values)), measured, spec.maximize) if dims else {}
    )
    keys = [schemas.Importance(key=k, importance=v) for k, v in sorted(found.items(), key=lambda kv: -kv[1])]
    return schemas.Importances(
        metric=space.metric, method="PED-ANOVA (Optuna), top 10%", measured=len(measured), keys=keys
    )
