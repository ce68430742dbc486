"""Node: one hypothesis with its evidence, verification, diff, receipts, insights and cost."""

from __future__ import annotations

import json
from typing import Any

import streamlit as st

from client import Grove
from client.models import NodeDetail, NodeStatus
from frontend import decisions, timeline, ui, verdicts


def header(n: NodeDetail, sid: int) -> None:
    title = n["title"] if len(n["title"]) <= 60 else n["title"][:59] + "…"
    st.title(f"n{n['number']} · {ui.words(title)}")
    if title != n["title"]:
        st.markdown(f"**{ui.words(n['title'])}**")
    st.text(f"Fate: {n['fate']}")  # plain text: its words come from failures and reviewers
    st.caption(
        f"status **{n['status']}** · origin {n['origin']} · depth {n['depth']} · attempts {n['attempts']}"
    )
    links = st.columns(4)
    with links[0]:
        ui.page_link("study", "← study", study=sid)
    if n["parent_id"] is not None:
        with links[1]:
            ui.page_link("node", f"parent n{n['parent_number']}", study=sid, node=n["parent_id"])
    if n["children"]:
        st.write("children:")
        cols = st.columns(min(6, len(n["children"])))
        for i, c in enumerate(n["children"]):
            with cols[i % len(cols)]:
                ui.page_link("node", f"n{c['number']}", study=sid, node=c["id"])


def evidence(n: NodeDetail) -> None:
    c = st.columns(4)
    c[0].metric(
        f"dev mean {ui.spread(n['dev_values'])}" if n["dev_values"] else "dev mean", ui.fmt(n["dev_mean"])
    )
    c[1].metric("dev gain vs its base", ui.fmt(n["gain"], signed=True))
    c[2].metric("gain 95% LCB", ui.fmt(n["gain_lcb"], signed=True))
    c[3].metric("held-out gain", ui.fmt(n["heldout_gain"], signed=True))
    now = (n.get("verification") or {}).get("trunk_gain")
    if isinstance(now, dict) and now.get("gain") is not None:
        st.caption(
            f"Built on an older trunk: its gain is paired against that trunk; against the current trunk it is "
            f"{ui.fmt(now['gain'], signed=True)}."
        )
    if n["gate_reason"]:
        st.info(ui.words(f"gate: {n['gate_reason']}"))
    if n["failure"]:
        st.error(ui.words(f"failure: {n['failure']}"))
    if n["summary"]:
        st.markdown(ui.words(n["summary"]))


def hypothesis(n: NodeDetail) -> None:
    h = n["hypothesis"]
    for key in ("mechanism", "hypothesis", "observable", "risks"):
        if h.get(key):
            st.markdown(f"**{key.capitalize()}.** {ui.words(h[key])}")
    if n["edits"]:
        st.markdown("**Edits**")
        st.json(n["edits"], expanded=False)
    if n["reflection"]:
        st.markdown(f"**Reflection after a failed attempt.** {ui.words(n['reflection'])}")


