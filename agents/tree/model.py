"""A read-only view of the hypothesis tree that the pure tree algorithms work on."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from agents.tree.status import NodeStatus


@dataclass(frozen=True)
class TreeNode:
    id: int
    parent_id: int | None
    depth: int
    status: NodeStatus
    prior: float = 0.0
    gain: float | None = None
    gain_lcb: float | None = None
    summary: str = ""
    insight: str = ""
    order: int = 0  # completion order; 0 while not completed
    origin: str = "policy"  # "refine" children are served before new ideas
    number: int = 0  # the node's place in its study: what texts call it (`n{number}`)


@dataclass
class Tree:
    nodes: dict[int, TreeNode] = field(default_factory=dict)
    # parent -> children's ids in order; built on first use, shared by `updated` trees (never edited)
    _kids: dict[int | None, list[int]] | None = field(default=None, init=False, repr=False, compare=False)
    # status -> ids in it; built on first use, kept up to date by `updated` (copied, never edited)
    _status: dict[str, dict[int, None]] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, nodes: Iterable[TreeNode]) -> Tree:
        """Build a tree from its nodes."""
        return cls({n.id: n for n in nodes})

    def updated(self, changed: Iterable[TreeNode]) -> Tree:
        """Return this tree with some nodes replaced or added (the rest, and its index, are shared)."""
        nodes = dict(self.nodes)
        kids = None if self._kids is None else dict(self._kids)  # child lists shared until one changes
        status = None if self._status is None else {k: dict(v) for k, v in self._status.items()}
        for n in changed:
            old = nodes.get(n.id)
            nodes[n.id] = n
            if kids is not None and (old is None or old.parent_id != n.parent_id):
                siblings = kids.get(n.parent_id, [])
                if old is None and (not siblings or siblings[-1] < n.id):
                    kids[n.parent_id] = [*siblings, n.id]  # a new node, the newest child of its parent
                else:
                    kids = None  # the shape changed otherwise: index again on first use
            if status is not None:
                if old is not None:
                    status[old.status].pop(n.id, None)
                status.setdefault(n.status, {})[n.id] = None
        tree = Tree(nodes)
        tree._kids, tree._status = kids, status
        return tree

    def _statuses(self) -> dict[str, dict[int, None]]:
        if self._status is None:
            status: dict[str, dict[int, None]] = {}
            for n in self.nodes.values():
                status.setdefault(n.status, {})[n.id] = None
            self._status = status
        return self._status

    def with_status(self, *statuses: NodeStatus) -> list[TreeNode]:
        """Return the nodes in any of these statuses, ordered by id."""
        index = self._statuses()
        return [self.nodes[i] for i in sorted(i for s in statuses for i in index.get(s, ()))]

    def count(self, *statuses: NodeStatus) -> int:
        """Return how many nodes are in any of these statuses."""
        index = self._statuses()
        return sum(len(index.get(s, ())) for s in statuses)

    def children(self, node_id: int) -> list[TreeNode]:
        """Return a node's children ordered by id."""
        if self._kids is None:
            kids: dict[int | None, list[int]] = {}
            for nid in sorted(self.nodes):
                kids.setdefault(self.nodes[nid].parent_id, []).append(nid)
            self._kids = kids
        return [self.nodes[i] for i in self._kids.get(node_id, ())]

    def ancestors(self, node_id: int) -> list[TreeNode]:
        """Return the ancestors of a node, nearest first."""
        out: list[TreeNode] = []
        parent = self.nodes[node_id].parent_id
        while parent is not None:
            out.append(self.nodes[parent])
            parent = self.nodes[parent].parent_id
        return out

    def subtree(self, node_id: int) -> Iterator[TreeNode]:
        """Yield a node and all its descendants, depth first."""
        stack = [node_id]
        while stack:
            nid = stack.pop()
            yield self.nodes[nid]
            stack.extend(c.id for c in reversed(self.children(nid)))

    @property
    def root(self) -> TreeNode:
        """Return the root node."""
        return next(n for n in self.nodes.values() if n.parent_id is None)
