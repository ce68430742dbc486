from __future__ import annotations

import math
import random

import pytest

from agents.tree import plateau, pruning, selection
from agents.tree.gate import eligible, heldout_decision
from agents.tree.insights import backpropagate
from agents.tree.model import Tree, TreeNode
from agents.tree.stats import gain_over, summarize, t95
from agents.tree.status import IllegalTransition, NodeStatus, check_transition

S = NodeStatus


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (S.PROPOSED, S.QUEUED),
        (S.QUEUED, S.RUNNING),
        (S.RUNNING, S.EVALUATED),
        (S.EVALUATED, S.AWAITING_APPROVAL),
        (S.AWAITING_APPROVAL, S.MERGED),
        (S.RUNNING, S.FAILED),
        (S.FAILED, S.QUEUED),
        (S.EVALUATED, S.PRUNED),
    ],
)
def test_legal_transitions(old: NodeStatus, new: NodeStatus) -> None:
    assert check_transition(1, old, new) == new


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (S.PROPOSED, S.MERGED),
        (S.PROPOSED, S.RUNNING),
        (S.MERGED, S.PRUNED),
        (S.PRUNED, S.QUEUED),
        (S.EVALUATED, S.RUNNING),
        (S.CANCELLED, S.QUEUED),
    ],
)
def test_illegal_transitions_raise(old: NodeStatus, new: NodeStatus) -> None:
    with pytest.raises(IllegalTransition, match=f"node 7: illegal transition {old} -> {new}"):
        check_transition(7, old, new)


def test_summary_and_t_quantiles() -> None:
    s = summarize([1.0, 2.0, 3.0])
    assert (s.n, s.mean, s.std) == (3, 2.0, 1.0)
    assert t95(2) == pytest.approx(2.920)
    assert t95(100) == pytest.approx(1.645)


def test_paired_gain_removes_shared_seed_noise() -> None:
    ref = [0.50, 0.60, 0.70]
    cand = [0.52, 0.62, 0.72]
    g = gain_over(cand, ref, maximize=True)
    assert g.paired and g.mean == pytest.approx(0.02) and g.lcb == pytest.approx(0.02)
    unpaired = gain_over(cand, ref[:2], maximize=True)
    assert not unpaired.paired and unpaired.lcb < 0


def test_gain_sign_follows_direction() -> None:
    g = gain_over([1.0, 1.2], [2.0, 2.2], maximize=False)
    assert g.mean == pytest.approx(1.0)
    noisy = gain_over([1.0, 3.0], [2.0, 2.2], maximize=False)
    assert noisy.lcb < noisy.mean


def node(i: int, parent: int | None, status: NodeStatus, **kw: object) -> TreeNode:
    depth = 0 if parent is None else 1
    return TreeNode(i, parent, depth, status, **kw)  # type: ignore[arg-type]


def frontier() -> Tree:
    return Tree.of(
        [
            node(1, None, S.MERGED),
            node(2, 1, S.EVALUATED, gain=0.1, gain_lcb=0.05, order=1),
            node(3, 1, S.EVALUATED, gain=-0.1, gain_lcb=-0.2, order=2),
            node(4, 2, S.PROPOSED, prior=0.01),
            node(5, 2, S.PROPOSED, prior=0.01),
            node(6, 3, S.PROPOSED, prior=0.01),
            node(7, 1, S.PROPOSED, prior=0.0),
            node(8, 2, S.PROPOSED, prior=0.01),
        ]
    )


def test_selection_score_prefers_valuable_subtrees() -> None:
    scores = selection.frontier_scores(frontier(), selection.SelectionConfig(exploration=0.0))
    assert scores[4] == pytest.approx(0.06)
    assert scores[6] == pytest.approx(0.01 - 0.2)
    assert scores[7] == pytest.approx(0.05)  # root subtree value is its best LCB


def test_selection_diversity_cap_and_determinism() -> None:
    cfg = selection.SelectionConfig(exploration=0.0, per_parent=2, seed=3)
    first = selection.select(frontier(), 3, cfg, round_no=5)
    assert first == selection.select(frontier(), 3, cfg, round_no=5)
    assert sum(1 for nid in first if nid in (4, 5, 8)) == 2  # cap of 2 per parent
    assert 7 in first
    other = {tuple(selection.select(frontier(), 2, selection.SelectionConfig(0.0, 3, seed)))
             for seed in range(20)}  # fmt: skip
    assert len(other) > 1  # ties among 4, 5, 8 are broken by the seed


