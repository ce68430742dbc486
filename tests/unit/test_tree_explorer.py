"""The dashboard's tree page, charts and verdict words, built from API rows."""

from __future__ import annotations

import json
import re
from typing import Any

from agents.policies.optuna_bridge import importances
from agents.policies.space import Space
from frontend import charts, tree_explorer, verdicts


def node(i: int, parent: int | None, status: str = "evaluated", **kw: Any) -> dict[str, Any]:
    row = {"id": i, "parent_id": parent, "number": i, "status": status, "title": f"change {i}", "gain": None,
           "gain_lcb": None, "heldout_gain": None, "fate": "", "rejection": "",
           "candidate": False}  # fmt: skip
    return {**row, **kw}


def test_each_way_a_node_ends_gets_its_own_mark() -> None:
    for rejection in ("human", "constraint", "gate", "dev"):
        assert tree_explorer.mark(node(2, 1, "rejected", rejection=rejection)) == rejection
    # The mark is the field, never the words: a fate that reads like another mark does not move it.
    assert tree_explorer.mark(node(2, 1, "rejected", fate="rejected by ada: no", rejection="gate")) == "gate"
    assert tree_explorer.mark(node(2, 1, "failed")) == "failed"
    assert tree_explorer.mark(node(2, 1, "pruned")) == "pruned"
    assert tree_explorer.mark(node(2, 1, "awaiting_approval")) == "waiting"
    assert tree_explorer.mark(node(2, 1, "evaluated")) == ""


def test_the_page_flags_the_trunk_path_and_a_hostile_title_stays_data() -> None:
    nodes = [node(1, None, "merged"), node(2, 1, "merged"), node(3, 2), node(4, 1)]
    nodes[3]["title"] = '</script><script>alert("x")</script>'
    page = tree_explorer.html(nodes, 2, "node?study=1&node=", key="grove-tree-1")
    assert page.count("</script>") == 2  # the data's and the drawing code's, nothing from a title
    payload = json.loads(re.search(r"const DATA = (.*?);</script>", page, re.S).group(1))  # type: ignore[union-attr]
    assert {n["id"]: n["k"] for n in payload["nodes"]} == {1: True, 2: True, 3: False, 4: False}
    assert payload["nodes"][3]["t"] == nodes[3]["title"] and payload["key"] == "grove-tree-1"
    assert not re.search(r"(src|href)=\"?https?:", page)  # nothing is fetched from elsewhere


def test_verification_in_words() -> None:
    accepted = node(5, 1, "merged", verification={"decision": "accept"},
                    constraints=[{"name": "size", "verdict": "satisfied", "detail": "1536 <= 2048"}],
                    gate_reason="held-out gain +0.0123 (95% lower bound +0.00412, n=3) > margin 0",
                    heldout_lcb=0.00412, heldout_level=0.95)  # fmt: skip
    assert verdicts.arex(accepted) == "accepted: every constraint holds (size); gain kept"
    assert verdicts.gate(accepted).startswith("passed the held-out gate: held-out gain +0.0123")
    assert verdicts.heldout_lcb(accepted) == ("95%", 0.00412)
    assert verdicts.heldout_lcb({**accepted, "heldout_lcb": 0.02, "heldout_level": 0.973}) == ("97.3%", 0.02)
    assert (
        verdicts.heldout_lcb({**accepted, "heldout_lcb": None, "heldout_level": None}) is None
    )  # words alone
    assert verdicts.gate({**accepted, "gate_reason": "passed: held-out gain +0.4"}) == (
        "passed the held-out gate: held-out gain +0.4"
    )
    refined = node(6, 1, "rejected", verification={"decision": "refine", "open_constraints": ["size"]},
                   constraints=[{"name": "size", "verdict": "violated", "detail": "4608 > 2048"}],
                   refined_as=[8, 9])  # fmt: skip
    assert verdicts.arex(refined) == "refined as n8, n9 because size: 4608 > 2048"
    assert (
        verdicts.arex({**refined, "refined_as": [], "fate": "refined as n8"})
        == "to be refined because size: 4608 > 2048"
    )
    assert verdicts.arex(node(7, 1)) == "" and verdicts.gate(node(7, 1)) == ""


