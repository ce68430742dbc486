"""Frontier selection: which proposed nodes run next.

Each proposed node ``v`` with parent ``p`` gets the score

    score(v) = prior(v) + value(p) + c * sqrt(ln(N + 1) / (1 + n(p)))

where ``prior`` is the policy's expected gain for ``v``, ``value(p)`` is the best lower
confidence bound of the gain over trunk found so far in the subtree of ``p`` (0 when none is
known, so unexplored directions are not punished), ``N`` is the number of completed
experiments in the whole tree and ``n(p)`` the number completed in the subtree of ``p``.
Nodes are taken in decreasing score, at most ``per_parent`` per parent in one round (the
diversity cap), counting siblings that are already queued or running. Refine children
(AREX's narrower questions about nodes that improve but break a constraint) come before
any new idea, whatever their score. Ties are broken by a
seeded random key, so a selection is reproducible from the tree and the seed alone.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from agents.tree.model import Tree
from agents.tree.status import ACTIVE, COMPLETED, NodeStatus


@dataclass(frozen=True)
class SelectionConfig:
    exploration: float = 0.02
    per_parent: int = 2
    seed: int = 0


def subtree_value(tree: Tree, node_id: int) -> float:
    """Return the best gain LCB found in a subtree, or 0 when nothing is measured there."""
    best = -math.inf
    for n in tree.subtree(node_id):
        if n.gain_lcb is not None and n.status in COMPLETED:
            best = max(best, n.gain_lcb)
    return 0.0 if best == -math.inf else best


def completed_in(tree: Tree, node_id: int) -> int:
    """Return the number of completed experiments in a subtree."""
    return sum(1 for n in tree.subtree(node_id) if n.status in COMPLETED and n.parent_id is not None)


def frontier_scores(tree: Tree, config: SelectionConfig) -> dict[int, float]:
    """Return the documented frontier score of every proposed node."""
    root = next((n for n in tree.nodes.values() if n.parent_id is None), None)
    total = tree.count(*COMPLETED) - int(root is not None and root.status in COMPLETED)
    scores: dict[int, float] = {}
    of_parent: dict[int, tuple[float, float]] = {}  # siblings share their parent's value and bonus
    for n in tree.with_status(NodeStatus.PROPOSED):
        if n.parent_id is None:
            continue
        p = n.parent_id
        if p not in of_parent:
            bonus = config.exploration * math.sqrt(math.log(total + 1) / (1 + completed_in(tree, p)))
            of_parent[p] = (subtree_value(tree, p), bonus)
        value, bonus = of_parent[p]
        scores[n.id] = n.prior + value + bonus
    return scores


def select(tree: Tree, slots: int, config: SelectionConfig, round_no: int = 0) -> list[int]:
    """Return up to `slots` proposed node ids to dispatch, best first."""
    if slots <= 0:
        return []
    scores = frontier_scores(tree, config)
    rng = random.Random(config.seed * 1_000_003 + round_no)
    tiebreak = {nid: rng.random() for nid in sorted(scores)}
    # AREX: a refine child (a narrower question about a node that already improves) goes first.
    first = ("refine", "revisit")  # narrower questions, and the best known change on the new trunk
    ranked = sorted(
        scores, key=lambda nid: (tree.nodes[nid].origin not in first, -scores[nid], tiebreak[nid])
    )
    busy: dict[int, int] = {}
    for n in tree.with_status(*ACTIVE):
        if n.parent_id is not None:
            busy[n.parent_id] = busy.get(n.parent_id, 0) + 1
    chosen: list[int] = []
    for nid in ranked:
        parent = tree.nodes[nid].parent_id
        assert parent is not None
        if busy.get(parent, 0) >= config.per_parent:
            continue
        chosen.append(nid)
        busy[parent] = busy.get(parent, 0) + 1
        if len(chosen) == slots:
            break
    if len(chosen) < slots:
        # The cap only spreads work; it never leaves a slot idle when work exists.
        chosen += [nid for nid in ranked if nid not in chosen][: slots - len(chosen)]
    return chosen
