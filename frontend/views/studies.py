"""Studies: the list, and the form that creates a study."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import streamlit as st

from client import ApiError, Unreachable
from frontend import ui

ROOT = Path(__file__).resolve().parents[2]


def templates() -> dict[str, str]:
    """Return the spec templates the form offers."""
    out = {"minimal": (ROOT / "frontend/templates/minimal.toml").read_text()}
    example = ROOT / "examples/digits/grove.toml"
    if example.is_file():
        out["digits example"] = example.read_text()
    return out


def study_list() -> None:
    studies = ui.client().studies()
    st.subheader(f"Studies ({len(studies)})")
    if not studies:
        st.info("No studies yet: create one below, or `grove submit path/to/repo`.")
        return
    usd = any(s["budget_usd"] for s in studies)
    rows = []
    for s in studies:
        gain = (
            s["trunk_heldout"] - s["baseline_heldout"]
            if s["trunk_heldout"] is not None and s["baseline_heldout"] is not None
            else None
        )
        row = {
            "study": s["name"],
            "status": s["status"],
            "to approve": s["pending_approvals"] or "",
            "best dev": ui.fmt(s["best_dev"]),
            "trunk held-out": ui.fmt(s["trunk_heldout"]) + (f" ({ui.fmt(gain, True)})" if gain else ""),
            "budget": f"{s['experiments_used']}/{s['experiments_budget']}",
        }
        if usd:
            row["USD"] = f"{s['llm_usd']:.2f}/{s['budget_usd']:.2f}"
        rows.append(row)
    st.caption("Click a row to open its study.")
    picked = st.dataframe(
        rows,
        hide_index=True,
        width="stretch",
        on_select="rerun",
        selection_mode="single-row",
        key="studies_table",
    )
    # A row's place is in the list as it was drawn: a study created since then shifts the rows.
    drawn = st.session_state.get("studies_drawn") or [s["id"] for s in studies]
    st.session_state["studies_drawn"] = [s["id"] for s in studies]
    chosen = picked.selection.rows if picked is not None else []
    if chosen and chosen[0] < len(drawn):
        st.switch_page(ui.PAGES["study"], query_params={"study": str(drawn[chosen[0]])})
    waiting = [s for s in studies if s["pending_approvals"]][:12]
    if waiting:
        cols = st.columns(min(4, len(waiting)))
        for i, s in enumerate(waiting):
            with cols[i % len(cols)]:
                ui.page_link("study", f"{s['name']}: {s['pending_approvals']} to approve", study=s["id"])


def new_study_form() -> None:
    st.subheader("New study")
    repository = st.text_input(
        "Repository", key="repository", placeholder="/path/on/the/server or https://host/repo.git"
    )
    repo_msg = st.empty()
    draft_from_goal(repository, repo_msg)
    options = templates()
    template = st.selectbox("…or start from a template", list(options), key="template")
    upload = st.file_uploader("…or upload a grove.toml", type=["toml"], key="upload")
    source = ("upload", upload.file_id) if upload is not None else ("template", template)
    if st.session_state.get("spec_source") != source:
        st.session_state.spec_source = source
        st.session_state.spec_text = (
            upload.getvalue().decode("utf-8", "replace") if upload is not None else options[template]
        )
        st.session_state.pop("draft_notes", None)
        st.session_state.pop("draft_files", None)
    spec = st.text_area("grove.toml", key="spec_text", height=440)
    if st.session_state.get("draft_notes"):
        with st.expander("Why Grove chose each line of this draft", expanded=True):
            st.text("\n".join(f"- {n}" for n in st.session_state.draft_notes))  # a model's words: plain text
    if st.session_state.get("draft_files"):
        added = st.session_state.draft_files
        with st.expander(f"Files this draft needs in the repository ({len(added)})"):
            st.caption(
                "Commit these beside grove.toml before creating the study (`grove init PATH --commit` on the "
                "server writes and commits them)."
            )
            for path, text in sorted(added.items()):
                st.download_button(
                    f"Save {ui.words(path)}", text, file_name=path.rsplit("/", 1)[-1], key=f"save:{path}"
                )
    spec_msg = st.empty()
    left, right, _ = st.columns([1, 1, 4])
    check = left.button("Validate", key="validate")
    create = right.button("Create study", key="create", type="primary")
    if not (check or create):
        ui.recall("create")
        return
    st.session_state.pop("msg:create", None)
    missing = False
    if not repository.strip():
        repo_msg.error("repository: give a path on the server or a git URL")
        missing = True
    if not spec.strip():
        spec_msg.error("spec: the grove.toml is empty")
        missing = True
    if missing:
        return
    api = ui.client()
    try:
        if check:
            spec_msg.success(api.validate(spec, repository.strip()))
            return
        made = api.create(spec, repository.strip())
    except ApiError as exc:
        repo_errors, spec_errors = exc.for_field("repository"), exc.for_field("spec")
        if repo_errors:
            repo_msg.error("\n\n".join(repo_errors))
        if spec_errors:
            spec_msg.error("\n\n".join(spec_errors))
        if not (repo_errors or spec_errors):
            ui.show_error(exc)
        return
    except Unreachable as exc:
        ui.show_error(exc)
        return
    ui.remember("create", "success", f"Created study {made['name']!r} (id {made['id']}); it is starting.")
    st.session_state.created_study = made["id"]
    st.rerun()


def draft_from_goal(repository: str, repo_msg: Any) -> None:
    """Draft the grove.toml below from a goal in words and the repository (Grove's analysis, and a model if set)."""
    goal = st.text_area(
        "Goal in words", key="goal_text", height=80,
        placeholder="e.g. Raise held-out accuracy of the classifier without making it slower",
    )  # fmt: skip
    left, right = st.columns([1, 2])
    use_model = right.checkbox(
        "Ask the service's model too (it reads the evaluator, configs and README; never sealed files)",
        value=True, key="draft_model",
    )  # fmt: skip
    if not left.button("Draft grove.toml from the goal", key="draft"):
        return
    if not repository.strip():
        repo_msg.error("repository: give a path on the server or a git URL to draft from")
        return
    try:
        made = ui.client().draft(repository.strip(), goal, use_model)
    except ApiError as exc:
        repo_errors = exc.for_field("repository")
        if repo_errors:
            repo_msg.error("\n\n".join(repo_errors))
        else:
            ui.show_error(exc)
        return
    except Unreachable as exc:
        ui.show_error(exc)
        return
    st.session_state.spec_text = made["spec"]
    st.session_state.draft_notes = made["notes"]
    st.session_state.draft_files = made.get("files") or {}
    by = (
        f" with {made['model']}"
        if made.get("model")
        else " from Grove's own analysis (no model asked)"
        if not use_model
        else " from Grove's own analysis: no model is configured on this service (GROVE_MODEL)"
    )
    ui.remember("create", "info", f"Drafted grove.toml{by}: read it, edit it, Validate, then Create study.")
    st.rerun()


st.title("Grove studies")
ui.guarded(study_list)
if st.session_state.get("created_study"):
    ui.page_link("study", "Open the new study →", study=st.session_state.created_study)
ui.guarded(new_study_form)
