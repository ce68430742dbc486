"""Study: the tree growing live, scores over time, budget, improvement state, events, controls."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import NamedTuple

import streamlit as st
import streamlit.components.v1 as components

from client import ApiError, Grove, Unreachable
from client.models import NodeStatus, NodeSummary, RunKind, StopRule, Study, StudyStatus, Tree
from frontend import decisions, timeline, tree_explorer, ui, verdicts
from frontend.views.study_charts import improvement_state, node_pages, plots, scores, search_space

REFRESH = "3s"


def pick_study(api: Grove) -> int | None:
    sid = ui.query_int("study")
    if sid is not None:
        return sid
    studies = api.studies()
    if not studies:
        st.info("No studies yet.")
        ui.page_link("studies", "Create one on the Studies page")
        return None
    names = {s["id"]: f"{s['name']} (id {s['id']}, {s['status']})" for s in studies}
    chosen: int | None = st.selectbox("Study", list(names), format_func=names.__getitem__, key="pick_study")
    return chosen


def act(action: Callable[[], str], where: str = "controls") -> None:
    """Call the API and keep its answer for the rerun, to be shown at `where`."""
    try:
        ui.remember(where, "success", action())
    except ApiError as exc:
        fields = [
            f"{e.get('key') or e.get('loc') or 'input'}: {e.get('message') or e.get('msg')}"
            for e in exc.errors
        ]
        ui.remember(where, "error", "\n".join(fields) if fields else str(exc))
    except Unreachable as exc:
        ui.remember(where, "error", str(exc))
    st.rerun()


def controls(api: Grove, s: Study) -> None:
    sid, status = s["id"], s["status"]
    cols = st.columns(6)
    if cols[0].button(
        "Pause", key="pause", disabled=status not in (StudyStatus.CREATED, StudyStatus.RUNNING)
    ):
        act(lambda: f"paused: status is now {api.control(sid, 'pause')['status']}")
    if cols[1].button("Resume", key="resume", disabled=status != StudyStatus.PAUSED):
        act(lambda: f"resumed: status is now {api.control(sid, 'resume')['status']}")
    with cols[2].popover("Stop", disabled=status in (*ui.FINISHED, "stopping")):
        st.write("Stop the study? Running experiments are cancelled and it finishes with its trunk as it is.")
        if st.button("Yes, stop it", key="stop", type="primary"):
            act(lambda: f"stopping: status is now {api.control(sid, 'stop')['status']}")
    fresh = s["trunk_commit"] and s["trunk_commit"] != s["base_commit"]
    with cols[3].popover(
        "Promote",
        disabled=not fresh,
        help=None if fresh else "Trunk has nothing new: no change has been merged yet.",
    ):
        st.write(f"Push trunk ({s['trunk_commit'][:10]}) to the origin as branch `grove/{s['name']}`?")
        if st.button("Yes, promote", key="promote", type="primary"):
            act(lambda: api.promote(sid))
    cols[4].download_button(
        "REPORT.md",
        data=lambda: api.report(sid),
        file_name=f"{s['name']}-REPORT.md",
        mime="text/markdown",
        key="report",
    )
    ui.recall("controls")


def awaiting(api: Grove, s: Study) -> None:
    """Say which nodes wait for a decision, with everything needed to approve or reject them here."""
    pending = api.approvals(s["id"])
    for a in pending:
        spent = s["experiments_used"] >= s["experiments_budget"]
        then = (
            "The study is paused: it explores again once you resume it, decided or not."
            if s["status"] == StudyStatus.PAUSED
            else "Its experiment budget is spent: it finishes once you decide."
            if spent and s["status"] == StudyStatus.RUNNING
            else f"The study is {s['status']}: nothing else runs until you decide."
            if s["status"] != StudyStatus.RUNNING
            else "The study keeps exploring on the current trunk meanwhile."
        )
        st.warning(
            f"**Waiting for your decision on n{a['node_number']}** ({a['title']}): it passed the held-out gate. {then}"
        )
        decisions.card(api, a, s["name"])


def best_change(api: Grove, s: Study, t: Tree) -> None:
    """Answer first: the trusted best change (trunk's last merge) and the best candidate still in play."""
    nodes = t["nodes"]
    by_id = {n["id"]: n for n in nodes}
    trunk = by_id.get(t["trunk_node_id"] or -1)
    left, right = st.columns(2)
    with left.container(border=True, key="best-trusted"):
        st.markdown("**Trusted best change**")
        if trunk is None or trunk["parent_id"] is None:
            st.write("None yet: trunk is the repository as submitted. A change is trusted once it passes "
                     "the held-out gate and is merged.")  # fmt: skip
        else:
            n = api.node(s["id"], trunk["id"])
            lcb = verdicts.heldout_lcb(n)
            ui.page_link("node", f"n{n['number']} · {ui.words(n['title'][:70])}", study=s["id"], node=n["id"])
            st.markdown(
                f"held-out gain **{ui.fmt(n['heldout_gain'], True)}**"
                + (f" ({lcb[0]} lower bound {ui.fmt(lcb[1], True)})" if lcb is not None else "")
                + f" · dev gain {ui.fmt(n['gain'], True)}"
            )
            st.caption(ui.words(f"change: {verdicts.diff_summary(n)}"))
            for words in (verdicts.gate(n), verdicts.arex(n), n["fate"]):
                if words:
                    st.text(words)  # plain text: a reason may quote a model or a repository
    with right.container(border=True, key="best-in-play"):
        st.markdown("**Best candidate in play**")
        c = verdicts.in_play(nodes)
        if c is None:
            st.write("None: no measured change is waiting for the gate or a decision.")
        else:
            ui.page_link("node", f"n{c['number']} · {ui.words(c['title'][:70])}", study=s["id"], node=c["id"])
            st.markdown(
                f"dev gain **{ui.fmt(c['gain'], True)}** (LCB {ui.fmt(c['gain_lcb'], True)})"
                + (
                    f" · held-out gain {ui.fmt(c['heldout_gain'], True)}"
                    if c["heldout_gain"] is not None
                    else ""
                )
            )
            st.text(f"It {verdicts.waits_for(c)}.")


def budget(s: Study) -> None:
    used, total = s["experiments_used"], max(1, s["experiments_budget"])
    st.progress(
        min(1.0, used / total),
        text=f"budget units {used} / {s['experiments_budget']}: {s['experiments_run']} experiments, "
        f"{s['extra_dev_runs']} extra dev runs",
    )
    if s["started_at"]:
        start = datetime.fromisoformat(s["started_at"]).replace(tzinfo=UTC)
        end = (
            datetime.fromisoformat(s["finished_at"]).replace(tzinfo=UTC)
            if s["finished_at"]
            else datetime.now(UTC)
        )
        hours = (end - start).total_seconds() / 3600
    else:
        hours = 0.0
    st.progress(min(1.0, hours / s["budget_hours"]), text=f"hours {hours:.2f} / {s['budget_hours']:g}")
    usd_frac = s["llm_usd"] / s["budget_usd"] if s["budget_usd"] else 0.0
    st.progress(
        min(1.0, usd_frac),
        text=f"USD {s['llm_usd']:.3f} / {s['budget_usd']:.2f} ({s['llm_calls']} LLM calls)",
    )
    st.progress(
        min(1.0, s["running_jobs"] / max(1, s["parallel"])),
        text=f"running executors {s['running_jobs']} / {s['parallel']}",
    )


def events(api: Grove, sid: int, number: dict[int, int]) -> None:
    """Show the latest events as a timeline, newest first, one line each."""
    recent = list(reversed(api.events(sid, tail=30)))
    if not recent:
        st.caption("No event yet.")
        return
    with st.container(height=300, key="timeline"):
        st.text(timeline.lines(recent, number))


def tree(api: Grove, s: Study, t: Tree) -> None:
    """Draw the tree: zoom with the wheel, drag to pan, find a node, fold subtrees; click to open."""
    nodes = t["nodes"]
    st.caption(
        f"{len(nodes)} nodes · fill: dev gain, outline: status · hover a node for its fate, click it to open it"
    )
    height = 380 if len(nodes) <= 8 else 640
    page = tree_explorer.html(
        nodes, t["trunk_node_id"], node_pages(s["id"]), height=height, key=f"grove-tree-{s['id']}"
    )
    components.html(page, height=height)


def node_picker(s: Study, nodes: list[NodeSummary]) -> None:
    """Pick a node to open (type to filter)."""
    # A keyed selectbox keeps its pick while refreshes add nodes, as long as the picked option's
    # label is unchanged: so these labels leave out the status, which changes as a study runs.
    labels = {n["id"]: f"n{n['number']} · {n['title'][:60]}" for n in nodes}
    ids = list(labels)
    picked = st.session_state.get("picked_node")
    chosen = st.selectbox(
        "Open a node",
        ids,
        index=ids.index(picked) if picked in ids else 0,
        format_func=labels.__getitem__,
        key="open_node",
        help="The nodes as the page was loaded; click a node in the tree to open it straight away.",
    )
    st.session_state["picked_node"] = chosen
    if chosen is not None:
        ui.page_link("node", f"Open {labels[chosen].split(' · ')[0]} →", study=s["id"], node=chosen)


def steer(api: Grove, s: Study, nodes: list[NodeSummary]) -> None:
    if s["status"] in ui.FINISHED:
        st.caption(f"The study is {s['status']}: nothing more can be added or pruned.")
        return
    open_nodes = [n for n in nodes if n["status"] not in (NodeStatus.PRUNED, NodeStatus.CANCELLED)]
    labels = node_labels(open_nodes)
    with st.expander("Add a hypothesis under a node", expanded="msg:hyp" in st.session_state):
        with st.form("hypothesis", clear_on_submit=False):
            parent = st.selectbox(
                "Parent node", list(labels), format_func=labels.__getitem__, key="hyp_parent"
            )
            title = st.text_input("Title", key="hyp_title")
            mechanism = st.text_input("Mechanism", key="hyp_mechanism")
            hypothesis = st.text_area("Hypothesis", key="hyp_text", height=80)
            edits = st.text_area("Edits (JSON: search key → value)", key="hyp_edits", value="{}", height=80)
            submitted = st.form_submit_button("Add hypothesis")
        if submitted:
            try:
                body = {
                    "title": title,
                    "mechanism": mechanism,
                    "hypothesis": hypothesis,
                    "edits": json.loads(edits or "{}"),
                }
            except json.JSONDecodeError as exc:
                st.error(f"edits: not JSON ({exc.msg} at line {exc.lineno})")
            else:
                if parent is None:
                    st.error("parent: choose a node")
                else:
                    act(lambda: f"added n{api.add_hypothesis(s['id'], parent, body)['number']}", "hyp")
        ui.recall("hyp", keep=False)  # under the form it answers, which stays open
    with st.expander("Prune a node", expanded="msg:prune" in st.session_state):
        prunable = [i for i in labels if i != root_id(nodes)]
        target = st.selectbox("Node", prunable, format_func=labels.__getitem__, key="prune_node")
        reason = st.text_input("Reason", key="prune_reason")
        if st.button("Prune", key="prune") and target is not None:
            act(lambda: api.prune(s["id"], target, reason), "prune")
        ui.recall("prune", keep=False)


class Sort(NamedTuple):
    value: Callable[[NodeSummary], float | None]
    raw: bool = False  # the objective's own value (best first follows its direction), not a gain


SORTS: dict[str, Sort] = {
    "dev gain LCB": Sort(lambda n: n["gain_lcb"]),
    "dev gain": Sort(lambda n: n["gain"]),
    "dev mean": Sort(lambda n: n["dev_mean"], raw=True),
    "held-out gain": Sort(lambda n: n["heldout_gain"]),
}


def leaderboard(api: Grove, s: Study, nodes: list[NodeSummary]) -> None:
    """Rank the measured nodes (sort, filter by status) and compare up to five of them side by side."""
    measured = [n for n in nodes if n["parent_id"] is not None and n["dev_mean"] is not None]
    if not measured:
        st.caption("No node has been measured yet.")
        return
    left, right = st.columns([1, 2])
    by = left.selectbox("Sort by", list(SORTS), key="lb_sort")
    statuses = sorted({n["status"] for n in measured})
    shown = right.multiselect("Status", statuses, default=statuses, key="lb_status")
    value, raw = SORTS[by]
    sign = -1.0 if s["direction"] == "minimize" and raw else 1.0
    rows = sorted(
        (n for n in measured if n["status"] in shown),
        key=lambda n: (value(n) is None, -sign * (value(n) or 0.0), n["id"]),
    )
    st.table(
        [
            {
                "node": f"n{n['number']}",
                "change": n["title"][:70],
                "dev mean": ui.fmt(n["dev_mean"]),
                "dev gain (LCB)": f"{ui.fmt(n['gain'], True)} ({ui.fmt(n['gain_lcb'], True)})",
                "held-out gain": ui.fmt(n["heldout_gain"], True),
                "fate": n["fate"],
            }
            for n in rows[:50]
        ]
    )
    if len(rows) > 50:
        st.caption(f"the first 50 of {len(rows)}")
    compare(api, s, measured)


def compare(api: Grove, s: Study, measured: list[NodeSummary]) -> None:
    """Show up to five nodes side by side: scores, fate, their dev runs and their diffs."""
    if len(measured) < 2:
        return
    st.markdown("**Compare**")
    labels = {n["id"]: f"n{n['number']} · {n['title'][:50]}" for n in measured}
    picks = st.multiselect(
        "Nodes to compare (up to five)",
        list(labels),
        default=list(labels)[:2],
        format_func=labels.__getitem__,
        max_selections=5,
        key="cmp",
    )
    if not picks:
        return
    for col_, nid in zip(st.columns(len(picks)), picks, strict=True):
        n = api.node(s["id"], nid)
        with col_:
            st.markdown(f"**n{n['number']}** · {ui.words(n['title'])}")
            st.text(f"fate: {n['fate']}")
            st.markdown(
                f"dev {ui.mean_std(n['dev_values'])}  \n"
                f"dev gain {ui.fmt(n['gain'], True)} (LCB {ui.fmt(n['gain_lcb'], True)})  \n"
                f"held-out gain {ui.fmt(n['heldout_gain'], True)}"
            )
            runs = [(r["metrics"] or {}).get(s["metric"]) for r in n["receipts"] if r["kind"] == RunKind.DEV]
            st.caption(f"{len(runs)} dev runs: " + ", ".join(ui.fmt(v) for v in runs))
            st.code(n["diff"] or "(no change)", language="diff")


FIXES = {
    StopRule.BASELINE_DEV:
        "Run `grove validate` on the repository: the dev command must print its metrics as JSON on the base commit.",
    StopRule.BASELINE_TEST: "Run the test command by hand on the base commit, with the sealed files present.",
    StopRule.SETUP: "Check `[environment] setup` (its log is named above), then submit the study again.",
    StopRule.CLONE: "Check that the repository's URL is reachable from the server and the branch exists.",
}  # fmt: skip


def failed(s: Study) -> None:
    """Say, at the top, why the study failed and what fixes it."""
    reason = s["stop_reason"] or "no reason was recorded"
    fix = next((f for step, f in FIXES.items() if step == s["stop_rule"]), "")
    fix = fix or "Fix what the reason names and submit the study again."
    st.error(f"**This study failed.** {ui.words(reason)}\n\n**What to do:** {fix}")


def report(api: Grove, sid: int) -> None:
    """Render the study's REPORT.md (links and images as plain text: nothing is fetched from elsewhere)."""
    try:
        text = api.report(sid)
    except (ApiError, Unreachable) as exc:
        ui.show_error(exc)
        return
    st.html(ui.report_html(text))


def node_labels(nodes: Iterable[NodeSummary]) -> dict[int, str]:
    """Return a selectbox label for each node id."""
    return {n["id"]: f"n{n['number']} · {n['status']} · {n['title'][:60]}" for n in nodes}


def root_id(nodes: list[NodeSummary]) -> int | None:
    return next((n["id"] for n in nodes if n["parent_id"] is None), None)


def already_knew(api: Grove, s: Study) -> None:
    """Show what Grove already knew: the lab-memory entries this study's ideator is given."""
    try:
        entries = api.memory(s["id"])
    except (ApiError, Unreachable) as exc:
        ui.show_error(exc)
        return
    if not entries:
        st.caption("Nothing yet: no earlier study of this repository and objective has finished.")
        return
    for e in entries:
        effect = f" · dev effect {e['dev_effect']:+.4g}" if e["dev_effect"] is not None else ""
        st.text(f"M{e['id']}  {e['text']}")  # plain text: an entry's words came from a model
        st.caption(ui.words(f"{e['kind']} from {e['provenance']}{effect}"))


def page() -> None:
    api = ui.client()
    sid = pick_study(api)
    if sid is None:
        return
    s = api.study(sid)
    st.title(s["name"])
    st.caption(
        f"{s['status']}{' — ' + s['stop_reason'] if s['stop_reason'] else ''} · {s['policy']} policy · gate {s['gate_mode']} (margin {s['margin']:g}) · {s['goal']}"
    )
    if s["status"] == StudyStatus.FAILED:
        failed(s)
    controls(api, s)
    ui.recall("decisions")
    finished = s["status"] in ui.FINISHED

    @st.fragment(run_every=None if finished else REFRESH)
    def live() -> None:
        try:
            fresh = api.study(sid)
            t = api.tree(sid)
            progress = api.progress(sid)
        except (ApiError, Unreachable) as exc:
            ui.show_error(exc)
            return
        if (fresh["status"] in ui.FINISHED) != finished:
            st.rerun()
        best_change(api, fresh, t)
        awaiting(api, fresh)
        scores(fresh)
        left, right = st.columns([3, 1])
        with left:
            tree(api, fresh, t)
        with right:
            budget(fresh)
        plots(sid, progress)
        st.subheader("Improvement state")
        number = {n["id"]: n["number"] for n in t["nodes"]}
        improvement_state(fresh["improvement_state"], number)
        st.subheader("Recent events")
        events(api, sid, number)

    live()
    # Outside the refreshing part, so an open list is never redrawn under the pointer.
    nodes = api.tree(sid)["nodes"]
    node_picker(s, nodes)
    st.subheader("Leaderboard")
    leaderboard(api, s, nodes)
    st.subheader("Search space")
    search_space(api, s)
    if s["reads_memory"]:
        st.subheader("What Grove already knew")
        already_knew(api, s)
    st.subheader("Steer")
    steer(api, s, nodes)
    if finished:
        with st.expander("REPORT.md", expanded=False):
            report(api, sid)


ui.guarded(page)