def verdict_rows(constraints: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return the AREX verdict table: one row per constraint."""
    return [
        {
            "constraint": c.get("name"),
            "verdict": c.get("verdict"),
            "value": c.get("value"),
            "receipt": c.get("receipt_id"),
            "detail": c.get("detail", ""),
        }
        for c in constraints
    ]


def verification(n: NodeDetail) -> None:
    """Say what the gate and AREX decided in words, then the verdict of each constraint."""
    for words in (verdicts.gate(n), verdicts.arex(n)):
        if words:
            st.text(words)  # plain text: a reason may quote a model or a repository
    if n["constraints"]:
        st.dataframe(verdict_rows(n["constraints"]), hide_index=True, width="stretch")
    elif n["verification"]:
        st.caption("The goal sets no constraint: there is nothing to check beyond the gain.")
    else:
        st.caption("Not verified yet: verification runs once the dev evaluation is in.")
    if n["verification"]:
        with st.expander("AREX's record"):
            st.json(n["verification"], expanded=True)


def receipts(api: Grove, n: NodeDetail, sid: int) -> None:
    if not n["receipts"]:
        st.caption("No evaluation runs yet.")
        return
    st.dataframe(
        [
            {
                "id": r["id"],
                "kind": r["kind"],
                "seed": r["seed"],
                "ok": r["ok"],
                "exit": r["exit_code"],
                "seconds": round(r["duration"], 2),
                "metrics": json.dumps(r["metrics"], ensure_ascii=False) if r["metrics"] else "",
                "reason": r["reason"],
                "commit": r["commit"][:10],
            }
            for r in n["receipts"]
        ],
        hide_index=True,
        width="stretch",
    )
    for r in n["receipts"]:
        with st.expander(f"receipt {r['id']}: {r['kind']} seed {r['seed']} — {ui.words(r['command'])}"):
            st.caption(f"evaluator fingerprint {r['fingerprint'][:16]}")
            st.code(r["stdout_tail"] or "(no output)", language="text")
            if r["stderr_tail"]:
                st.code(r["stderr_tail"], language="text")
            if st.button("Load the full output", key=f"full-{r['id']}"):
                st.code(api.receipt_output(sid, r["id"]), language="text")


def curves(api: Grove, n: NodeDetail, sid: int) -> None:
    """Chart the per-step records the node's dev runs printed, one chart per key, a line per run."""
    found = api.curves(sid, n["id"])
    if not found["curves"]:
        return
    st.subheader("Training curves")
    st.caption("per-step records its dev runs printed (JSON lines with an integer `step`), a line per seed")
    cols = st.columns(min(3, len(found["keys"])) or 1)
    for i, key in enumerate(found["keys"][:9]):
        rows = [
            {"step": r["step"], "value": r[key], "seed": str(c["seed"])}
            for c in found["curves"]
            for r in c["records"]
            if key in r
        ]
        spec = {
            "mark": {"type": "line", "point": len(rows) <= 60},
            "encoding": {
                "x": {"field": "step", "type": "quantitative"},
                "y": {"field": "value", "type": "quantitative", "title": key, "scale": {"zero": False}},
                "color": {"field": "seed", "type": "nominal", "title": "seed"},
                "tooltip": [{"field": "seed"}, {"field": "step"}, {"field": "value"}],
            },
            "height": 200,
        }
        with cols[i % len(cols)]:
            st.vega_lite_chart(rows, spec, width="stretch", key=f"curve-{i}")


def live_output(api: Grove, n: NodeDetail, sid: int) -> None:
    """While the node runs, tail its newest output every 2 s (its dev runs and executor commands)."""
    if n["status"] not in (NodeStatus.QUEUED, NodeStatus.RUNNING):
        return

    @st.fragment(run_every="2s")
    def tail() -> None:
        stream = st.segmented_control(
            "Live output", ["stdout", "stderr"], default="stdout", key="live_stream"
        )
        chosen = stream or "stdout"
        out = api.live(sid, n["id"], chosen)
        if out["status"] not in (NodeStatus.QUEUED, NodeStatus.RUNNING):
            st.rerun()  # it finished: show the whole page as it now is
        if not out["run"]:
            st.caption(out["note"])
            return
        other = "stderr" if chosen == "stdout" else "stdout"
        if not out["tail"]:  # a run that prints only at the end: show what the other stream says meanwhile
            also = api.live(sid, n["id"], other)
            if also["tail"]:
                st.caption(
                    f"{out['run']} · nothing on {chosen} yet; the tail of {other}, updated {(also['updated_at'] or '')[:19]}"
                )
                st.code(also["tail"][-8000:], language="text")
                return
        st.caption(f"{out['run']} · updated {(out['updated_at'] or '')[:19]}")
        st.code(out["tail"][-8000:] or f"(nothing on {chosen} or {other} yet)", language="text")

    tail()


def page() -> None:
    sid, nid = ui.query_int("study"), ui.query_int("node")
    if sid is None or nid is None:
        st.info("Open a node from a study's page.")
        ui.page_link("studies", "Studies")
        return
    api = ui.client()
    n = api.node(sid, nid)
    header(n, sid)
    ui.recall("decisions")
    if n["status"] == NodeStatus.AWAITING_APPROVAL:
        for a in api.approvals(sid):
            if a["node_id"] == nid:
                st.warning(f"**n{n['number']} waits for your decision**: it passed the held-out gate.")
                decisions.card(api, a, api.study(sid)["name"])
    evidence(n)
    live_output(api, n, sid)
    curves(api, n, sid)
    tabs = st.tabs(["Hypothesis", "Verification", "Diff", "Receipts", "Insights", "History", "Cost"])
    with tabs[0]:
        hypothesis(n)
    with tabs[1]:
        verification(n)
    with tabs[2]:
        if n["diff"]:
            st.caption(ui.words(f"{n['base_commit'][:10]} → {n['commit'][:10]} on {n['branch']}"))
            st.code(n["diff"], language="diff")
        else:
            st.caption("No diff (the node has no commit yet, or changed nothing).")
    with tabs[3]:
        receipts(api, n, sid)
    with tabs[4]:
        if n["insights"]:
            for i in reversed(n["insights"]):
                cites = ", ".join(f"n{c}" for c in i["cited"])
                st.markdown(
                    f"**v{i['version']}** ({i['created_at'][:19]}, cites {cites or '—'}): {i['text']}"
                )
        else:
            st.caption("No insight yet.")
    with tabs[5]:
        st.text(timeline.lines(n["history"], {n["id"]: n["number"]}) or "No event yet.")
    with tabs[6]:
        cost = n["cost"] or {}
        seconds = sum(r["duration"] for r in n["receipts"])
        if cost:
            st.json(cost)
        else:
            st.caption("No model was called for this node (the search policy, or a human's hypothesis).")
        st.caption(f"{seconds:.1f} s of evaluation runs over {len(n['receipts'])} runs.")


ui.guarded(page)
