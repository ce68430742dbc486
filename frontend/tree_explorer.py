"""The study's tree as a self-contained page: zoom, pan, search, fold subtrees; colour by gain.

The page is built here and drawn by `assets/tree_explorer.js` inside the dashboard (an iframe of
its own, no network): fill is the node's dev gain on a diverging scale, the outline its status in
the palette every chart uses, and a badge tells the ways a node can end (rejected by a human, by a
constraint, at the held-out gate; failed; pruned).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from client.models import NodeStatus, NodeSummary
from frontend import palette

ASSETS = Path(__file__).parent / "assets"
FOLLOW_LINKS = (ASSETS / "follow_links.js").read_text()
SCRIPT = FOLLOW_LINKS + (ASSETS / "tree_explorer.js").read_text()

MARKS = {
    "human": "rejected by a human",
    "constraint": "rejected: a constraint open",
    "gate": "rejected at the held-out gate",
    "dev": "rejected on dev",
    "failed": "failed",
    "pruned": "pruned",
    "waiting": "waits for a human decision",
}


def mark(n: NodeSummary) -> str:
    """Return how a node ended, as a badge name ('' for none), from its status and what rejected it."""
    status = n["status"]
    if status == NodeStatus.REJECTED:
        return n.get("rejection") or "dev"
    if status in (NodeStatus.FAILED, NodeStatus.PRUNED):
        return status
    if status == NodeStatus.AWAITING_APPROVAL:
        return "waiting"
    return ""


def _node(n: NodeSummary, trunk: set[int]) -> dict[str, Any]:
    return {
        "id": n["id"],
        "p": n["parent_id"],
        "n": n["number"],
        "s": n["status"],
        "t": (n.get("title") or "")[:80],
        "g": n.get("gain"),
        "l": n.get("gain_lcb"),
        "h": n.get("heldout_gain"),
        "f": str(n.get("fate") or "")[:200],
        "m": mark(n),
        "k": n["id"] in trunk,
    }


def data(
    nodes: list[NodeSummary], trunk_node_id: int | None, url: str, focus: int | None, key: str
) -> dict[str, Any]:
    """Return what the page draws: the nodes, the trunk path, the palette and where to look first."""
    parent = {n["id"]: n["parent_id"] for n in nodes}
    trunk: set[int] = set()
    cur = trunk_node_id
    while cur is not None and cur in parent and cur not in trunk:
        trunk.add(cur)
        cur = parent[cur]
    return {
        "nodes": [_node(n, trunk) for n in nodes],
        "trunk": trunk_node_id,
        "focus": focus if focus is not None else trunk_node_id,
        "url": url,
        "key": key,
        "status": palette.STATUS,
        "gain": [palette.GAIN_WORSE, palette.GAIN_ZERO, palette.GAIN_BETTER],
        "marks": MARKS,
    }


def html(
    nodes: list[NodeSummary],
    trunk_node_id: int | None,
    url: str,
    *,
    focus: int | None = None,
    height: int = 620,
    key: str = "grove-tree",
) -> str:
    """Return the whole page for the tree; `url` + a node id is the address of that node's page."""
    payload = json.dumps(data(nodes, trunk_node_id, url, focus, key), ensure_ascii=True).replace(
        "<", "\\u003c"
    )
    return (  # the data last: a title may spell a placeholder
        PAGE.replace("__HEIGHT__", str(height - 80))
        .replace("__SCRIPT__", SCRIPT)
        .replace("__DATA__", payload)
    )


PAGE = """<!doctype html>
<html><head><meta charset="utf-8">
<style>
  body { margin: 0; font-family: "Source Sans Pro", Helvetica, Arial, sans-serif; font-size: 13px; color: #262730; }
  #bar { display: flex; gap: 6px; align-items: center; flex-wrap: wrap; padding: 4px 0 6px 0; }
  #bar input { font: inherit; padding: 3px 6px; width: 16em; border: 1px solid #c8c8d0; border-radius: 6px; }
  #bar button { font: inherit; padding: 2px 9px; border: 1px solid #c8c8d0; border-radius: 6px; background: #fff; cursor: pointer; }
  #bar button:hover { border-color: #ff4b4b; }
  #info { color: #6b6b7b; margin-left: 4px; }
  #legend { display: flex; gap: 12px; flex-wrap: wrap; color: #4b4b5b; font-size: 12px; padding-bottom: 4px; }
  #legend span.sw { display: inline-block; width: 12px; height: 12px; border-radius: 3px; vertical-align: -2px; margin-right: 3px; }
  #canvas { border: 1px solid #e6e6ea; border-radius: 8px; background: #fcfcfd; cursor: grab; touch-action: none; }
  #canvas.dragging { cursor: grabbing; }
  #canvas.far text.label { display: none; }
  text { pointer-events: none; }
  g.node { cursor: pointer; }
  g.node text.label { font-size: 11px; fill: #1f1f29; }
  g.node text.sub { font-size: 10px; fill: #4b4b5b; }
  g.hit rect.box { stroke: #1d3557 !important; stroke-width: 4 !important; }
  circle.fold { fill: #fff; stroke: #8a8a99; cursor: pointer; }
  text.foldtext { font-size: 10px; fill: #4b4b5b; }
  text.badge { font-size: 10px; font-weight: 700; fill: #fff; }
</style></head>
<body>
<div id="bar">
  <input id="search" type="search" placeholder="Find a node: n12, 12 or words" aria-label="Find a node">
  <button id="next" title="Centre the next match">Find</button>
  <button id="zin" title="Zoom in">+</button><button id="zout" title="Zoom out">&minus;</button>
  <button id="fit" title="The whole tree">Fit</button><button id="best" title="The trusted best: trunk">Trunk</button>
  <button id="unfold" title="Open every folded subtree">Unfold all</button>
  <span id="info"></span>
</div>
<div id="legend"></div>
<svg id="canvas" width="100%" height="__HEIGHT__"><g id="view"></g></svg>
<script>const DATA = __DATA__;</script>
<script>__SCRIPT__</script>
</body></html>
"""