def test_the_change_summary_and_the_candidate_in_play() -> None:
    diff = "--- a/config.toml\n+++ b/config.toml\n@@ -1 +1 @@\n-x = 0\n+x = 3\n"
    assert verdicts.diff_summary(
        {"diff_stats": {"files": 1, "insertions": 1, "deletions": 1}, "diff": diff}
    ) == ("1 file, +1 \u22121: config.toml")
    nodes = [node(1, None, "merged"), node(2, 1, gain=0.2, gain_lcb=0.1, candidate=True),
             node(3, 1, gain=0.3, gain_lcb=0.2, candidate=True),
             node(4, 1, gain=0.5, gain_lcb=-0.1, fate="not a gate candidate"),
             # The flag decides, not the words: a higher bound whose fate reads like a candidate's.
             node(6, 1, gain=0.9, gain_lcb=0.8, fate="gate candidate: dev LCB +0.8 > 0")]  # fmt: skip
    assert verdicts.in_play(nodes)["id"] == 3  # type: ignore[index]
    nodes.append(node(5, 1, "awaiting_approval", gain=0.05, heldout_gain=0.04))
    best = verdicts.in_play(nodes)
    assert (
        best is not None
        and best["id"] == 5
        and verdicts.waits_for(best).startswith("waits for your decision")
    )


def test_parallel_coordinates_draw_one_line_per_node_coloured_by_gain() -> None:
    points = [{"node_id": i, "node_number": i, "status": "evaluated", "dev": 0.9 + 0.01 * (i - 3),
               "values": {"a.x": i, "a.kind": "relu" if i % 2 else "tanh"}} for i in range(1, 6)]  # fmt: skip
    svg = charts.parallel(points, ["a.x", "a.kind"], "acc", 0.9, True, "node?study=1&node=")
    strokes = re.findall(r'<polyline points="([^"]+)" stroke="(#[0-9a-f]{6})"', svg)
    assert len(strokes) == 5 and all(len(p.split()) == 3 for p, _ in strokes)  # two keys and the score
    by_node = dict(zip(re.findall(r'data-node="(\d+)"', svg), (c for _, c in strokes), strict=True))
    assert by_node["1"] == charts.NEG and by_node["5"] == charts.POS  # worst red, best blue
    assert "node?study=1&amp;node=5" in svg and "relu" in svg and "tanh" in svg


def test_importance_credits_the_knob_that_drives_the_score() -> None:
    space = Space({"a": {"low": 0.0, "high": 1.0}, "b": {"low": 0.0, "high": 1.0}}, {"a": 0.5, "b": 0.5})
    measured = [
        ({"a": i / 19, "b": ((i * 7) % 19) / 19}, 3.0 * i / 19 + 0.01 * ((i * 7) % 3)) for i in range(20)
    ]
    found = importances(space, measured)
    assert set(found) == {"a", "b"} and found["a"] > 0.8 > found["b"]
    assert importances(space, measured[:2]) == {}  # too few to say
    bars = charts.importance(
        [{"key": k, "importance": v} for k, v in found.items()], "PED-ANOVA (Optuna)", 20
    )
    assert bars.count('class="bar"') == 2 and "over 20 measured nodes" in bars


def test_events_read_as_sentences() -> None:
    from frontend import timeline

    number = {41: 5}
    merged = {"time": "2026-12-06T10:11:12.5", "type": "node.merged", "node_id": 41, "payload": {"by": "ada"}}
    assert timeline.sentence(merged, number) == "10:11:12 · n5 merged into trunk (by ada)"
    odd = {
        "time": "2026-12-06T10:11:13",
        "type": "odd.thing_seen",
        "node_id": None,
        "payload": {"x": {"y": 1}},
    }
    assert timeline.sentence(odd, number) == "10:11:13 · odd thing seen"  # a type it has no words for
    gated = {"time": "2026-12-06T10:11:14", "type": "node.repeated", "node_id": 41,
             "payload": {"seeds": 4, "reason": "gain unclear at 2 seeds"}}  # fmt: skip
    assert timeline.sentence(gated, number) == (
        "10:11:14 · n5 more dev runs asked (reason gain unclear at 2 seeds; seeds 4)"
    )


def test_importance_takes_odd_values_in_its_stride() -> None:
    space = Space(
        {"wd": {"low": 1e-5, "high": 1e-1, "log": True}, "b": {"low": 0.0, "high": 1.0}},
        {"wd": 0.0, "b": 0.5},
    )
    measured: list[tuple[dict[str, Any], float]] = [
        ({"wd": 10 ** -(1 + i % 4), "b": i / 10}, float(i)) for i in range(10)
    ]
    measured += [
        ({"wd": 0.0, "b": 0.5}, 1.0),
        ({"wd": "high", "b": 0.2}, 2.0),
        ({"wd": 10**400, "b": 0.1}, 3.0),
    ]
    measured += [({"wd": 1e-3, "b": 0.3}, float("nan"))]
    found = importances(space, measured)
    assert set(found) == {"wd", "b"} and abs(sum(found.values()) - 1) < 1e-9
