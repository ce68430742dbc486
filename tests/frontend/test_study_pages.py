"""Study, Node and Approvals pages over a real study that waits for a human at the gate."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from streamlit.testing.v1.element_tree import Block

from backend.core import db
from backend.services.studies import create_study
from tests.frontend.conftest import Api, app_test, texts
from tests.support.repos import make_repo, tiny_files
from tests.support.waiting import wait_for


class Study:
    def __init__(self, api: Api, study_id: int) -> None:
        self.api, self.id = api, study_id
        self.http = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {api.approver}"})

    def get(self, path: str = "") -> Any:
        resp = self.http.get(f"/studies/{self.id}{path}")
        resp.raise_for_status()
        return resp.json()

    def pending(self) -> list[dict[str, Any]]:
        return list(self.http.get("/approvals", params={"study_id": self.id}).json()["data"])

    def node(self, node_id: int) -> dict[str, Any]:
        return dict(self.get(f"/nodes/{node_id}"))


@pytest.fixture(scope="module")
def study(api: Api, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Study]:
    """A tiny study in approve mode, run by the real workers until a node awaits approval.

    Another study is made first, so this one's node ids and node numbers differ (n1 is its root).
    """
    earlier = make_repo(tmp_path_factory.mktemp("pages") / "e", tiny_files(name="earlier"))
    with db.session(api.settings.db_url) as s:
        create_study(s, api.settings, (earlier / "grove.toml").read_text(), str(earlier))
    repo = make_repo(
        tmp_path_factory.mktemp("pages") / "r", tiny_files(name="pages", mode="approve", experiments=4)
    )
    resp = httpx.post(
        f"{api.url}/studies",
        json={"spec": (repo / "grove.toml").read_text(), "repository": str(repo)},
        headers={"Authorization": f"Bearer {api.approver}"},
    )
    assert resp.status_code == 201, resp.text
    st = Study(api, resp.json()["id"])
    root = st.get("/tree")["nodes"][0]
    assert root["number"] == 1 and root["id"] > 1

    def settled() -> bool:
        # The study explores while its approval waits; once its budget is spent it waits for the
        # decision with nothing running, so every page shows a study that holds still.
        s = st.get()
        return (
            bool(st.pending()) and s["experiments_used"] >= s["experiments_budget"] and s["running_jobs"] == 0
        )

    wait_for(settled, timeout=180)
    yield st
    st.http.close()


def texts_in(at: Any, key: str) -> str:
    """Return the words inside the container with `key`: text, markdown and link labels."""
    block = next(b for b in at.main if isinstance(b, Block) and key in b._block_id)
    parts = []
    for e in block:
        proto = getattr(e, "proto", None)
        for field in ("body", "label"):
            if proto is not None and isinstance(getattr(proto, field, None), str) and getattr(proto, field):
                parts.append(getattr(proto, field))
    return "\n".join(parts)


def tree_of(at: Any) -> dict[int, dict[str, Any]]:
    """Return the nodes the page's tree frame draws, by id."""
    page = next(e.proto.srcdoc for e in at.get("iframe") if "grove-tree-" in e.proto.srcdoc)
    data = json.loads(re.search(r"const DATA = (.*?);</script>", page, re.S).group(1))  # type: ignore[union-attr]
    return {n["id"]: n for n in data["nodes"]}


def test_study_page_shows_tree_scores_budget_state_and_events(api: Api, study: Study) -> None:
    before = {n["id"]: n["status"] for n in study.get("/tree")["nodes"]}
    at = app_test(api.url, api.approver, page="views/study.py", study=study.id)
    assert not at.exception, at.exception
    assert "pages" in at.title[0].value
    drawn = tree_of(at)
    tree = study.get("/tree")  # the study explores on while its approval waits: nodes move on
    assert len(tree["nodes"]) >= 3
    for n in tree["nodes"]:
        if n["id"] in before:
            assert drawn[n["id"]]["n"] == n["number"]
        if before.get(n["id"]) == n["status"]:  # unchanged while the page was drawn
            assert drawn[n["id"]]["s"] == n["status"]
    root = tree["nodes"][0]["id"]
    assert drawn[root]["s"] == "merged" and drawn[root]["k"]  # the root is on trunk's path
    # No change is trusted yet; the node waiting for approval is the best candidate in play.
    trusted, in_play = texts_in(at, "best-trusted"), texts_in(at, "best-in-play")
    assert "None yet: trunk is the repository as submitted" in trusted, trusted
    assert "waits for your decision" in in_play, in_play
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["baseline dev"] == f"{study.get()['baseline_dev']:.4f}"
    assert metrics["pending approvals"] == "1"
    bars = [p.proto.text for p in at.get("progress")]
    assert any(b.startswith("budget units ") and " experiments, " in b for b in bars) and any(
        b.startswith("running executors") for b in bars
    )
    events = next(t.value for t in at.text if " · " in t.value and "measured on dev" in t.value)
    assert "passed the held-out gate; waits for a human decision" in events
    assert "{" not in events  # words, not JSON
    assert "Verified findings" in texts(at) and "Next plan" in texts(at)
    charts = [c.proto.spec for c in at.get("vega_lite_chart")]
    assert len([c for c in charts if '"experiment"' in c]) == 2
    assert len([c for c in charts if '"title":"config.toml:knob.x"' in c.replace(" ", "")]) == 1
    # Stop and Promote ask first: their buttons sit behind a confirmation.
    assert at.button(key="stop").label == "Yes, stop it" and at.button(key="promote").label == "Yes, promote"


