"""Approvals: one card per gate-passed node waiting for a human, with Approve and Reject."""

from __future__ import annotations

import streamlit as st

from client import ApiError, Unreachable
from client.models import ApprovalStatus
from frontend import decisions, ui

REFRESH = "5s"


def page() -> None:
    st.title("Approvals")
    api = ui.client()
    ui.recall("decisions")
    names = {s["id"]: s["name"] for s in api.studies()}
    only = ui.query_int("study")
    choices: list[int | None] = [None, *names]
    study_id = st.selectbox(
        "Study",
        choices,
        index=choices.index(only) if only in names else 0,
        format_func=lambda sid: "all studies" if sid is None else f"{names[sid]} (id {sid})",
        key="approvals_study",
    )

    @st.fragment(run_every=REFRESH)
    def waiting() -> None:
        try:
            pending = api.approvals(study_id)
        except (ApiError, Unreachable) as exc:
            ui.show_error(exc)
            return
        if not pending:
            st.info("Nothing is waiting for approval.")
        for a in pending:
            decisions.card(api, a, names.get(a["study_id"], str(a["study_id"])))

    waiting()
    decided = [a for a in api.approvals(study_id, state="all") if a["status"] != ApprovalStatus.PENDING]
    if decided:
        st.subheader("Decided")
        st.dataframe(
            [
                {
                    "node": f"n{a['node_number']}",
                    "study": names.get(a["study_id"]),
                    "title": a["title"],
                    "status": a["status"],
                    "by": a["decided_by"],
                    "reason": a["reason"],
                    "at": (a["decided_at"] or "")[:19],
                }
                for a in reversed(decided)
            ],
            hide_index=True,
            width="stretch",
        )


ui.guarded(page)
