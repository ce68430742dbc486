"""The coordinator's records of a study's nodes, read from the database and kept between steps."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlmodel import Session, col, func, or_, select

from agents.coordinator.ports import NodeRecord
from agents.coordinator.records import RecordIndex, Records
from agents.failures import Blame
from agents.policies.base import NodeEvidence
from agents.tree.status import NodeStatus, Origin
from backend.core.models import InsightVersion, Job, Node, ReceiptRow, Trajectory, now
from backend.core.states import JobKind, RunKind


def _mean_metrics(receipts: list[dict[str, Any]]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for metrics in receipts:
        for k, v in metrics.items():
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                sums.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in sums.items()}


def node_records(s: Session, study_id: int) -> list[NodeRecord]:
    """Build the coordinator's view of every node of a study, in five queries whatever its size."""
    rows = s.exec(select(Node).where(Node.study_id == study_id).order_by(col(Node.id))).all()
    newest = (
        select(InsightVersion.node_id, func.max(InsightVersion.version).label("version"))
        .where(InsightVersion.study_id == study_id)
        .group_by(col(InsightVersion.node_id))
        .subquery()
    )
    insight = dict(
        s.exec(
            select(InsightVersion.node_id, InsightVersion.text)
            .join(
                newest,
                (col(InsightVersion.node_id) == newest.c.node_id)
                & (col(InsightVersion.version) == newest.c.version),
            )
            .order_by(col(InsightVersion.id))  # of two rows with the newest version, the later
        ).all()
    )
    last_job: dict[int, int] = {}  # node -> the job of its latest attempt
    for job_id, node_id, _ in s.exec(
        select(Job.id, Job.node_id, Job.attempt)
        .where(Job.study_id == study_id, Job.kind == JobKind.EXPERIMENT)
        .order_by(col(Job.attempt))
    ):
        last_job[node_id] = job_id or 0
    receipts: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for rid, of_node, of_job, metrics in s.exec(
        select(ReceiptRow.id, ReceiptRow.node_id, ReceiptRow.job_id, ReceiptRow.metrics)
        .where(ReceiptRow.study_id == study_id, ReceiptRow.kind == RunKind.DEV, ReceiptRow.ok == True)  # noqa: E712
        .order_by(col(ReceiptRow.id))
    ):
        if of_node is not None and (of_node not in last_job or of_job in (last_job[of_node], None)):
            receipts.setdefault(of_node, []).append((rid or 0, dict(metrics or {})))
    reports = dict(
        s.exec(
            select(Trajectory.job_id, Trajectory.report).where(
                Trajectory.study_id == study_id, Trajectory.report != ""
            )
        ).all()
    )
    return [_record(n, insight, last_job, receipts, reports) for n in rows]


STALE_BY_ID = 500  # changed node rows a refresh reads by id; more are read by the look-back window


@dataclass
class Written:
    """Nodes whose rows a coordinator step wrote itself since its storage last read the records."""

    nodes: set[int] = field(default_factory=set)  # node rows (inserted or changed)
    insights: set[int] = field(default_factory=set)  # nodes given an insight version
    jobs: set[int] = field(default_factory=set)  # nodes given an experiment job