def test_the_leaderboard_sorts_filters_and_compares_up_to_five_nodes(api: Api, study: Study) -> None:
    at = app_test(api.url, api.viewer, page="views/study.py", study=study.id)
    assert not at.exception, at.exception
    measured = [
        n for n in study.get("/tree")["nodes"] if n["parent_id"] is not None and n["dev_mean"] is not None
    ]
    board = at.table[0].value
    by_lcb = sorted(measured, key=lambda n: (n["gain_lcb"] is None, -(n["gain_lcb"] or 0.0), n["id"]))
    assert list(board["node"]) == [f"n{n['number']}" for n in by_lcb]
    assert list(board["fate"]) == [n["fate"] for n in by_lcb]
    at.selectbox(key="lb_sort").set_value("dev mean").run()
    by_dev = sorted(measured, key=lambda n: (-n["dev_mean"], n["id"]))
    assert list(at.table[0].value["node"]) == [f"n{n['number']}" for n in by_dev]
    only = measured[0]["status"]
    at.multiselect(key="lb_status").set_value([only]).run()
    assert set(at.table[0].value["node"]) == {f"n{n['number']}" for n in measured if n["status"] == only}
    # Compare: the picked nodes' diffs, side by side, up to five.
    picked = [n["id"] for n in measured[:3]]
    at.multiselect(key="cmp").set_value(picked).run()
    diffs = [c.value.strip() for c in at.code if c.language == "diff"]
    assert diffs[-3:] == [(study.node(i)["diff"] or "(no change)").strip() for i in picked]
    assert diffs[-1] != diffs[-2]
    assert at.multiselect(key="cmp").proto.max_selections == 5


def test_the_search_space_gives_each_measured_node_its_whole_configuration(study: Study) -> None:
    space = study.get("/search")
    assert space["keys"] == ["config.toml:knob.x"] and space["metric"] == "score"
    tree = {n["id"]: n for n in study.get("/tree")["nodes"]}
    measured = {i for i, n in tree.items() if n["dev_mean"] is not None}
    assert {p["node_id"] for p in space["points"]} == measured
    for p in space["points"]:
        node = study.node(p["node_id"])
        x = node["edits"].get("config.toml:knob.x")
        if x is None:  # unchanged: the parent's value (the root's is the spec's base value, 0)
            parent = next((q for q in space["points"] if q["node_id"] == node["parent_id"]), None)
            x = parent["values"]["config.toml:knob.x"] if parent else 0
        assert p["values"] == {"config.toml:knob.x": x} and p["dev"] == node["dev_mean"]


