"""REPORT.md: baseline → final on dev and held-out, merged nodes, tree summary, state, cost."""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

from sqlmodel import Session, col, select

from backend.core import db
from backend.core.config import Settings
from backend.core.models import Event, Job, Node, ReceiptRow, Study
from backend.services import fates
from backend.services.records import spec_of


def _m(values: list[float]) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f} (n={len(values)})"


SANDBOX = {
    "bwrap": "namespaces (bubblewrap)",
    "none": "**unsandboxed** (GROVE_SANDBOX=none): evaluations and executor commands ran as Grove's own "
    "user, with access to its data, keys and network",
    "unknown": "not recorded (the study predates sandboxing: assume unsandboxed)",
}


def _cell(text: str) -> str:
    """Return text fit for one cell of a Markdown table."""
    return " ".join(text.split()).replace("|", "\\|")


def render(s: Session, study_id: int) -> str:
    """Return the study's report as Markdown."""
    st = s.get(Study, study_id)
    assert st is not None
    nodes = list(s.exec(select(Node).where(Node.study_id == study_id).order_by(col(Node.id))))
    jobs = list(s.exec(select(Job).where(Job.study_id == study_id, Job.kind == "experiment")))
    receipts = list(s.exec(select(ReceiptRow).where(ReceiptRow.study_id == study_id)))
    events = list(s.exec(select(Event).where(Event.study_id == study_id)))
    spec = spec_of(st)
    metric = spec.objective.metric
    merged = [n for n in nodes if n.status == "merged" and n.parent_id is not None]
    counts = Counter(n.status for n in nodes if n.parent_id is not None)
    dur = (st.finished_at - st.started_at).total_seconds() if st.finished_at and st.started_at else 0.0
    eval_seconds = sum(r.duration for r in receipts)
    lines = [
        f"# Grove report: {st.name}",
        "",
        f"**Goal:** {st.goal}  ",
        f"**Objective:** {spec.objective.direction} `{metric}`  ",
        f"**Status:** {st.status} — {st.stop_reason or 'running'}  ",
        f"**Policy:** {spec.policy_kind} · **gate:** {spec.gate.mode}, margin {spec.gate.margin:g}, "
        f"{spec.gate.test_repeats} test repeats",
        "**Sandbox:** " + SANDBOX.get(st.sandbox, SANDBOX["unknown"]) + "  ",
        "",
        "## Baseline → final",
        "",
        "| split | baseline | final trunk |",
        "|---|---|---|",
        f"| dev ({spec.evaluate.repeats} seeds) | {_m(st.baseline_dev)} | {_m(st.trunk_dev)} |",
        f"| held-out ({spec.gate.test_repeats} seeds) | {_m(st.baseline_heldout)} | {_m(st.trunk_heldout)} |",
        "",
        f"Trunk: `{st.trunk_branch}` at `{st.trunk_commit[:12]}` (base `{st.base_commit[:12]}`).  ",
        f"Sealed split queried {st.test_queries} of at most {spec.gate.max_test_runs + 1} times "
        "(the baseline measurement included).",
        "",
        "## Merged nodes",
        "",
    ]
    if merged:
        lines += ["| node | change | dev gain (LCB) | held-out gain |", "|---|---|---|---|"]
        for n in merged:
            lines.append(
                f"| n{n.number} | {n.title} | {n.gain or 0:+.4f} ({n.gain_lcb or 0:+.4f}) | {n.heldout_gain or 0:+.4f} |"
            )
    else:
        lines.append("No change cleared the held-out gate.")
    lines += [
        "",
        "## Tree",
        "",
        f"{len(nodes) - 1} hypotheses: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + ".  ",
        f"{len(jobs)} experiments of a budget of {spec.budget.experiments}; wall time {dur:.0f} s; "
        f"{eval_seconds:.0f} s spent in evaluations ({len(receipts)} runs).",
        "",
    ]
    ranked = sorted(
        (n for n in nodes if n.gain is not None),
        key=lambda n: -(n.gain_lcb if n.gain_lcb is not None else -1e9),
    )
    shown = f"The {min(10, len(ranked))} measured nodes with the highest gain LCB" + (
        f" (of {len(ranked)}; every node is in the API's tree and the dashboard):"
        if len(ranked) > 10
        else ":"
    )
    lines += [
        shown,
        "",
        "| node | parent | change | dev mean | gain (LCB) | fate |",
        "|---|---|---|---|---|---|",
    ]
    fate = {k: _cell(v) for k, v in fates.study_fates(s, st).items()}
    number = {n.id: n.number for n in nodes}
    for n in ranked[:10]:
        lines.append(
            f"| n{n.number} | n{number.get(n.parent_id, '?')} | {n.title} | {n.dev_mean:.4f} | "
            f"{n.gain:+.4f} ({n.gain_lcb:+.4f}) | {fate[n.id or 0]} |"
        )
    turned = [n for n in nodes if n.status == "rejected" and n.status_by and n.status_by != "auto"]
    if turned:
        lines += [
            "",
            "Turned down by a human: " + "; ".join(f"n{n.number} ({fate[n.id or 0]})" for n in turned) + ".",
        ]
    gated = [n for n in nodes if n.gated]
    if gated:
        lines += ["", "## Gate decisions", "", "| node | outcome | held-out gain |", "|---|---|---|"]
        for n in gated:
            hg = "n/a" if n.heldout_gain is None else f"{n.heldout_gain:+.4f}"
            lines.append(f"| n{n.number} | {n.gate_reason} | {hg} |")
    lines += predictions(nodes)
    state = st.improvement_state or {}
    lines += ["", "## Improvement state", ""]
    for f in state.get("verified_findings", []):
        cited = ", ".join(f"n{number.get(i, '?')}" for i in f["node_ids"])
        lines.append(f"- finding ({cited}): {f['text']}")
    for c in state.get("open_constraints", []):
        lines.append(f"- open constraint {c['name']}: {c['status']} — {c['detail']}")
    for c in state.get("concerns", []):
        lines.append(f"- concern: {c}")
    for p in state.get("next_plan", []):
        lines.append(f"- next: {p}")
    llm = [e for e in events if e.type == "llm.call"]
    usd = sum(float(e.payload.get("usd", 0)) for e in llm)
    tokens = sum(int(e.payload.get("tokens", 0)) for e in llm)
    lines += [
        "",
        "## Cost",
        "",
        f"LLM: {len(llm)} calls, {tokens} tokens, ${usd:.4f}. Compute: {eval_seconds:.0f} s of evaluation.",
        "",
    ]
    return "\n".join(lines)


def predictions(nodes: list[Node]) -> list[str]:
    """Return the ideator's predicted dev gain beside the realised one, for each measured llm proposal."""
    rows = []
    for n in nodes:
        said = n.hypothesis.get("expected_gain")
        if said is None or n.gain is None:
            continue
        try:
            predicted = float(said)
        except ValueError:
            continue
        rows.append(f"| n{n.number} | {_cell(n.title)} | {predicted:+.4g} | {n.prior:+.4g} | {n.gain:+.4g} |")
    if not rows:
        return []
    head = ["", "## Predicted vs realised dev gain", "",
            "The ideator's `expected_gain`, the prior selection used after clipping and shrinking it, and the "
            "dev gain the node realised (positive is better).", "",
            "| node | hypothesis | predicted | prior used | realised |", "|---|---|---|---|---|"]  # fmt: skip
    return head + rows


def write(settings: Settings, study_id: int) -> Path:
    """Write REPORT.md under the data directory and return its path."""
    with db.session(settings.db_url) as s:
        st = s.get(Study, study_id)
        assert st is not None
        text = render(s, study_id)
    path = (settings.data_dir / "reports" / st.name / "REPORT.md").resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, "utf-8")
    return path