class RecordCache:
    """One study's node records kept between coordinator steps, refreshed from what changed since.

    Nodes are re-read when their `updated_at` moved, and so are nodes that got a new insight
    version, experiment job, dev receipt or report; every look goes back `MARGIN` before the last,
    so a row written by a slightly late clock or a slow transaction is still seen. A full reload
    happens every `FULL_EVERY` seconds regardless.
    """

    MARGIN = timedelta(seconds=120)
    FULL_EVERY = 600.0

    def __init__(self, margin: timedelta | None = None) -> None:
        self.margin = self.MARGIN if margin is None else margin
        self._reset()

    def _reset(self) -> None:
        self.since: datetime | None = None
        self.loaded_at = 0.0
        self.root: tuple[int, datetime] | None = None
        self.nodes: dict[int, Node] = {}
        self.insight: dict[int, tuple[int, int, str]] = {}  # node -> (version, row id, text)
        self.last_job: dict[int, tuple[int, int]] = {}  # node -> (attempt, job)
        self.receipts: dict[
            int, dict[int, tuple[int | None, dict[str, Any]]]
        ] = {}  # node -> rid -> (job, metrics)
        self.reports: dict[int, str] = {}  # job -> report
        self.records: dict[int, NodeRecord] = {}
        self.index = RecordIndex()
        self.changed: list[NodeRecord] = []  # records changed since the last list handed out
        self.listed: Records | None = None  # the last list handed out

    def refresh(self, s: Session, study_id: int) -> Records:
        """Return every node's record, re-reading only what changed since the last call.

        The list is shared between calls while nothing changes: callers must not modify it.
        """
        started = now()
        if self.since is None or time.monotonic() - self.loaded_at > self.FULL_EVERY:
            self._reset()
            self.loaded_at = time.monotonic()
        since = self.since - self.margin if self.since is not None else None

        def recent(query: Any, column: Any) -> Any:
            return query if since is None else query.where(column >= since)

        touched: set[int] = set()
        query = select(Node).where(Node.study_id == study_id)
        if since is None or self.root is None:
            rows = list(s.exec(query))
        else:
            # Stamps first: of the rows that moved within the look-back, only those whose stamp
            # differs from the one read are read again. The root comes every time (by its key):
            # gone or different, another study took the id.
            moved = (col(Node.updated_at) >= since) | (col(Node.id) == self.root[0])
            stamps = s.exec(
                select(Node.id, Node.updated_at, Node.created_at).where(Node.study_id == study_id, moved)
            ).all()
            if not any((i, c) == self.root for i, _, c in stamps):
                self.since = None
                return self.refresh(s, study_id)
            stale = [
                i
                for i, u, _ in stamps
                if i is not None and (i not in self.nodes or self.nodes[i].updated_at != u)
            ]
            if len(stale) > STALE_BY_ID:  # many: the look-back's rows whole, in one query
                rows = list(s.exec(query.where(moved)))
            else:
                rows = list(s.exec(select(Node).where(col(Node.id).in_(stale)))) if stale else []
        for n in rows:
            assert n.id is not None
            if n.parent_id is None:
                self.root = (n.id, n.created_at)
            s.expunge(n)
            self.nodes[n.id] = n
            touched.add(n.id)
        for vid, nid, version, text in s.exec(
            recent(
                select(
                    InsightVersion.id, InsightVersion.node_id, InsightVersion.version, InsightVersion.text
                ).where(InsightVersion.study_id == study_id),
                InsightVersion.created_at,
            )
        ):
            # The newest version; of two rows with the same one, the later row (as a full read takes it).
            if (version, vid or 0) > self.insight.get(nid, (0, 0, ""))[:2]:
                self.insight[nid] = (version, vid or 0, text)
                touched.add(nid)
        for jid, nid, attempt in s.exec(
            recent(
                select(Job.id, Job.node_id, Job.attempt).where(
                    Job.study_id == study_id, Job.kind == JobKind.EXPERIMENT
                ),
                Job.created_at,
            )
        ):
            if attempt >= self.last_job.get(nid, (-1, 0))[0] and self.last_job.get(nid) != (
                attempt,
                jid or 0,
            ):
                self.last_job[nid] = (attempt, jid or 0)
                touched.add(nid)
        for rid, nid, jid, metrics in s.exec(
            recent(
                select(ReceiptRow.id, ReceiptRow.node_id, ReceiptRow.job_id, ReceiptRow.metrics).where(
                    ReceiptRow.study_id == study_id,
                    ReceiptRow.kind == RunKind.DEV,
                    ReceiptRow.ok == True,  # noqa: E712
                ),
                ReceiptRow.created_at,
            )
        ):
            if nid is not None and rid not in self.receipts.setdefault(nid, {}):
                self.receipts[nid][rid or 0] = (jid, dict(metrics or {}))
                touched.add(nid)
        for jid, nid, report in s.exec(
            recent(
                select(Trajectory.job_id, Trajectory.node_id, Trajectory.report).where(
                    Trajectory.study_id == study_id, Trajectory.report != ""
                ),
                Trajectory.created_at,
            )
        ):
            if self.reports.get(jid) != report:
                self.reports[jid] = report
                touched.add(nid)
        self.since = started
        return self._rebuilt(touched)

    def reread(self, s: Session, study_id: int, own: Written) -> Records:
        """Return every node's record after reading again only what this process itself wrote.

        For the writes of a coordinator step between two refreshes: the rows it changed are read
        by key (a node, its newest insight, its experiment jobs), and nothing else is looked at.
        """
        touched = own.nodes | own.insights | own.jobs
        if own.nodes:
            for n in s.exec(select(Node).where(col(Node.id).in_(sorted(own.nodes)))):
                assert n.id is not None
                s.expunge(n)
                self.nodes[n.id] = n
        if own.insights:
            # From each node's known version on: a root's versions grow with the study.
            newer = [
                (col(InsightVersion.node_id) == nid)
                & (col(InsightVersion.version) >= self.insight.get(nid, (0,))[0])
                for nid in sorted(own.insights)
            ]
            for vid, nid, version, text in s.exec(
                select(
                    InsightVersion.id, InsightVersion.node_id, InsightVersion.version, InsightVersion.text
                ).where(or_(*newer))
            ):
                if (version, vid or 0) > self.insight.get(nid, (0, 0, ""))[:2]:
                    self.insight[nid] = (version, vid or 0, text)
        if own.jobs:
            for jid, nid, attempt in s.exec(
                select(Job.id, Job.node_id, Job.attempt).where(
                    col(Job.node_id).in_(sorted(own.jobs)), Job.kind == JobKind.EXPERIMENT
                )
            ):
                if attempt >= self.last_job.get(nid, (-1, 0))[0]:
                    self.last_job[nid] = (attempt, jid or 0)
        return self._rebuilt(touched)

    def _rebuilt(self, touched: set[int]) -> Records:
        """Rebuild the touched nodes' records; return the list (the same one when nothing changed)."""
        for nid in sorted(touched):  # new nodes have the highest ids: `records` stays in id order
            node = self.nodes.get(nid)
            if node is not None:
                record = self._build(node)
                # A row read again within the margin but unchanged keeps its record object, and a
                # refresh that changed nothing hands out the same list: the tree views, assignments
                # and fates memoised on them are reused, so a step costs what changed, not the tree.
                if self.records.get(nid) != record:
                    out_of_order = (
                        nid not in self.records and bool(self.records) and nid < next(reversed(self.records))
                    )
                    self.records[nid] = record
                    self.index.put(record)
                    self.changed.append(record)
                    # Node inserts of one study serialise on its row (`models._number_node`), so
                    # this holds only for rows written around the ORM: keep the id order anyway.
                    if out_of_order:
                        self.records = dict(sorted(self.records.items()))
        if self.listed is None or self.changed:
            self.listed = Records(self.records.values(), self.index.copy(), self.listed, self.changed)
            self.changed = []
        return self.listed

    def _build(self, node: Node) -> NodeRecord:
        assert node.id is not None
        last = self.last_job.get(node.id)
        job = last[1] if last else None
        mine = sorted(
            (rid, metrics)
            for rid, (of_job, metrics) in self.receipts.get(node.id, {}).items()
            if job is None or of_job in (job, None)
        )
        insight = {node.id: self.insight[node.id][2]} if node.id in self.insight else {}
        return _record(
            node, insight, {node.id: job} if job is not None else {}, {node.id: mine}, self.reports
        )