def test_node_page_shows_evidence_diff_receipts_and_verdicts(api: Api, study: Study) -> None:
    card = study.pending()[0]
    node_id, number = card["node_id"], card["node_number"]
    detail = study.node(node_id)
    assert detail["number"] == number != node_id
    at = app_test(api.url, api.viewer, page="views/node.py", study=study.id, node=node_id)
    assert not at.exception, at.exception
    assert at.title[0].value.startswith(f"n{number} · ")
    diff = next(c.value for c in at.code if c.language == "diff")
    assert "config.toml" in diff and "+x = " in diff
    frames = [d.value for d in at.dataframe]
    receipts = next(f for f in frames if "seed" in f.columns).to_dict("records")
    assert len(receipts) == len(detail["receipts"]) and all(r["ok"] for r in receipts)
    verdicts = next(f for f in frames if "receipt" in f.columns).to_dict("records")
    assert verdicts[0]["constraint"] == "small" and verdicts[0]["verdict"] == "satisfied"
    # It waits for a decision: its page says so, with the card to decide right there.
    assert any(w.value.startswith(f"**n{number} waits for your decision**") for w in at.warning)
    # Approve and Reject both ask first: their buttons sit behind a confirmation.
    assert [b.label for b in at.button if b.label.startswith("Yes, ")] == ["Yes, approve", "Yes, reject"]
    assert any(t.value == f"Fate: {detail['fate']}" for t in at.text)
    words = [t.value for t in at.text]
    assert "accepted: every constraint holds (small); gain kept" in words  # AREX's call in words
    assert any(w.startswith("passed the held-out gate: held-out gain +") for w in words), words
    history = next(t.value for t in at.text if " · n" in t.value and "proposed" in t.value).splitlines()
    assert history[0].endswith(f"n{number} proposed") or f"n{number} proposed (" in history[0], history
    assert any("passed the held-out gate; waits for a human decision" in h for h in history)


def test_pause_and_resume_from_the_study_page(api: Api, study: Study) -> None:
    at = app_test(api.url, api.approver, page="views/study.py", study=study.id)
    at.button(key="pause").click().run()
    assert any("paused" in s.value for s in at.success), texts(at)
    assert study.get()["status"] == "paused"
    at.button(key="resume").click().run()
    assert any("resumed" in s.value for s in at.success), texts(at)
    assert study.get()["status"] == "running"


def test_steer_adds_a_hypothesis_and_prunes_it(api: Api, study: Study) -> None:
    at = app_test(api.url, api.approver, page="views/study.py", study=study.id)
    at.text_input(key="hyp_title").input("try x=2 from the dashboard")
    at.text_area(key="hyp_edits").input('{"config.toml:knob.x": 2}')
    next(b for b in at.button if b.label == "Add hypothesis").click().run()
    added = next(s.value for s in at.success if s.value.startswith("added n"))
    number = int(added.removeprefix("added n"))
    new_id = next(n["id"] for n in study.get("/tree")["nodes"] if n["number"] == number)
    assert study.node(new_id)["origin"] == "human"

    bad = app_test(api.url, api.approver, page="views/study.py", study=study.id)
    bad.text_input(key="hyp_title").input("broken")
    bad.text_area(key="hyp_edits").input('{"config.toml:knob.nope": 2}')
    next(b for b in bad.button if b.label == "Add hypothesis").click().run()
    assert any("edits.config.toml:knob.nope" in e.value for e in bad.error), texts(bad)
    # The error sits under the form it answers, in its expander (not at the top of the page).
    form = next(x for x in bad.expander if x.label == "Add a hypothesis under a node")
    assert any("edits.config.toml:knob.nope" in e.value for e in form.error)

    pruning = app_test(api.url, api.approver, page="views/study.py", study=study.id)
    assert any(o.startswith(f"n{number} · ") for o in pruning.selectbox(key="prune_node").options)
    pruning.selectbox(key="prune_node").set_value(new_id)
    pruning.text_input(key="prune_reason").input("not needed")
    pruning.button(key="prune").click().run()
    assert any(s.value == f"pruned n{number}" for s in pruning.success), texts(pruning)
    assert study.node(new_id)["status"] == "pruned"


def test_approvals_need_the_approver_role_and_merge_the_node(api: Api, study: Study) -> None:
    node_id, number = study.pending()[0]["node_id"], study.pending()[0]["node_number"]
    viewer = app_test(api.url, api.viewer, page="views/approvals.py")
    assert f"n{number} · " in texts(viewer)
    viewer.button(key=f"approve-{node_id}").click().run()
    assert any("approver" in e.value for e in viewer.error), texts(viewer)
    assert study.node(node_id)["status"] == "awaiting_approval"

    at = app_test(api.url, api.approver, page="views/approvals.py")
    card = next(m.value for m in at.markdown if "held-out gain vs margin" in m.value)
    gain = study.node(node_id)["heldout_gain"]
    assert f"| {gain:+.4f} (margin 0.5) |" in card
    at.button(key=f"approve-{node_id}").click().run()
    assert any(f"n{number}: approval recorded by dashboard-test" in s.value for s in at.success), texts(at)
    wait_for(lambda: study.node(node_id)["status"] == "merged", timeout=60)
    page = app_test(api.url, api.viewer, page="views/study.py", study=study.id)
    drawn = tree_of(page)
    assert drawn[node_id]["s"] == "merged" and drawn[node_id]["k"]
    # The merged node is the trusted best change, linked from the first thing the page shows.
    trusted = texts_in(page, "best-trusted")
    assert (
        f"n{number} · " in trusted and "held-out gain" in trusted and "passed the held-out gate" in trusted
    ), trusted


