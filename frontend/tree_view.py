"""Draw a study's hypothesis tree as Graphviz DOT, readable at hundreds of nodes."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

COLOURS = {
    "proposed": "#e0e0e0",
    "queued": "#fff3b0",
    "running": "#ffd166",
    "evaluated": "#a8dadc",
    "awaiting_approval": "#f4a261",
    "merged": "#57cc99",
    "rejected": "#e5989b",
    "failed": "#e63946",
    "pruned": "#bdbdbd",
    "cancelled": "#d6d6d6",
}
DEAD_ENDS = ("rejected", "failed", "cancelled")


@dataclass
class TreeStats:
    shown: int
    hidden: int


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def _short(text: str, n: int = 34) -> str:
    text = re.sub(r"[\w./-]+\.(?:toml|ya?ml|json):", "", text)
    return text if len(text) <= n else text[: n - 1] + "…"


def _score(n: dict[str, Any]) -> str:
    if n.get("gain") is not None:
        return f"{n['gain']:+.4g}"
    if n.get("dev_mean") is not None:
        return f"{n['dev_mean']:.4g}"
    return ""


def merged_path(nodes: list[dict[str, Any]], trunk_node_id: int | None) -> set[int]:
    """Return the ids from the root to the trunk node."""
    parent = {n["id"]: n["parent_id"] for n in nodes}
    path: set[int] = set()
    cur = trunk_node_id
    while cur is not None and cur in parent and cur not in path:
        path.add(cur)
        cur = parent[cur]
    return path


def to_dot(
    nodes: list[dict[str, Any]],
    trunk_node_id: int | None,
    *,
    collapse: bool = True,
    group_dead_ends: int = 3,
    selected: int | None = None,
) -> tuple[str, TreeStats]:
    """Return DOT for the tree and how many nodes it shows and hides.

    With `collapse`, a pruned node stands for its whole subtree, and a parent's failed, rejected
    and cancelled leaves become one box once there are more than `group_dead_ends` of them.
    """
    by_id = {n["id"]: n for n in nodes}
    kids: dict[int, list[int]] = defaultdict(list)
    for n in nodes:
        if n["parent_id"] is not None:
            kids[n["parent_id"]].append(n["id"])
    trunk = merged_path(nodes, trunk_node_id)

    def subtree_size(nid: int) -> int:
        stack, count = [nid], 0
        while stack:
            cur = stack.pop()
            count += 1
            stack.extend(kids.get(cur, []))
        return count

    lines = [
        "digraph tree {",
        '  graph [rankdir=LR, nodesep=0.15, ranksep=0.35, bgcolor="transparent"];',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, margin="0.08,0.04"];',
        '  edge [color="#9e9e9e", arrowsize=0.5];',
    ]
    shown = hidden = 0
    roots = [n["id"] for n in nodes if n["parent_id"] is None or n["parent_id"] not in by_id]
    stack = list(reversed(roots))
    while stack:
        nid = stack.pop()
        n = by_id[nid]
        shown += 1
        status = n["status"]
        extra = ""
        below = kids.get(nid, [])
        if collapse and status == "pruned" and below:
            size = subtree_size(nid) - 1
            hidden += size
            extra = f"\\n+{size} pruned below"
            below = []
        label = f"n{nid} · {status}\\n{_esc(_short(n.get('title') or ''))}"
        score = _score(n)
        if score:
            label += f"\\n{score}"
        attrs = [f'label="{label}{extra}"', f'fillcolor="{COLOURS.get(status, "#ffffff")}"', f'id="n{nid}"']
        if nid in trunk:
            attrs.append('penwidth=2.5, color="#1b7f4b"')
        if nid == selected:
            attrs.append('penwidth=3, color="#1d3557"')
        lines.append(f"  n{nid} [{', '.join(attrs)}];")
        if n["parent_id"] in by_id:
            style = ' [color="#1b7f4b", penwidth=2.5]' if nid in trunk else ""
            lines.append(f"  n{n['parent_id']} -> n{nid}{style};")
        dead = [k for k in below if by_id[k]["status"] in DEAD_ENDS and not kids.get(k) and k != selected]
        if collapse and len(dead) > group_dead_ends:
            below = [k for k in below if k not in dead]
            counts: dict[str, int] = defaultdict(int)
            for k in dead:
                counts[by_id[k]["status"]] += 1
            text = ", ".join(f"{c} {s}" for s, c in sorted(counts.items()))
            lines.append(
                f'  g{nid} [label="{text}\\n(n{min(dead)}…n{max(dead)})", fillcolor="#f1f1f1", style="rounded,filled,dashed"];'
            )
            lines.append(f"  n{nid} -> g{nid} [style=dashed];")
            hidden += len(dead)
        stack.extend(reversed(below))
    lines.append("}")
    return "\n".join(lines), TreeStats(shown=shown, hidden=hidden)
