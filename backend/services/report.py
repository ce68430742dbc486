"""REPORT.md: baseline → final on dev and held-out, merged nodes, tree summary, state, cost."""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

from sqlmodel import Session, col, select

from agents.failures import Blame
from agents.spec import Spec
from agents.tree.status import NodeStatus, StopRule, StudyStatus
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Event, Node, ReceiptRow, Study
from backend.services import fates
from backend.services.records import spec_of
from backend.services.storage import BudgetSpent, budget_spent


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


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def budget_line(spent: BudgetSpent, budget: int) -> str:
    """Return the experiment budget's units spent, and what they went on: experiments and extra dev runs."""
    line = f"{spent.units} of {budget} units spent: {_n(spent.experiments, 'experiment')}, " + _n(
        spent.extra_runs, "extra dev run"
    )
    if spent.extra_runs:
        line += f" (adaptive repeats: every {spent.repeats} cost a unit"
        left = spent.extra_runs % spent.repeats
        line += f"; {left} not yet charged)" if left else ")"
    return line


def ending(st: Study, spec: Spec, events: list[Event], spent: BudgetSpent) -> str:
    """Return, in words, the rule that ended the study (or why it has not ended)."""
    reason, budget = st.stop_reason, spec.budget
    # A pause (by hand, or by a spent LLM budget) still in force when the study was stopped or read.
    held = [e for e in sorted(events, key=lambda e: e.id or 0) if e.type in ("study.paused", "study.resumed")]
    paused = held[-1].payload if held and held[-1].type == "study.paused" else None
    why = str(paused.get("reason", "")) if paused else ""
    llm = _llm_budget(str(paused.get("budget", "")), budget.usd, budget.tokens) if paused else ""
    if st.status == StudyStatus.PAUSED:
        if llm:
            what = f"paused because {llm}"
        elif paused:
            what = f"paused: {why}" if why else f"paused by {paused.get('by') or 'someone'}"
        else:
            what = "paused"
        return f"not ended: {what} (resume or stop it)"
    if st.status not in (StudyStatus.FINISHED, StudyStatus.FAILED):
        return f"not ended: the study is {st.status}"
    if st.stop_rule == StopRule.USER:
        stopper = next((e.payload.get("by") for e in events if e.type == "study.stopping"), None)
        who = f"stopped by a user ({stopper})" if stopper else "stopped by a user"
        return f"{who} while paused because {llm}" if llm else who
    told = {
        StopRule.EXPERIMENTS: f"the experiment budget was spent ({spent.units} of {budget.experiments} units)",
        StopRule.TIME: f"the time budget was spent ({budget.hours:g} h)",
        StopRule.PLATEAU: f"the plateau stop: {spec.plateau.stop} experiments in a row without improvement",
        StopRule.FRONTIER: "the frontier was exhausted (no hypothesis left to try)",
        StopRule.IDEATION: f"a failure: {reason}",
    }
    if st.stop_rule in told:
        return told[StopRule(st.stop_rule)]
    if st.status == StudyStatus.FAILED:
        return f"a failure: {reason or 'no reason recorded'}"
    return reason or "no reason recorded"


def _llm_budget(spent: str, usd: float, tokens: int | None) -> str:
    """Name the LLM budget a pause says was spent ('' for a pause of another kind)."""
    if spent == Blame.TOKENS:
        return (
            f"the LLM token budget ({tokens} tokens) was spent"
            if tokens
            else "the LLM token budget was spent"
        )
    if spent == Blame.USD:
        return f"the LLM budget (${usd:.4g}) was spent"
    return ""


def render(s: Session, study_id: int) -> str:
    """Return the study's report as Markdown."""
    st = s.get(Study, study_id)
    assert st is not None
    nodes = list(s.exec(select(Node).where(Node.study_id == study_id).order_by(col(Node.id))))
    receipts = list(s.exec(select(ReceiptRow).where(ReceiptRow.study_id == study_id)))
    events = list(s.exec(select(Event).where(Event.study_id == study_id)))
    spec = spec_of(st)
    spent = budget_spent(s, study_id, spec.evaluate.repeats)
    metric = spec.objective.metric
    merged = [n for n in nodes if n.status == NodeStatus.MERGED and n.parent_id is not None]
    counts = Counter(n.status for n in nodes if n.parent_id is not None)
    dur = (st.finished_at - st.started_at).total_seconds() if st.finished_at and st.started_at else 0.0
    eval_seconds = sum(r.duration for r in receipts)
    lines = [
        f"# Grove report: {st.name}",
        "",
        f"**Goal:** {st.goal}  ",
        f"**Objective:** {spec.objective.direction} `{metric}`  ",
        f"**Status:** {st.status} — {st.stop_reason or 'running'}  ",
        f"**Ended by:** {ending(st, spec, events, spent)}  ",
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
        f"Experiment budget: {budget_line(spent, spec.budget.experiments)}.  ",
        f"Wall time {dur:.0f} s; {eval_seconds:.0f} s spent in evaluations ({len(receipts)} runs).",
        *(
            [
                "The dev evaluation gives the same values on every seed: nodes ran one dev seed (a second where they beat trunk)."
            ]
            if st.dev_deterministic
            else []
        ),
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
    turned = [n for n in nodes if n.status == NodeStatus.REJECTED and n.status_by and n.status_by != "auto"]
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
