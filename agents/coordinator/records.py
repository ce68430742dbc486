"""A study's node records with the groups a coordinator step reads, kept up to date by what changed.

A step asks the same few questions of every record (which are proposed, failed, awaiting
approval, accepted, asked to be refined...). `RecordIndex` keeps the records grouped by those
answers, so a step reads a group, not the whole tree; storage that refreshes its records
incrementally hands out `Records`, a list that carries its index and what changed since the list
before it (for the tree view). Any other list gets an index built from it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from agents.coordinator.ports import NodeRecord
from agents.tree.status import NodeStatus, Origin

ORIGINS = ("refine", "revisit", "restart")  # whose `origin_ref` (or parent, for refine) a step asks about


class RecordIndex:
    """Records by id, by status, by AREX decision and by completion order, with origin counts.

    Failed records are grouped by their attempts as well, so the retry question reads the failures
    that may still be retried, not every failure of a long study.
    """

    def __init__(self, records: Iterable[NodeRecord] = ()) -> None:
        self.by_id: dict[int, NodeRecord] = {}
        self.by_status: dict[str, dict[int, NodeRecord]] = {}
        self.by_decision: dict[str, dict[int, NodeRecord]] = {}
        self.completed: dict[int, NodeRecord] = {}  # by completion order
        self.failed_by_attempts: dict[int, dict[int, NodeRecord]] = {}
        self.refs: dict[str, Counter[int]] = {o: Counter() for o in ORIGINS}
        for r in records:
            self.put(r)

    def put(self, record: NodeRecord) -> None:
        """Add a record, replacing the one of the same node."""
        old = self.by_id.get(record.evidence.id)
        if old is not None:
            self._drop(old)
        ev = record.evidence
        self.by_id[ev.id] = record
        self.by_status.setdefault(str(ev.status), {})[ev.id] = record
        decision = record.verification.get("decision")
        if decision:
            self.by_decision.setdefault(str(decision), {})[ev.id] = record
        if record.completed_order:
            self.completed[record.completed_order] = record
        if ev.status == NodeStatus.FAILED:
            self.failed_by_attempts.setdefault(record.attempts, {})[ev.id] = record
        ref = _ref(record)
        if ref is not None:
            self.refs[ev.origin][ref] += 1

    def _drop(self, record: NodeRecord) -> None:
        ev = record.evidence
        self.by_status[str(ev.status)].pop(ev.id, None)
        decision = record.verification.get("decision")
        if decision:
            self.by_decision[str(decision)].pop(ev.id, None)
        if record.completed_order and self.completed.get(record.completed_order) is record:
            del self.completed[record.completed_order]
        if ev.status == NodeStatus.FAILED:
            self.failed_by_attempts[record.attempts].pop(ev.id, None)
        ref = _ref(record)
        if ref is not None:
            self.refs[ev.origin][ref] -= 1
            if self.refs[ev.origin][ref] <= 0:
                del self.refs[ev.origin][ref]

    def copy(self) -> RecordIndex:
        """Return an index that later `put`s on this one do not change."""
        out = RecordIndex()
        out.by_id = dict(self.by_id)
        out.by_status = {k: dict(v) for k, v in self.by_status.items()}
        out.by_decision = {k: dict(v) for k, v in self.by_decision.items()}
        out.completed = dict(self.completed)
        out.failed_by_attempts = {k: dict(v) for k, v in self.failed_by_attempts.items()}
        out.refs = {k: Counter(v) for k, v in self.refs.items()}
        return out

    def status(self, *statuses: str) -> list[NodeRecord]:
        """Return the records in these statuses, in id order."""
        found: dict[int, NodeRecord] = {}
        for s in statuses:
            found.update(self.by_status.get(s, {}))
        return [found[i] for i in sorted(found)]

    def failed_below(self, attempts: int) -> list[NodeRecord]:
        """Return the failed records with fewer than `attempts` attempts, in id order."""
        found: dict[int, NodeRecord] = {}
        for n, group in self.failed_by_attempts.items():
            if n < attempts:
                found.update(group)
        return [found[i] for i in sorted(found)]

    def reach(self, node_id: int) -> int:
        """Return how many steps a node sits below its nearest merged ancestor (0 for a merged node).

        `policy.max_depth` bounds this, not the depth: trunk's line grows with every merge.
        """
        steps, r = 0, self.by_id.get(node_id)
        while r is not None and r.evidence.status != NodeStatus.MERGED and r.evidence.parent_id is not None:
            steps, r = steps + 1, self.by_id.get(r.evidence.parent_id)
        return steps

    def reaches(self) -> dict[int, int]:
        """Return `reach` of every node, in one pass (a parent's id is below its children's)."""
        out: dict[int, int] = {}
        for nid in sorted(self.by_id):
            ev = self.by_id[nid].evidence
            parent = ev.parent_id
            if ev.status == NodeStatus.MERGED or parent is None:
                out[nid] = 0
            else:
                out[nid] = (out[parent] if parent in out else self.reach(parent)) + 1
        return out

    def decided(self, decision: str) -> list[NodeRecord]:
        """Return the records whose AREX decision is `decision`, in id order."""
        group = self.by_decision.get(decision, {})
        return [group[i] for i in sorted(group)]

    def in_completion_order(self) -> list[NodeRecord]:
        """Return the integrated records, first integrated first."""
        return [self.completed[k] for k in sorted(self.completed)]


def _ref(record: NodeRecord) -> int | None:
    """Return the node a refine, revisit or restart child answers (a refine child's parent)."""
    ev = record.evidence
    if ev.origin == Origin.REFINE:
        return ev.parent_id
    if ev.origin in ORIGINS:
        return ev.origin_ref
    return None


class Records(list[NodeRecord]):
    """A study's records in id order, with their groups and the records changed since `previous`."""

    groups: RecordIndex
    previous: Records | None
    changed: list[NodeRecord]
    tree: Any  # the tree view, once built (`evidence.tree_of`)

    def __init__(
        self,
        records: Iterable[NodeRecord],
        groups: RecordIndex,
        previous: Records | None = None,
        changed: Iterable[NodeRecord] = (),
    ) -> None:
        super().__init__(records)
        self.groups, self.changed, self.tree = groups, list(changed), None
        # Keep the chain two lists long: a list whose view is not built hands on its changes.
        if previous is not None and previous.tree is None:
            self.changed = [*previous.changed, *self.changed]
            previous = previous.previous
        self.previous = previous


def index_of(records: list[NodeRecord]) -> RecordIndex:
    """Return the records' index (carried by `Records`, built for any other list)."""
    if isinstance(records, Records):
        return records.groups
    return RecordIndex(records)