def test_selection_fills_slots_beyond_the_cap() -> None:
    tree = Tree.of([node(1, None, S.MERGED), node(2, 1, S.PROPOSED), node(3, 1, S.PROPOSED)])
    assert sorted(selection.select(tree, 2, selection.SelectionConfig(per_parent=1))) == [2, 3]


def test_backpropagation_versions_every_ancestor_and_cites_children() -> None:
    tree = Tree.of(
        [
            TreeNode(1, None, 0, S.MERGED),
            TreeNode(2, 1, 1, S.EVALUATED, insight="n2 helps"),
            TreeNode(3, 2, 2, S.EVALUATED, insight="n3: +0.1"),
            TreeNode(4, 2, 2, S.FAILED, insight="n4 failed"),
        ]
    )
    calls = []

    def synth(anc: TreeNode, kids: list[TreeNode]) -> str:
        calls.append(anc.id)
        return f"n{anc.id}: " + " | ".join(k.insight for k in kids)

    ups = backpropagate(tree, 3, synth)
    assert [u.node_id for u in ups] == [2, 1]
    assert ups[0].cites == (3, 4) and ups[0].text == "n2: n3: +0.1 | n4 failed"
    assert ups[1].cites == (2,) and "n3: +0.1" in ups[1].text  # the root sees n2's new version


def test_plateau_levels() -> None:
    cfg = plateau.PlateauConfig(3, 5, 8)
    assert plateau.plateau_level([True, False, False], cfg) == plateau.PlateauLevel.NONE
    assert plateau.plateau_level([True] + [False] * 3, cfg) == plateau.PlateauLevel.WARN
    assert plateau.plateau_level([False] * 5, cfg) == plateau.PlateauLevel.CHANGE
    assert plateau.plateau_level([False] * 9 + [True], cfg) == plateau.PlateauLevel.NONE
    assert plateau.plateau_level([False] * 8, cfg) == plateau.PlateauLevel.STOP


def test_pruning_keeps_the_lesson_and_spares_improving_directions() -> None:
    tree = Tree.of(
        [
            TreeNode(1, None, 0, S.MERGED),
            TreeNode(2, 1, 1, S.EVALUATED, gain_lcb=-0.1, insight="wide layers overfit"),
            *[
                TreeNode(10 + i, 2, 2, S.EVALUATED, gain_lcb=-0.01, order=i + 1, number=4 + i)
                for i in range(3)
            ],
            TreeNode(3, 1, 1, S.EVALUATED, gain_lcb=0.2),
            TreeNode(20, 3, 2, S.EVALUATED, gain_lcb=0.1, order=4),
            *[TreeNode(21 + i, 3, 2, S.EVALUATED, gain_lcb=-0.1, order=5 + i) for i in range(2)],
        ]
    )
    out = pruning.exhausted(tree, window=3)
    assert [p.node_id for p in out] == [2]
    # Texts name nodes by their number in the study, not their database id.
    assert out[0].lesson == "wide layers overfit" and "n4, n5, n6" in out[0].reason


def test_gate_eligibility_rules() -> None:
    ok = dict(dev_gain_lcb=0.1, constraints_hold=True, on_current_trunk=True, queries_used=0, max_queries=2)
    assert eligible(**ok).ok  # type: ignore[arg-type]
    assert not eligible(**{**ok, "dev_gain_lcb": 0.0}).ok  # type: ignore[arg-type]
    assert not eligible(**{**ok, "constraints_hold": False}).ok  # type: ignore[arg-type]
    assert not eligible(**{**ok, "on_current_trunk": False}).ok  # type: ignore[arg-type]
    capped = eligible(**{**ok, "queries_used": 2})  # type: ignore[arg-type]
    assert not capped.ok and "cap" in capped.reason


