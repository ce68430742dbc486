"""Node fates: one line per case, computed in one place."""

from __future__ import annotations

from agents.tree.fate import Facts, Rejection, candidate, fate, rejection


def test_each_fate_reads_as_one_line() -> None:
    cases = {
        Facts("merged", by="ada"): "merged by ada",
        Facts("merged", by="auto"): "merged by auto",
        Facts("merged"): "merged into trunk",  # merged before who merged was recorded
        Facts("merged", is_root=True): "the baseline: trunk at the study's start",
        Facts("rejected", reason="too risky", by="ada", gated=True, gate_reason="passed"): "rejected by ada: too risky",
        Facts("evaluated", gain_lcb=-0.003, decision="reject"): "not a gate candidate: dev LCB \u22120.003 \u2264 0",
        Facts("evaluated", gain_lcb=0.01, min_gain=0.02, decision="reject"): "not a gate candidate: dev LCB +0.01 \u2264 0.02",
        Facts("rejected", decision="refine", open_constraints=("size",), refined_as=(7,)): "constraint size open \u2192 refined as n7",
        Facts("rejected", decision="refine", open_constraints=("size", "ram")): "constraints size, ram open \u2192 to be refined",
        Facts("failed", failure="exited with code 1"): "failed: exited with code 1",
        Facts("pruned", reason="its last 3 children did not improve"): "pruned: its last 3 children did not improve",
        Facts("pruned", reason="not worth it", by="ada"): "pruned by ada: not worth it",
        Facts("rejected", gated=True, gate_reason="failed: held-out gain 0.1 below margin 0.5"): "held-out gate: failed: held-out gain 0.1 below margin 0.5",
        Facts("rejected", reason="trunk moved since the gate ran"): "rejected: trunk moved since the gate ran",
        Facts("awaiting_approval"): "passed the held-out gate; waiting for a human decision",
        Facts("cancelled", reason="the study was stopped before a decision"): "cancelled: the study was stopped before a decision",
        Facts("evaluated", gain_lcb=0.2, decision="accept"): "gate candidate: dev LCB +0.2 > 0",
        Facts("evaluated", gain_lcb=0.2, decision="accept", on_trunk=False): "not a gate candidate: dev LCB +0.2 on the older trunk it was built on",
        Facts("evaluated", gain_lcb=0.2, decision="accept", on_trunk=False, revisited_as=(7,)): "dev LCB +0.2 on the older trunk it was built on \u2192 measured again on a newer trunk as n7",
        Facts("running"): "running",
    }  # fmt: skip
    for facts, line in cases.items():
        assert fate(facts) == line, facts
        assert "\n" not in line
        # The flag the dashboard reads agrees with the words, on every case.
        assert candidate(facts) == line.startswith("gate candidate"), facts
    assert candidate(Facts("evaluated", gain_lcb=0.2, decision="", min_gain=0.1))
    assert not candidate(Facts("evaluated", gain_lcb=0.2, gated=True, gate_reason="failed"))


def test_each_rejection_is_told_from_fields_and_agrees_with_the_fate() -> None:
    cases = {
        Facts("rejected", reason="too risky", by="ada", gated=True, gate_reason="passed"): Rejection.HUMAN,
        Facts(
            "rejected", decision="refine", open_constraints=("size",), refined_as=(7,)
        ): Rejection.CONSTRAINT,
        Facts("rejected", decision="restart", open_constraints=("size", "ram")): Rejection.CONSTRAINT,
        Facts(
            "rejected", gated=True, gate_reason="failed: held-out gain 0.1 below margin 0.5"
        ): Rejection.GATE,
        Facts("rejected", reason="trunk moved since the gate ran"): Rejection.DEV,
        Facts("rejected", by="auto", failure="a protected file changed"): Rejection.DEV,
        Facts("rejected"): Rejection.CONSTRAINT,  # its fate: "rejected: constraints not met"
    }
    words = {Rejection.HUMAN: "rejected by ", Rejection.CONSTRAINT: "constraint", Rejection.GATE: "held-out gate: ",
             Rejection.DEV: "rejected: "}  # fmt: skip
    for facts, want in cases.items():
        assert rejection(facts) == want, facts
        assert words[want] in fate(facts), facts
    assert rejection(Facts("evaluated", gated=True, gate_reason="passed")) is None
    assert rejection(Facts("rejected", is_root=True)) is None
