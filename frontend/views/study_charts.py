"""The study page's charts: scores over time, the search space, and the improvement state."""

from __future__ import annotations

from typing import Any

import streamlit as st
import streamlit.components.v1 as components

from client import Grove
from client.models import Progress, Study
from frontend import charts, palette, ui


def scores(s: Study) -> None:
    c = st.columns(5)
    c[0].metric("baseline dev", ui.fmt(s["baseline_dev"]))
    c[1].metric("trunk dev", ui.fmt(s["trunk_dev"]))
    c[2].metric("best dev", ui.fmt(s["best_dev"]))
    gain = (
        s["trunk_heldout"] - s["baseline_heldout"]
        if s["trunk_heldout"] is not None and s["baseline_heldout"] is not None
        else None
    )
    c[3].metric(
        "trunk held-out", ui.fmt(s["trunk_heldout"]), delta=ui.fmt(gain, signed=True) if gain else None
    )
    c[4].metric("pending approvals", s["pending_approvals"])


def plots(sid: int, progress: Progress) -> None:
    """Chart trunk's scores and each experiment's dev score (coloured by status, linked to its node)."""
    points = progress["points"]
    if not points:
        st.caption("No experiment has finished yet.")
        return
    left, right = st.columns(2)
    with left:
        st.caption("trunk score after each experiment")
        st.line_chart(
            [
                {
                    "experiment": p["experiment"],
                    "trunk dev": p["trunk_dev"],
                    "trunk held-out": p["trunk_heldout"],
                }
                for p in points
            ],
            x="experiment",
            y=["trunk dev", "trunk held-out"],
            height=260,
        )
    with right:
        st.caption("each experiment's dev score (click a point to open its node)")
        rows = [
            {
                "experiment": p["experiment"],
                "dev": p["dev"],
                "node": f"n{p['node_number']}",
                "status": p["status"],
                "url": node_url(sid, p["node_id"]),
            }
            for p in points
            if p["dev"] is not None
        ]
        spec = {
            "mark": {"type": "point", "filled": True, "size": 60, "cursor": "pointer"},
            "encoding": {
                "x": {"field": "experiment", "type": "quantitative", "axis": {"tickMinStep": 1}},
                "y": {"field": "dev", "type": "quantitative", "scale": {"zero": False}},
                "color": palette.vega_colour(),
                "href": {"field": "url"},
                "tooltip": [{"field": "node"}, {"field": "dev"}, {"field": "status"}],
            },
            "height": 260,
        }
        st.vega_lite_chart(rows, spec, width="stretch", key="dev-scatter")


def node_pages(sid: int) -> str:
    """Return the address of the study's node pages, less the node id (relative: it works behind any host)."""
    return f"node?study={sid}&node="


def node_url(sid: int, node_id: int) -> str:
    """Return the dashboard address of a node's page."""
    return f"{node_pages(sid)}{node_id}"


def search_space(api: Grove, s: Study) -> None:
    """Chart the search: parallel coordinates, which knobs matter, each key against the dev score."""
    sid = s["id"]
    space = api.search_space(sid)
    points = [p for p in space["points"] if p["values"]]
    if not points or not space["keys"]:
        st.caption("No measured node yet." if space["keys"] else "The study has no [search] keys.")
        return
    st.markdown("**Parallel coordinates**")
    chart = charts.parallel(
        points,
        space["keys"],
        space["metric"],
        s["baseline_dev"],
        s["direction"] == "maximize",
        node_pages(sid),
    )
    components.html(chart, height=340, scrolling=True)
    st.markdown("**Which knobs matter**")
    imp = api.importance(sid)
    if imp["keys"]:
        components.html(
            charts.importance(imp["keys"], imp["method"], imp["measured"]),
            height=22 * len(imp["keys"][:15]) + 50,
        )
    else:
        st.caption("Not yet: importance needs three measured nodes whose dev scores differ.")
    st.caption(f"dev {space['metric']} against each searched value (one point per measured node)")
    cols = st.columns(3)
    for i, key in enumerate(space["keys"][:12]):
        rows = [
            {
                "value": p["values"].get(key),
                "dev": p["dev"],
                "node": f"n{p['node_number']}",
                "status": p["status"],
                "url": node_url(sid, p["node_id"]),
            }
            for p in points
            if p["values"].get(key) is not None
        ]
        numeric = all(isinstance(r["value"], int | float) and not isinstance(r["value"], bool) for r in rows)
        spec = {
            "mark": {"type": "point", "filled": True, "size": 60, "cursor": "pointer"},
            "encoding": {
                "href": {"field": "url"},
                "x": {"field": "value", "type": "quantitative" if numeric else "nominal", "title": key},
                "y": {"field": "dev", "type": "quantitative", "scale": {"zero": False}, "title": "dev"},
                "color": palette.vega_colour(),
                "tooltip": [{"field": "node"}, {"field": "value"}, {"field": "dev"}, {"field": "status"}],
            },
            "height": 200,
        }
        with cols[i % 3]:
            st.vega_lite_chart(rows, spec, width="stretch", key=f"space-{i}")


def improvement_state(state: dict[str, Any], number: dict[int, int]) -> None:
    """Show the improvement state; `number` maps the node ids it cites to their numbers."""

    def tag(node_id: int) -> str:
        return f"n{number.get(node_id, '?')}"

    if not state:
        st.caption("No improvement state yet.")
        return
    sections = [
        (
            "Verified findings",
            [
                f"{f['text']} ({', '.join(map(tag, f['node_ids']))})"
                for f in state.get("verified_findings", [])
            ],
        ),
        (
            "Open constraints",
            [f"{c['name']}: {c['status']} — {c['detail']}" for c in state.get("open_constraints", [])],
        ),
        (
            "Rejected candidates",
            [f"{tag(r['node_id'])}: {r['reason']}" for r in state.get("rejected_candidates", [])],
        ),
        ("Concerns", list(state.get("concerns", []))),
        ("Next plan", list(state.get("next_plan", []))),
    ]
    # Findings are sentences: they get the page's width; the shorter lists share a row.
    places = [st.container(), *st.columns(2), *st.columns(2)]
    for place, (title, items) in zip(places, sections, strict=True):
        place.markdown(f"**{title}**")
        place.markdown("\n".join(f"- {i}" for i in items[-8:]) if items else "_none_")