def test_heldout_margin() -> None:
    assert heldout_decision([0.82, 0.821, 0.822], [0.80, 0.80, 0.80], maximize=True, margin=0.01).passed
    assert not heldout_decision([0.805, 0.805], [0.80, 0.80], maximize=True, margin=0.01).passed
    # Strictly above the margin: a gain equal to it does not pass.
    assert not heldout_decision([0.75, 0.75], [0.5, 0.5], maximize=True, margin=0.25).passed
    assert heldout_decision([0.75, 0.75], [0.5, 0.5], maximize=True, margin=0.125).passed
    assert not heldout_decision([0.8], [0.8], maximize=True, margin=0.0).passed
    # Noise-aware: a mean gain above the margin that noise could explain does not pass.
    noisy = heldout_decision([0.90, 0.78, 0.85], [0.80, 0.80, 0.80], maximize=True, margin=0.0)
    assert noisy.gain > 0 and noisy.gain_lcb < 0 and not noisy.passed
    assert heldout_decision([0.70], [0.80], maximize=False, margin=0.05).passed
    failed = heldout_decision([], [0.8], maximize=True, margin=0.0)
    assert not failed.passed and math.isnan(failed.gain)


def test_refine_children_are_served_before_new_ideas() -> None:
    tree = Tree.of(
        [
            node(1, None, S.MERGED),
            node(2, 1, S.REJECTED, gain=0.1, gain_lcb=0.05, order=1),
            node(3, 1, S.PROPOSED, prior=0.5),
            node(4, 1, S.PROPOSED, prior=0.4),
            TreeNode(5, 2, 2, S.PROPOSED, prior=0.0, origin="refine"),
        ]
    )
    cfg = selection.SelectionConfig(exploration=0.0)
    scores = selection.frontier_scores(tree, cfg)
    assert scores[5] < scores[3] and scores[5] < scores[4]  # lower score, served first all the same
    assert selection.select(tree, 1, cfg) == [5]
    assert selection.select(tree, 2, cfg) == [5, 3]


def test_an_updated_tree_reads_as_one_built_afresh() -> None:
    base = Tree.of([node(1, None, S.MERGED), node(2, 1, S.RUNNING), node(3, 1, S.PROPOSED)])
    base.children(1)  # index it, so the update shares the index
    changed = [node(2, 1, S.EVALUATED), node(4, 2, S.PROPOSED)]
    after = base.updated(changed)
    fresh = Tree.of(
        [node(1, None, S.MERGED), node(2, 1, S.EVALUATED), node(3, 1, S.PROPOSED), node(4, 2, S.PROPOSED)]
    )
    for nid in (1, 2, 3, 4):
        assert after.children(nid) == fresh.children(nid)
    assert after.nodes == fresh.nodes
    assert [n.status for n in base.children(1)] == [S.RUNNING, S.PROPOSED]  # the old view is unchanged
    same_shape = base.updated([node(3, 1, S.QUEUED)])
    assert [n.status for n in same_shape.children(1)] == [S.RUNNING, S.QUEUED]


def test_many_updates_keep_every_view_equal_to_one_built_afresh() -> None:
    rng = random.Random(7)
    nodes = {1: node(1, None, S.MERGED)}
    tree = Tree.of(nodes.values())
    views: list[tuple[Tree, dict[int, TreeNode]]] = []
    for step in range(300):
        changed = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            if kind < 0.6 or len(nodes) < 3:  # a new node under any node; ids may arrive out of order
                nid = max(nodes) + rng.choice([1, 1, 1, 2]) if rng.random() < 0.9 else max(nodes) + 5
                if nid in nodes:
                    continue
                changed.append(node(nid, rng.choice(sorted(nodes)), S.PROPOSED))
            elif kind < 0.9:  # a status change
                nid = rng.choice(sorted(nodes)[1:])
                changed.append(node(nid, nodes[nid].parent_id, rng.choice([S.RUNNING, S.EVALUATED])))
            else:  # a node moved under another parent (a repaired row)
                nid = rng.choice(sorted(nodes)[2:] or [2])
                if nid in nodes and nodes[nid].parent_id is not None:
                    changed.append(node(nid, rng.choice([1, *[i for i in nodes if i < nid]]), S.EVALUATED))
        for n in changed:
            nodes[n.id] = n
        tree.children(1)  # indexed, so the update carries the index over
        tree = tree.updated(changed)
        fresh = Tree.of(nodes.values())
        for nid in nodes:
            assert tree.children(nid) == fresh.children(nid), (step, nid)
        assert tree.with_status(S.PROPOSED) == fresh.with_status(S.PROPOSED)
        if step % 50 == 0:
            views.append((tree, dict(nodes)))
    for old, snapshot in views:  # earlier views never see later changes
        again = Tree.of(snapshot.values())
        assert all(old.children(nid) == again.children(nid) for nid in snapshot)
