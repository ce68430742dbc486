"""The coordinator graph: observe → ideate → select → dispatch → wait → integrate → gate → merge.

The graph holds only ids; every fact lives behind the ports, which reach each node through the
run context (`CoordinatorContext`, passed as `context=` to every `invoke`, resumes included).
Nodes that wait do so with `interrupt()`: `await_jobs` (resumed with the finished job ids; `wait`
for experiments and a gate job, and `start` for the baseline where it runs as a job), `approve`
(resumed with `{"approved": bool, "by": str, "reason": str}`) and `paused`.

Where the sealed gate runs as a job, the study does not stop for it: the candidate is `gating`
while its job runs beside the next experiments (one sealed query at a time), and `wait` goes
back to `gate` to read the verdict when the job ends. Nor does a gate pass in approve mode: the
node's approval opens (`awaiting`) and the study explores on the current trunk; `observe`
applies the decision when it comes, and a `wait` for jobs is resumed (with no finished job)
as soon as the decision is there. Only when there is nothing else to do (budget spent,
frontier empty) does `approve` wait for the human.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from langgraph.types import Command, interrupt

from agents.coordinator.configuration import CoordinatorContext
from agents.coordinator.evidence import (
    gate_candidates,
    ideation_input,
    integrate_one,
    next_plan,
    recent,
    retries_of,
    tree_of,
    widenings,
)
from agents.coordinator.ports import NodeRecord, Pending
from agents.coordinator.records import RecordIndex, index_of
from agents.coordinator.state import CoordinatorState, Wait
from agents.failures import SPENT, Blame
from agents.llm.model import BudgetExhausted, ModelError
from agents.spec import GateMode
from agents.tree import plateau, pruning, selection
from agents.tree.insights import backpropagate
from agents.tree.model import TreeNode
from agents.tree.status import NodeStatus, StopRule, StudyStatus
from agents.verify.state import ImprovementState


def start(
    state: CoordinatorState, runtime: Runtime[CoordinatorContext]
) -> Command[Literal["start", "observe", "dispatch"]]:
    """Measure the baseline (waiting for its job where it runs as one), then go to observe.

    Where the baseline runs in jobs, the study explores while they run: beside the held-out job
    always, and beside the dev job unless the policy reads trunk's dev value to propose (nothing
    is integrated before that job ends).
    """
    # `wait` comes back here when a baseline job ends, with experiments running: they are kept.
    kept = {"round_no": state.get("round_no", 0), "pending": _active_jobs(state), "baseline_dev_job": None}
    status = runtime.context.storage.study(state["study_id"]).status
    if status == StudyStatus.STOPPING:
        return Command(update=kept, goto="observe")
    pending = runtime.context.sealed.baseline(state["study_id"])
    if pending is not None and pending.blocking:
        if not runtime.context.policy.capabilities.reads_baseline:
            return Command(update={**kept, "baseline_dev_job": pending.job_id}, goto="observe")
        interrupt({"kind": Wait.JOBS.value, "study_id": state["study_id"], "jobs": [pending.job_id]})
        return Command(goto="start")  # look again in a fresh step: at most one interrupt per run
    held = pending.job_id if pending is not None else None
    update = {**kept, "baseline_job": held}
    if (
        held is not None
        and kept["pending"]
        and not state.get("baseline_sent")
        and status == StudyStatus.RUNNING
    ):
        return Command(update=update, goto="dispatch")  # the experiments have their slots: send it now
    return Command(update=update, goto="observe")


def observe(
    state: CoordinatorState, runtime: Runtime[CoordinatorContext]
) -> Command[Literal["ideate", "wait", "dispatch", "observe", "gate", "approve", "merge", "finish"]]:
    """Check status, an open approval and budgets; go to ideate, wait, dispatch, gate, merge, approve or finish."""
    storage, trunk = runtime.context.storage, runtime.context.trunk
    sid = state["study_id"]
    study = storage.study(sid)
    pending = _active_jobs(state)
    awaiting = state.get("awaiting")
    if awaiting is None and study.spec.gate.mode == GateMode.APPROVE:
        awaiting = open_approval(storage.nodes(sid))  # opened by a step that crashed before its checkpoint
    if awaiting is not None:
        # A decision already recorded is applied first, even when a stop follows it.
        answer = trunk.decision(sid, awaiting)
        if answer is not None:
            update, goto = _decided(sid, awaiting, answer, runtime)
            return Command(update=update, goto=goto)
    if study.status == StudyStatus.STOPPING:
        if awaiting is not None and not trunk.withdraw(
            sid, awaiting, "the study was stopped before a decision"
        ):
            return Command(goto="observe")  # a decision came in just now: apply it first
        storage.cancel_active(sid)
        stopped: dict[str, Any] = {"pending": [], "awaiting": None, "gating": None, "gate_job": None}
        stopped["stop_rule"] = StopRule.USER.value
        return Command(update={"stop_reason": "stopped by user", **stopped}, goto="finish")
    if study.status == StudyStatus.PAUSED:
        interrupt({"kind": Wait.RESUME.value, "study_id": sid})
        return Command(goto="observe")
    budget = study.spec.budget
    if study.spec.capabilities.calls_model and 0 < budget.usd <= study.usd_spent:
        storage.event(sid, "budget.exhausted", None, {"usd": study.usd_spent, "budget": budget.usd})
        storage.pause(sid, f"LLM budget spent: ${study.usd_spent:.4g} of ${budget.usd:.4g}", Blame.USD)
        return Command(goto="observe")
    reason, rule = "", ""
    if study.experiments_used >= budget.experiments:
        reason, rule = f"experiment budget spent ({budget.experiments})", StopRule.EXPERIMENTS.value
    elif study.elapsed_hours >= budget.hours:
        reason, rule = f"time budget spent ({budget.hours:g} h)", StopRule.TIME.value
    elif study.plateau_level >= plateau.PlateauLevel.STOP:
        reason = f"plateau: {study.spec.plateau.stop} experiments without improvement"
        rule = StopRule.PLATEAU.value
    if reason:
        if _unsent(state):
            return Command(goto="dispatch")  # nothing more to run but the held-out baseline: send it
        if pending or _sealed_running(state):
            return Command(goto="wait")
        if awaiting is not None:  # the last thing left to do
            return Command(
                update={"stop_reason": reason, "stop_rule": rule, "awaiting": awaiting}, goto="approve"
            )
        return Command(update={"stop_reason": reason, "stop_rule": rule}, goto="finish")
    slots = min(budget.parallel - len(pending), budget.experiments - study.experiments_used)
    if slots > 0:
        return Command(update={"awaiting": awaiting}, goto="ideate")
    return Command(update={"awaiting": awaiting}, goto="wait")


EMPTY_ROUNDS = 2  # rounds in a row with nothing to run that are asked again before the frontier is exhausted
DROPPED_KEPT = 12  # dropped ideas kept in the state to tell the policy of (the latest)


def ideate(
    state: CoordinatorState, runtime: Runtime[CoordinatorContext]
) -> Command[Literal["select", "observe"]]:
    """Ask the policy for proposals when too few nodes wait, then go to select."""
    storage, config = runtime.context.storage, runtime.context.config
    sid = state["study_id"]
    study = storage.study(sid)
    records = storage.nodes(sid)
    index = index_of(records)
    waiting = len(index.by_status.get(NodeStatus.PROPOSED, {}))
    retry = len(retries_of(records, config))
    slots = study.spec.budget.parallel - len(_active_jobs(state))
    round_no = state.get("round_no", 0)
    if waiting + retry < slots:
        k = max(study.spec.policy.children, slots - waiting - retry)
        ctx = replace(
            ideation_input(study, records, k=k, round_no=round_no),
            free=slots - waiting - retry,
            dropped=list(state.get("dropped", [])),
        )
        if study.spec.capabilities.reads_context:
            ctx = replace(
                ctx,
                memory=storage.memory(sid),
                repo_map=storage.repo_map(sid),
                recent=recent(storage, sid, records),
            )
        try:
            proposals = runtime.context.policy.ideate(ctx)
        except BudgetExhausted as exc:
            storage.event(sid, "budget.exhausted", None, {"reason": str(exc)})
            storage.pause(sid, str(exc), exc.blame)
            return Command(update={"round_no": round_no + 1}, goto="observe")  # the pause comes first
        except ModelError as exc:
            storage.event(sid, "llm.error", None, {"role": "ideator", "error": str(exc)[:1000]})
            storage.add_proposals(sid, round_no, [])
            return Command(update={"round_no": round_no + 1, "ideation_error": str(exc)[:500]}, goto="select")
        max_depth = study.spec.policy.max_depth
        kept, dropped = [], []
        for p in proposals:
            parent = p.parent_id if p.parent_id in index.by_id else None
            why = p.dropped or _misplaced(parent, index, max_depth)
            if not why:
                kept.append(p)
                continue
            payload = {"title": p.title[:200], "reason": why[:500], "round": round_no}
            storage.event(sid, "proposal.dropped", parent, payload)
            dropped.append({**payload, "parent_id": parent})
        if not proposals:
            dropped.append({"title": "", "reason": "no child in the answer", "round": round_no})
        storage.add_proposals(sid, round_no, kept)
        told = [*state.get("dropped", []), *dropped][-DROPPED_KEPT:]  # the policy hears of them next round
        update = {"round_no": round_no + 1, "ideation_error": "", "dropped": told}
        return Command(update=update, goto="select")
    return Command(update={"round_no": round_no + 1, "ideation_error": ""}, goto="select")


def _misplaced(parent: int | None, index: RecordIndex, max_depth: int) -> str:
    """Return why a proposal cannot hang under `parent` ("" if it can)."""
    if parent is None:
        return "its parent is not a node of this study"
    if index.reach(parent) >= max_depth:
        return f"its parent is policy.max_depth ({max_depth}) steps below the last merged change"
    return ""


def select(
    state: CoordinatorState, runtime: Runtime[CoordinatorContext]
) -> Command[Literal["dispatch", "wait", "approve", "observe", "finish"]]:
    """Choose retries and frontier nodes for the free slots; go to dispatch, wait or finish.

    With nothing to run, nothing running and budget left, the policy is asked again (through
    observe, which checks the budgets first) up to `EMPTY_ROUNDS` times in a row before the study
    ends with its frontier exhausted.
    """
    storage, config = runtime.context.storage, runtime.context.config
    sid = state["study_id"]
    study = storage.study(sid)
    records = storage.nodes(sid)
    pending = _active_jobs(state)
    slots = min(
        study.spec.budget.parallel - len(pending),
        study.spec.budget.experiments - study.experiments_used,
    )
    retries = retries_of(records, config)[: max(slots, 0)]
    cfg = selection.SelectionConfig(config.exploration, config.per_parent, study.seed)
    chosen = retries + selection.select(tree_of(records), slots - len(retries), cfg, state.get("round_no", 0))
    if chosen or _unsent(state):
        return Command(update={"selected": chosen, "empty_rounds": 0}, goto="dispatch")
    if pending or _sealed_running(state):
        return Command(goto="wait")
    if state.get("awaiting") is not None:
        return Command(goto="approve")  # nothing left to explore: the open approval decides what follows
    if state.get("ideation_error"):
        failed = {
            "stop_reason": f"ideation failed: {state['ideation_error']}",
            "stop_rule": StopRule.IDEATION.value,
        }
        return Command(update=failed, goto="finish")
    empty = state.get("empty_rounds", 0)
    if empty < EMPTY_ROUNDS and slots > 0:
        asks = {"round": state.get("round_no", 0), "asks_left": EMPTY_ROUNDS - empty}
        storage.event(sid, "ideation.empty", None, asks)
        return Command(update={"empty_rounds": empty + 1}, goto="observe")
    exhausted = {
        "stop_reason": "frontier exhausted: nothing left to try",
        "stop_rule": StopRule.FRONTIER.value,
    }
    return Command(update=exhausted, goto="finish")


def dispatch(state: CoordinatorState, runtime: Runtime[CoordinatorContext]) -> Command[Literal["wait"]]:
    """Enqueue and submit a job per selected node (then, once, the held-out baseline's job); go to wait."""
    storage, dispatcher = runtime.context.storage, runtime.context.dispatcher
    sid = state["study_id"]
    pending = _active_jobs(state)
    for node_id in state.get("selected", []):
        job_id = storage.enqueue(sid, node_id)
        dispatcher.submit(job_id)
        if job_id not in pending:
            pending.append(job_id)
    sent: dict[str, Any] = {}
    if _unsent(state):  # after the experiments: it takes a worker slot only once they have theirs
        dispatcher.submit(state["baseline_job"])  # type: ignore[arg-type]
        sent = {"baseline_sent": True}
    return Command(update={"pending": pending, "selected": [], **sent}, goto="wait")


def wait(state: CoordinatorState) -> Command[Literal["integrate", "gate", "start", "observe"]]:
    """Interrupt until some jobs finish (or an open approval is decided); go to integrate, gate, start or observe."""
    pending = _active_jobs(state)
    gate_job = state.get("gate_job")
    dev_job, held_job = state.get("baseline_dev_job"), state.get("baseline_job")
    if dev_job is not None:
        watched = [dev_job]  # no gain can be measured before trunk's dev value: nothing else is read
    else:  # the held-out baseline's job too, while it runs: `start` reads its outcome
        watched = list(dict.fromkeys([*pending, *[j for j in (gate_job, held_job) if j is not None]]))
    if not watched:
        return Command(goto="observe")
    finished = interrupt(
        {
            "kind": Wait.JOBS.value,
            "study_id": state["study_id"],
            "jobs": watched,
            "approval": state.get("awaiting"),
        }
    )
    finished = [j for j in finished if j in watched]
    if dev_job in finished or held_job in finished:
        # The held-out baseline first: its failure ends the study before anything more is spent.
        # Whatever else finished is still finished at the next wait.
        return Command(goto="start")
    done = [j for j in finished if j in pending]
    gated = gate_job is not None and gate_job in finished  # integrate, if it runs first, hands over to gate
    update = {"pending": [j for j in pending if j not in done], "gate_job": None if gated else gate_job}
    if done:
        return Command(update={**update, "finished": done}, goto="integrate")
    if gated:
        return Command(update=update, goto="gate")
    return Command(goto="observe")  # a decision, a stop or a pause: observe acts on it


def integrate(
    state: CoordinatorState, runtime: Runtime[CoordinatorContext]
) -> Command[Literal["gate", "observe"]]:
    """Verify finished nodes, back-propagate insights, prune and plan; go to gate or observe."""
    storage, policy, config = runtime.context.storage, runtime.context.policy, runtime.context.config
    sid = state["study_id"]
    study = storage.study(sid)
    node_ids = set(storage.job_nodes(state.get("finished", [])).values())
    latest = storage.nodes(sid)  # read again only after this step's own writes to the nodes
    records = index_of(latest).by_id  # read-only
    istate = ImprovementState.from_dict(study.improvement_state)
    for node_id in sorted(node_ids):
        rec = records[node_id]
        if rec.completed_order:
            continue  # already integrated (replayed step)
        # The verifier judges the change itself, not only the executor's account.
        if policy.capabilities.judges:
            rec = replace(rec, evidence=replace(rec.evidence, diff=storage.change(sid, node_id)))
        result = integrate_one(study, rec, policy, istate, records, config)
        storage.record(sid, result)
        storage.event(sid, "node.integrated", node_id, {"status": result.status})
        latest = storage.nodes(sid)
        records = index_of(latest).by_id
        if rec.evidence.blame in SPENT:  # a call the budget could not cover
            storage.event(sid, "budget.exhausted", node_id, {"reason": rec.evidence.failure})
            storage.pause(sid, rec.evidence.failure.removeprefix("BudgetExhausted: "), rec.evidence.blame)
    metric = study.spec.objective.metric
    for node_id in sorted(node_ids):
        by_id = index_of(latest).by_id

        def synth(anc: TreeNode, kids: list[TreeNode], by_id: dict[int, NodeRecord] = by_id) -> str:
            ev = by_id[anc.id].evidence
            return policy.synthesize(ev, [by_id[k.id].evidence for k in kids], metric)

        updates = backpropagate(tree_of(latest), node_id, synth)
        if updates:
            storage.add_insights(sid, updates)
            latest = storage.nodes(sid)
    records_list = latest
    index = index_of(records_list)
    tree = tree_of(records_list)
    completed = index.in_completion_order()
    min_gain = study.spec.plateau.min_gain
    flags = [pruning.improved(r.evidence.gain_lcb, min_gain) for r in completed]
    p = study.spec.plateau
    level = plateau.plateau_level(flags, plateau.PlateauConfig(p.warn, p.change, p.stop))
    if level != study.plateau_level and level > 0:
        storage.event(
            sid,
            "budget.warning",
            None,
            {"plateau": level.name.lower(), "streak": plateau.non_improving_streak(flags)},
        )
        if level >= plateau.PlateauLevel.CHANGE:
            istate.concern("plateau: change approach, explore new directions")
    # Never the node whose gate job runs: its verdict is still to be read (and acted on).
    pruned = [
        pr
        for pr in pruning.exhausted(tree, config.prune_window, min_gain)
        if pr.node_id != state.get("gating")
    ]
    for pr in pruned:
        storage.prune(sid, pr.node_id, pr.reason, pr.lesson)
        istate.concern(f"pruned n{tree.nodes[pr.node_id].number}: {pr.reason}")
    istate.next_plan = next_plan(records_list, level)
    recent = [index.by_id[i].evidence for i in sorted(node_ids) if i in index.by_id]
    numbers: dict[int, int] | None = None  # only a model reads nodes by their numbers and checks findings
    accepted: frozenset[int] | None = None
    if policy.capabilities.reads_context:
        numbers = {r.evidence.id: r.evidence.number for r in records_list}
        accepted = frozenset(
            [*index.by_status.get(NodeStatus.MERGED, {}), *index.by_decision.get("accept", {})]
        )
    rewritten = ImprovementState.from_dict(policy.update_state(istate.to_dict(), recent, numbers, accepted))
    for concern in istate.raised:  # what Grove raised in this step survives the state writer's rewrite
        rewritten.concern(concern)
    storage.save_state(sid, rewritten.to_dict(), int(level))
    study = storage.study(sid)
    # One approval open and one sealed query at a time: trunk cannot move under either, so a
    # tested merge stays valid.
    if state.get("awaiting") is not None or state.get("gate_job") is not None:
        return Command(update={"finished": []}, goto="observe")
    if state.get("gating") is not None:
        return Command(update={"finished": []}, goto="gate")  # its job has ended: read the verdict
    cands = gate_candidates(study, storage.nodes(sid) if pruned else records_list)
    if cands:
        return Command(update={"candidates": cands, "finished": []}, goto="gate")
    return Command(update={"candidates": [], "finished": []}, goto="observe")


def gate(
    state: CoordinatorState, runtime: Runtime[CoordinatorContext]
) -> Command[Literal["gate", "merge", "observe"]]:
    """Gate the best still-eligible candidate; merge it (auto) or open its approval, then observe.

    Where the sealed evaluation runs as a job, the candidate is `gating` and the study explores
    on while it runs; `wait` comes back here to read the verdict once the job has ended.
    """
    storage, trunk, sealed = runtime.context.storage, runtime.context.trunk, runtime.context.sealed
    sid = state["study_id"]
    cands = list(state.get("candidates", []))
    gating = state.get("gating")
    if gating is not None:  # its job has ended: its verdict first, then whoever became eligible meanwhile
        cands = [gating, *[c for c in gate_candidates(storage.study(sid), storage.nodes(sid)) if c != gating]]
    done: dict[str, Any] = {"candidates": [], "gate_node": None, "gating": None, "gate_job": None}
    while cands:
        study = storage.study(sid)
        if study.status == StudyStatus.STOPPING:
            break  # observe cancels what is running and finishes
        records = storage.nodes(sid)
        opened = open_approval(records) if study.spec.gate.mode == GateMode.APPROVE else None
        if opened is not None:  # a replayed step: the approval it opened before a crash stays the one
            return Command(update={**done, "awaiting": opened}, goto="observe")
        node_id = cands.pop(0)
        still = gate_candidates(study, records)
        if node_id not in still:
            continue
        outcome = sealed.gate(sid, node_id)
        if isinstance(outcome, Pending):
            update = {"candidates": [node_id, *cands], "gating": node_id, "gate_job": outcome.job_id}
            return Command(update=update, goto="observe")
        if outcome:
            if study.spec.gate.mode == GateMode.AUTO:
                return Command(update={**done, "gate_node": node_id}, goto="merge")
            trunk.await_approval(sid, node_id)
            return Command(update={**done, "awaiting": node_id}, goto="observe")
    return Command(update=done, goto="observe")


def approve(
    state: CoordinatorState, runtime: Runtime[CoordinatorContext]
) -> Command[Literal["gate", "merge", "observe"]]:
    """Interrupt for the human decision on the open approval (nothing else is left to do); act on it."""
    sid = state["study_id"]
    # `gate_node` holds it in a checkpoint written before approvals stopped holding the study up.
    node_id = state.get("awaiting") or state.get("gate_node")
    assert node_id is not None
    answer: dict[str, Any] = interrupt({"kind": Wait.APPROVAL.value, "study_id": sid, "node_id": node_id})
    update, goto = _decided(sid, node_id, answer, runtime)
    return Command(update=update, goto=goto)


Decided = tuple[dict[str, Any], Literal["gate", "merge", "observe"]]


def _decided(sid: int, node_id: int, answer: dict[str, Any], runtime: Runtime[CoordinatorContext]) -> Decided:
    """Act on a decision about an open approval: merge, or reject (then gate the next candidate)."""
    trunk, storage = runtime.context.trunk, runtime.context.storage
    closed: dict[str, Any] = {"awaiting": None, "gate_node": None}
    if answer.get("withdrawn"):
        trunk.withdraw(sid, node_id, str(answer.get("reason") or "withdrawn"))  # else observe applies it
        return closed, "observe"
    if answer.get("approved"):
        return {**closed, "gate_node": node_id, "approved_by": str(answer.get("by") or "human")}, "merge"
    reason, by = str(answer.get("reason") or "rejected by a human"), str(answer.get("by", ""))
    trunk.reject(sid, node_id, reason, by)
    cands = gate_candidates(storage.study(sid), storage.nodes(sid))
    return ({**closed, "candidates": cands}, "gate") if cands else (closed, "observe")


def merge(state: CoordinatorState, runtime: Runtime[CoordinatorContext]) -> Command[Literal["observe"]]:
    """Merge the gate node into trunk, then go to observe."""
    sid, node_id = state["study_id"], state.get("gate_node")
    assert node_id is not None
    runtime.context.trunk.merge(sid, node_id, state.get("approved_by") or "auto")
    storage = runtime.context.storage
    study = storage.study(sid)
    # A replayed step finds its widenings told already, and says nothing twice.
    told = storage.said(sid, "search.widened", node_id)
    moved = [] if told else [w for w in widenings(study, storage.nodes(sid)) if w.node_id == node_id]
    if moved:  # the findings first: a step that stops between the two writes tells them again
        istate = ImprovementState.from_dict(study.improvement_state)
        for w in moved:
            istate.add_finding(w.text(), [node_id])
        storage.save_state(sid, istate.to_dict(), study.plateau_level)
        for w in moved:
            payload = {"key": w.key, "side": w.side, "value": w.value, "old": w.old, "new": w.new}
            storage.event(sid, "search.widened", node_id, payload)
    return Command(update={"gate_node": None, "approved_by": ""}, goto="observe")


def finish(state: CoordinatorState, runtime: Runtime[CoordinatorContext]) -> dict[str, Any]:
    """Finalize the study with its stop reason; the graph ends here."""
    rule = StopRule(state["stop_rule"]) if state.get("stop_rule") else None
    runtime.context.trunk.finalize(state["study_id"], state.get("stop_reason", "finished"), rule)
    return {}


def open_approval(records: list[NodeRecord]) -> int | None:
    """Return the node whose approval is open (there is at most one), or None."""
    return min(index_of(records).by_status.get(NodeStatus.AWAITING_APPROVAL, {}), default=None)


def _unsent(state: CoordinatorState) -> bool:
    """Return whether the held-out baseline's job was created but its task not yet sent."""
    return state.get("baseline_job") is not None and not state.get("baseline_sent")


def _sealed_running(state: CoordinatorState) -> bool:
    """Return whether a sealed job (a gate's, a baseline's) is out, to be waited for."""
    return any(state.get(k) is not None for k in ("gate_job", "baseline_job", "baseline_dev_job"))


def _active_jobs(state: CoordinatorState) -> list[int]:
    return list(state.get("pending", []))


def build_graph() -> StateGraph[CoordinatorState, CoordinatorContext, CoordinatorState, CoordinatorState]:
    """Return the (uncompiled) coordinator graph; compile it, then pass `context=` to every invoke."""
    g = StateGraph(CoordinatorState, context_schema=CoordinatorContext)
    g.add_node("start", start)
    g.add_node("observe", observe)
    g.add_node("ideate", ideate)
    g.add_node("select", select)
    g.add_node("dispatch", dispatch)
    g.add_node("wait", wait)
    g.add_node("integrate", integrate)
    g.add_node("gate", gate)
    g.add_node("approve", approve)
    g.add_node("merge", merge)
    g.add_node("finish", finish)
    g.add_edge(START, "start")
    g.add_edge("finish", END)
    return g