_CACHES: OrderedDict[tuple[str, int], RecordCache] = OrderedDict()


CACHED_STUDIES = 32  # a coordinator process keeps the records of this many studies, the latest used


def cache_of(url: str, study_id: int) -> RecordCache:
    """Return this process's record cache of a study, dropping the least recently used beyond the cap."""
    key = (url, study_id)
    cache = _CACHES.pop(key, None) or RecordCache()
    _CACHES[key] = cache
    while len(_CACHES) > CACHED_STUDIES:
        _CACHES.popitem(last=False)
    return cache


def _record(
    node: Node,
    insight: dict[int, str],
    last_job: dict[int, int],
    receipts: dict[int, list[tuple[int, dict[str, Any]]]],
    reports: dict[int, str],
) -> NodeRecord:
    assert node.id is not None
    mine = receipts.get(node.id, []) if node.dev_values else []
    # A node that passed the gate but was not yet moved on is still a candidate (replay).
    passed_unread = node.gate_passed and node.status == NodeStatus.EVALUATED
    job = last_job.get(node.id)
    evidence = NodeEvidence(
        id=node.id,
        parent_id=node.parent_id,
        depth=node.depth,
        status=NodeStatus(node.status),
        title=node.title,
        edits=dict(node.edits),
        origin=Origin(node.origin),
        dev_mean=node.dev_mean,
        dev_std=node.dev_std,
        dev_n=node.dev_n,
        gain=node.gain,
        gain_lcb=node.gain_lcb,
        dev_metrics=_mean_metrics([m for _, m in mine]),
        constraints=list(node.constraints),
        summary=node.summary,
        insight=insight.get(node.id, ""),
        failure=node.failure,
        blame=Blame(node.blame or Blame.IDEA),
        lesson=node.lesson,
        report=reports.get(job, "") if job is not None else "",
        origin_ref=node.origin_ref,
        number=node.number,
        mechanism=str(node.hypothesis.get("mechanism", ""))[:300],
    )
    return NodeRecord(
        evidence=evidence,
        round_no=node.round_no,
        prior=node.prior,
        base_commit=node.base_commit,
        dev_values=list(node.dev_values),
        dev_receipts=mine,
        attempts=node.attempts,
        completed_order=node.completed_order,
        verification=dict(node.verification),
        gated=node.gated and not passed_unread,
        passed_unread=passed_unread,
        trunk_commit=(node.commit if node.parent_id is None else node.gate_commit)
        if node.status == NodeStatus.MERGED
        else "",
    )
