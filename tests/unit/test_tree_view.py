"""The dashboard's tree drawing: status colours, the trunk path, and folding for large trees."""

from __future__ import annotations

from typing import Any

from frontend.tree_view import merged_path, to_dot


def node(i: int, parent: int | None, status: str, gain: float | None = None) -> dict[str, Any]:
    return {
        "id": i,
        "number": i,
        "parent_id": parent,
        "status": status,
        "title": f"idea {i}",
        "gain": gain,
        "dev_mean": None,
    }


def test_trunk_path_is_highlighted_and_scores_are_labelled() -> None:
    nodes = [
        node(1, None, "merged"),
        node(2, 1, "merged", 0.25),
        node(3, 2, "running"),
        node(4, 1, "rejected", -0.1),
    ]
    dot, stats = to_dot(nodes, trunk_node_id=2)
    assert merged_path(nodes, 2) == {1, 2}
    assert 'n2 [label="n2 · merged\\nidea 2\\n+0.25"' in dot
    assert "n1 -> n2 [color=" in dot and "n1 -> n4;" in dot
    assert 'fillcolor="#ffd166"' in dot.split("n3 [")[1].split("\n")[0]
    assert stats.shown == 4 and stats.hidden == 0


def test_pruned_subtrees_and_dead_ends_fold_at_hundreds_of_nodes() -> None:
    nodes = [node(1, None, "merged")]
    for i in range(2, 12):  # 10 live branches, each with 20 failed leaves
        nodes.append(node(i, 1, "evaluated", 0.01))
    nid = 12
    for parent in range(2, 12):
        for _ in range(20):
            nodes.append(node(nid, parent, "failed"))
            nid += 1
    pruned_root = nid
    nodes.append(node(pruned_root, 1, "pruned"))
    for k in range(1, 40):
        nodes.append(node(pruned_root + k, pruned_root, "evaluated"))
    assert len(nodes) >= 250
    dot, stats = to_dot(nodes, trunk_node_id=1, max_nodes=1000)
    assert stats.shown == 12 and stats.hidden == 10 * 20 + 39
    assert "+39 pruned below" in dot and '"20 failed\\n(under n2)"' in dot
    assert f"n{pruned_root + 1} [" not in dot
    full, everything = to_dot(nodes, trunk_node_id=1, collapse=False)
    assert everything.shown == len(nodes) and everything.hidden == 0
    assert all(f"n{n['id']} [" in full for n in nodes)


def test_titles_are_escaped_for_dot() -> None:
    nodes = [
        {
            "id": 1,
            "number": 1,
            "parent_id": None,
            "status": "merged",
            "title": 'say "hi" \\ bye',
            "gain": None,
            "dev_mean": 1.5,
        }
    ]
    dot, _ = to_dot(nodes, 1)
    assert 'say \\"hi\\" \\\\ bye' in dot and "1.5" in dot


def test_a_thousand_node_tree_keeps_trunk_active_and_best_nodes_in_view() -> None:
    nodes = [node(1, None, "merged")]
    for i in range(2, 1001):
        parent = 1 if i < 40 else (i % 38) + 2
        nodes.append(node(i, parent, "evaluated" if i % 3 else "rejected", gain=(i % 97) / 1000))
    nodes[500] = node(501, nodes[500]["parent_id"], "running")
    nodes[700] = node(701, nodes[700]["parent_id"], "awaiting_approval", gain=0.001)
    nodes[10] = node(11, 1, "merged", 0.2)
    dot, stats = to_dot(nodes, trunk_node_id=11, max_nodes=150)
    assert stats.shown + stats.hidden == 1000
    assert 60 <= stats.shown <= 160
    for must in (1, 11, 501, 701):
        assert f"  n{must} [" in dot
    best = max((n for n in nodes if n["gain"] is not None), key=lambda n: n["gain"])
    assert f"  n{best['id']} [" in dot
    assert dot.count("(under n") >= 10


def test_hovering_tells_the_fate_and_clicking_opens_the_node() -> None:
    # Study 5's nodes: ids 41 and 42 in the database, n1 and n2 on the page.
    nodes = [
        {**node(41, None, "merged"), "number": 1},
        {**node(42, 41, "rejected", -0.1), "number": 2, "gain_lcb": -0.3, "fate": 'rejected by ada: "risky"'},
    ]
    dot, _ = to_dot(nodes, trunk_node_id=41, link=lambda nid: f"node?study=5&node={nid}")
    line = next(x for x in dot.splitlines() if x.strip().startswith("n42 ["))
    assert 'label="n2 · rejected' in line
    assert 'tooltip="n2 · idea 42 — rejected by ada: \\"risky\\" — dev gain -0.1 (LCB -0.3)"' in line
    assert 'URL="node?study=5&node=42", target="_top"' in line
    plain, _ = to_dot(nodes, trunk_node_id=1)
    assert "URL=" not in plain
