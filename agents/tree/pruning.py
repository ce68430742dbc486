"""Pruning of exhausted subtrees; the pruned node keeps its lesson."""

from __future__ import annotations

from dataclasses import dataclass

from agents.tree.model import Tree, TreeNode
from agents.tree.status import COMPLETED, TERMINAL, NodeStatus

LESSON_PREFIX = "PRUNED ("  # how a pruned branch's top insight begins: `PRUNED (reason). Lesson: ...`


@dataclass(frozen=True)
class Prune:
    node_id: int
    reason: str
    lesson: str


def improved(gain_lcb: float | None, min_gain: float = 0.0) -> bool:
    """Return whether an experiment counts as an improvement over trunk."""
    return gain_lcb is not None and gain_lcb > min_gain


def exhausted(tree: Tree, window: int = 3, min_gain: float = 0.0) -> list[Prune]:
    """Return non-root directions whose last `window` completed children all failed to improve.

    Such a direction (and its still-proposed descendants) is pruned; its lesson is its
    current insight, which ideation reads as "do not repeat this mechanism".
    """
    out: list[Prune] = []
    completed: dict[int, list[TreeNode]] = {}  # parent -> its completed children, in one pass
    for c in tree.nodes.values():
        if c.parent_id is not None and c.status in COMPLETED and c.order > 0:
            completed.setdefault(c.parent_id, []).append(c)
    for node_id in sorted(p for p, kids in completed.items() if len(kids) >= window):
        node = tree.nodes[node_id]
        if node.parent_id is None or node.status in TERMINAL:
            continue
        if node.status == NodeStatus.AWAITING_APPROVAL:
            continue
        done = sorted(completed[node_id], key=lambda c: c.order)
        last = done[-window:]
        if any(improved(c.gain_lcb, min_gain) for c in last):
            continue
        ids = ", ".join(f"n{c.number}" for c in last)
        out.append(
            Prune(
                node.id,
                reason=f"exhausted: last {window} children ({ids}) did not improve on trunk",
                lesson=node.insight or node.summary,
            )
        )
    return out
