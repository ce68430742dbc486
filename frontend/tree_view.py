"""Draw a study's hypothesis tree as Graphviz DOT, readable at hundreds of nodes."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from frontend import palette

COLOURS = palette.STATUS
DEAD_ENDS = ("rejected", "failed", "cancelled")
FOCUS = ("queued", "running", "awaiting_approval", "merged")


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


def _tooltip(n: dict[str, Any]) -> str:
    """Return what hovering a node says: its change, fate and scores."""
    parts = [f"n{n['number']} · {n.get('title') or ''}", str(n.get("fate") or n["status"])]
    if n.get("gain") is not None:
        lcb = n.get("gain_lcb")
        parts.append(f"dev gain {n['gain']:+.4g}" + (f" (LCB {lcb:+.4g})" if lcb is not None else ""))
    elif n.get("dev_mean") is not None:
        parts.append(f"dev {n['dev_mean']:.4g}")
    return " — ".join(parts)


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
    max_nodes: int = 80,
    selected: int | None = None,
    link: Callable[[int], str] | None = None,
) -> tuple[str, TreeStats]:
    """Return DOT for the tree and how many nodes it shows and folds away.

    With `collapse`: a pruned node stands for its whole subtree; a parent's failed, rejected and
    cancelled leaves become one box once there are more than `group_dead_ends` of them; and a tree
    larger than `max_nodes` shows only the trunk path, active and waiting nodes, the best third by
    gain and their ancestors, each parent's other children folded into one box.
    """
    by_id = {n["id"]: n for n in nodes}
    kids: dict[int, list[int]] = defaultdict(list)
    for n in nodes:
        if n["parent_id"] is not None:
            kids[n["parent_id"]].append(n["id"])
    trunk = merged_path(nodes, trunk_node_id)

    def subtree(nid: int) -> list[int]:
        out, stack = [], [nid]
        while stack:
            cur = stack.pop()
            out.append(cur)
            stack.extend(kids.get(cur, []))
        return out

    allowed: set[int] | None = None
    if collapse and len(nodes) > max_nodes:
        ranked = sorted((n for n in nodes if n.get("gain") is not None), key=lambda n: -n["gain"])
        focus = (
            trunk
            | {n["id"] for n in nodes if n["status"] in FOCUS}
            | {n["id"] for n in ranked[: max_nodes // 3]}
        )
        if selected is not None:
            focus.add(selected)
        allowed = set()
        for nid in focus:
            cur: int | None = nid
            while cur is not None and cur in by_id and cur not in allowed:
                allowed.add(cur)
                cur = by_id[cur]["parent_id"]

    lines = [
        "digraph tree {",
        '  graph [rankdir=LR, nodesep=0.15, ranksep=0.35, bgcolor="transparent"];',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, margin="0.08,0.04"];',
        '  edge [color="#9e9e9e", arrowsize=0.5];',
    ]
    shown = hidden = 0
    stack = [n["id"] for n in reversed(nodes) if n["parent_id"] is None or n["parent_id"] not in by_id]
    while stack:
        nid = stack.pop()
        n = by_id[nid]
        shown += 1
        status = n["status"]
        below = kids.get(nid, [])
        label = f"n{n['number']} · {status}\\n{_esc(_short(n.get('title') or ''))}"
        if _score(n):
            label += f"\\n{_score(n)}"
        if collapse and status == "pruned" and below:
            size = len(subtree(nid)) - 1
            hidden += size
            label += f"\\n+{size} pruned below"
            below = []
        attrs = [f'label="{label}"', f'fillcolor="{COLOURS.get(status, "#ffffff")}"']
        attrs.append(f'tooltip="{_esc(_tooltip(n))}"')
        if link is not None:
            attrs.append(f'URL="{_esc(link(nid))}", target="_top"')
        if nid in trunk:
            attrs.append('penwidth=2.5, color="#1b7f4b"')
        if nid == selected:
            attrs.append('penwidth=3, color="#1d3557"')
        lines.append(f"  n{nid} [{', '.join(attrs)}];")
        if n["parent_id"] in by_id:
            style = ' [color="#1b7f4b", penwidth=2.5]' if nid in trunk else ""
            lines.append(f"  n{n['parent_id']} -> n{nid}{style};")
        folded = [k for k in below if allowed is not None and k not in allowed]
        below = [k for k in below if k not in folded]
        dead = [k for k in below if by_id[k]["status"] in DEAD_ENDS and not kids.get(k) and k != selected]
        if collapse and len(dead) > group_dead_ends:
            folded += dead
            below = [k for k in below if k not in dead]
        if folded:
            counts: dict[str, int] = defaultdict(int)
            for k in folded:
                for d in subtree(k):
                    counts[by_id[d]["status"]] += 1
                    hidden += 1
            text = ", ".join(f"{c} {s}" for s, c in sorted(counts.items()))
            lines.append(
                f'  g{nid} [label="{text}\\n(under n{n["number"]})", fillcolor="#f1f1f1", style="rounded,filled,dashed"];'
            )
            lines.append(f"  n{nid} -> g{nid} [style=dashed];")
        stack.extend(reversed(below))
    lines.append("}")
    return "\n".join(lines), TreeStats(shown=shown, hidden=hidden)
