"""A gate-passed node waiting for a human: its card with Approve and Reject (Approvals and Study pages)."""

from __future__ import annotations

from typing import Any

import streamlit as st

from client import ApiError, Grove, Unreachable
from client.models import Approval
from frontend import ui


def decide(api: Grove, a: Approval, approve: bool, reason: str = "") -> None:
    """Record a decision through the API and keep its answer for the rerun."""
    key = f"decision:{a['node_id']}"
    try:
        out = (
            api.approve(a["study_id"], a["node_id"])
            if approve
            else api.reject(a["study_id"], a["node_id"], reason)
        )
    except (ApiError, Unreachable) as exc:
        ui.remember(key, "error", f"n{a['node_number']}: {exc}")
    else:
        verb = "approval" if approve else "rejection"
        then = (
            "the coordinator merges it into trunk next"
            if approve
            else f"reason: {out['reason'] or 'none given'}"
        )
        ui.remember(
            "decisions",
            "success",
            f"n{a['node_number']}: {verb} recorded by {out['decided_by']} (status {out['status']}) — {then}.",
        )
    st.rerun()


def evidence(api: Grove, a: Approval) -> dict[str, Any]:
    """Return the node an approval is about, read once per approval: it holds still while it waits."""
    key = f"approval-node:{a['id']}"
    if key not in st.session_state:
        st.session_state[key] = api.node(a["study_id"], a["node_id"])
    node: dict[str, Any] = st.session_state[key]
    return node


def card(api: Grove, a: Approval, study_name: str) -> None:
    """Show what the approver needs to decide on one node, and the two buttons."""
    n = evidence(api, a)
    with st.container(border=True):
        st.subheader(f"{ui.words(study_name)} · n{a['node_number']} · {ui.words(a['title'])}")
        ui.page_link(
            "node",
            f"{study_name} / n{a['node_number']} — open the node",
            study=a["study_id"],
            node=a["node_id"],
        )
        h = n["hypothesis"]
        if h.get("hypothesis") or h.get("mechanism"):
            st.markdown(
                f"**Hypothesis.** {ui.words(h.get('hypothesis') or '')}  \n**Mechanism.** {ui.words(h.get('mechanism') or '')}"
            )
        cost = n["cost"] or {}
        seconds = sum(r["duration"] for r in n["receipts"])
        held = f"{ui.fmt(a['heldout_gain'], True)} (margin {a['margin']:g})"
        st.markdown(
            "| dev (mean ± std, n) | dev gain vs trunk (95% LCB) | held-out gain vs margin | cost |\n"
            "|---|---|---|---|\n"
            f"| {ui.mean_std(n['dev_values'])} | {ui.fmt(a['dev_gain'], True)} ({ui.fmt(a['dev_gain_lcb'], True)}) "
            f"| {held} | ${cost.get('usd', 0.0):.3f} LLM · {seconds:.0f} s of runs |"
        )
        if a["constraints"]:
            st.dataframe(
                [
                    {
                        "constraint": v["name"],
                        "verdict": v["verdict"],
                        "value": v["value"],
                        "detail": v["detail"],
                    }
                    for v in a["constraints"]
                ],
                hide_index=True,
                width="stretch",
            )
        with st.expander("Diff"):
            st.code(n["diff"] or "(empty)", language="diff")
        left, mid, right = st.columns([1, 3, 1])
        with left.popover("Approve", type="primary"):
            st.write(
                f"Approve n{a['node_number']} of {study_name}? The coordinator merges it into trunk next; "
                "a merge is not undone."
            )
            if st.button("Yes, approve", key=f"approve-{a['node_id']}", type="primary"):
                decide(api, a, True)
        reason = mid.text_input(
            "Reason (for a rejection)",
            key=f"reason-{a['node_id']}",
            label_visibility="collapsed",
            placeholder="reason for rejecting",
        )
        with right.popover("Reject"):
            st.write(f"Reject n{a['node_number']}? It will not be merged, and its findings are withdrawn.")
            if st.button("Yes, reject", key=f"reject-{a['node_id']}", type="primary"):
                decide(api, a, False, reason)
        ui.recall(f"decision:{a['node_id']}")