def test_a_failed_study_says_why_and_what_fixes_it_and_its_report_is_rendered(
    api: Api, tmp_path_factory: pytest.TempPathFactory
) -> None:
    files = tiny_files(name="broken")
    files["eval.py"] = "import sys\nsys.exit('no metrics today')\n"
    repo = make_repo(tmp_path_factory.mktemp("failed") / "r", files)
    http = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {api.approver}"})
    resp = http.post("/studies", json={"spec": (repo / "grove.toml").read_text(), "repository": str(repo)})
    assert resp.status_code == 201, resp.text
    sid = resp.json()["id"]
    wait_for(lambda: http.get(f"/studies/{sid}").json()["status"] == "failed", timeout=120)
    at = app_test(api.url, api.viewer, page="views/study.py", study=sid)
    assert not at.exception, at.exception
    banner = at.error[0].value
    assert (
        banner.startswith("**This study failed.**")
        and "dev evaluation fails on the unchanged repository" in banner
    )
    assert "`grove validate`" in banner
    report = http.get(f"/studies/{sid}/report").text
    heading = next(line for line in report.splitlines() if line.startswith("# "))
    assert any(heading.removeprefix("# ") in h.proto.body for h in at.get("html")), "REPORT.md is rendered"
    http.close()


def test_a_report_renders_no_image_or_link_that_would_fetch_from_elsewhere() -> None:
    from frontend.ui import report_html

    text = "# R\n![x](http://evil.example/p.png) see [docs](https://evil.example/) <https://evil.example/a> <b>hi</b>"
    out = report_html(text)
    assert "<img" not in out and "<a " not in out and "<b>" not in out and "href" not in out
    assert "<h1>R</h1>" in out and "[docs](https://evil.example/)" in out


def test_model_written_words_show_as_written_in_markdown() -> None:
    from markdown_it import MarkdownIt

    from frontend.ui import words

    text = ("![x](http://evil.example/p.png) [docs](https://evil.example/) https://evil.example/a www.evil.example "
            "me@evil.example <img src=x> $x^2$ :red[loud] *b* `c` Grove's 0.5\n# not a heading\n- not a list")  # fmt: skip
    html = MarkdownIt("commonmark").enable("table").render(words(text))
    assert "<img" not in html and "<a" not in html and "<h1" not in html and "<li" not in html
    assert "<em>" not in html and "<code>" not in html
    assert "![x](http:\u2060//evil.example/p.png)" in html and "Grove's 0.5" in html


def test_live_output_shows_stderr_while_a_run_says_nothing_on_stdout(
    api: Api, tmp_path_factory: pytest.TempPathFactory
) -> None:
    files = tiny_files(
        name="quiet", experiments=1, sleep=60
    )  # stopped once seen: the page is drawn meanwhile
    files["eval.py"] = files["eval.py"].replace(
        "time.sleep(", "print(f'loading shard {seed}', file=sys.stderr, flush=True)\ntime.sleep("
    )
    repo = make_repo(tmp_path_factory.mktemp("quiet") / "r", files)
    headers = {"Authorization": f"Bearer {api.approver}"}
    resp = httpx.post(
        f"{api.url}/studies", json={"spec": files["grove.toml"], "repository": str(repo)}, headers=headers
    )
    assert resp.status_code == 201, resp.text
    st = Study(api, resp.json()["id"])

    def quiet_node() -> int | None:
        for n in st.get("/tree")["nodes"]:
            if n["status"] == "running" and n["parent_id"] is not None:
                out = st.get(f"/nodes/{n['id']}/live?stream=stderr")
                if "loading shard" in out["tail"] and not st.get(f"/nodes/{n['id']}/live")["tail"]:
                    return int(n["id"])
        return None

    nid = wait_for(quiet_node, timeout=120, every=0.2)
    at = app_test(api.url, api.viewer, page="views/node.py", study=st.id, node=nid)
    assert not at.exception, at.exception
    assert any("nothing on stdout yet; the tail of stderr" in c.value for c in at.caption), texts(at)
    assert any("loading shard" in c.value for c in at.code)
    httpx.post(f"{api.url}/studies/{st.id}/stop", headers=headers)
