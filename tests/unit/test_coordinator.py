"""The coordinator graph over in-memory ports: routing, interrupts, budgets, replays."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from agents.capabilities import SEARCH
from agents.coordinator.configuration import CoordinatorContext
from agents.coordinator.graph import build_graph
from agents.coordinator.ports import Integration, NodeRecord, Pending, StudyView
from agents.policies.base import IdeationInput, NodeEvidence, Proposal
from agents.policies.search import SearchPolicy
from agents.spec import parse_spec
from tests.support.memory import KNOB, Memory, bare_record, context
from tests.support.repos import tiny_files


def drive(mem: Memory, answer: dict[str, Any], policy: Any = None) -> list[str]:
    """Run the graph to the end, completing jobs in order and answering approvals; return interrupt kinds."""
    graph = build_graph().compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "t"}}
    ctx = context(mem, policy or SearchPolicy())
    inp: Any = {"study_id": 1}
    kinds = []
    for _ in range(100):
        out = graph.invoke(inp, cfg, context=ctx, durability="sync", version="v2")
        if not out.interrupts:
            return kinds
        intr = out.interrupts[0]
        kinds.append(intr.value["kind"])
        if intr.value["kind"] == "await_jobs":
            approval = intr.value.get("approval")
            if approval is not None and mem.decision(1, approval) is not None:
                inp = Command(resume={intr.id: []})  # the decision came before any job finished
                continue
            first = intr.value["jobs"][0]
            mem.complete(first)
            inp = Command(resume={intr.id: [first]})
        else:
            inp = Command(resume={intr.id: answer})
    raise AssertionError("the graph did not finish")


def test_approval_interrupt_then_merge_then_budget_stop() -> None:
    mem = Memory(mode="approve", experiments=4)
    kinds = drive(mem, {"approved": True, "by": "ada"})
    assert kinds.count("approve") >= 1 and "await_jobs" in kinds
    assert "merged by ada" in mem.events
    assert mem.events[-1] == "finished: experiment budget spent (4)"
    assert len(mem.jobs) == 4 and len(set(mem.submitted)) == 4
    assert mem.events[0] == "baseline"


def test_the_study_explores_while_an_approval_is_open_and_applies_the_decision_when_it_comes() -> None:
    mem = Memory(mode="approve", experiments=8)
    mem.answer, mem.decide_after = {"approved": True, "by": "ada"}, 3
    kinds = drive(mem, {"approved": True, "by": "ada"})
    opened = next(e for e in mem.events if e.startswith("approval opened"))
    node = int(opened.rsplit("n", 1)[1])
    # Three more experiments finished in the same study between the approval and the merge.
    assert mem.events.index("merged by ada") > mem.events.index(opened)
    assert len(mem.completed) - mem.opened[node] >= 3
    assert mem.rows[node]["status"] == "merged"
    assert mem.events[-1] == "finished: experiment budget spent (8)"
    assert "await_jobs" in kinds


def test_a_decision_still_open_when_nothing_is_left_to_do_is_waited_for() -> None:
    mem = Memory(mode="approve", experiments=4)
    mem.answer, mem.decide_after = None, 0  # nobody answers while experiments run
    kinds = drive(mem, {"approved": False, "by": "ada", "reason": "not now"})
    # The study ran every experiment first; then each gate pass in turn waited for its answer.
    first = kinds.index("approve")
    assert set(kinds[first:]) == {"approve"} and kinds[:first].count("await_jobs") >= 4
    assert "rejected: not now" in mem.events and mem.trunk == "c0"
    assert mem.events[-1] == "finished: experiment budget spent (4)"


def resume(graph: Any, cfg: dict[str, Any], ctx: CoordinatorContext, intr: Any, value: Any) -> Any:
    """Resume the interrupt `intr` with `value` and run to the next interrupt (or the end)."""
    return graph.invoke(Command(resume={intr.id: value}), cfg, context=ctx, durability="sync", version="v2")


def until_an_approval_opens(mem: Memory) -> tuple[Any, dict[str, Any], CoordinatorContext, Any]:
    """Run the graph, completing jobs, until a gate pass opens an approval; return it and its interrupt."""
    graph = build_graph().compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "t"}}
    ctx = context(mem, SearchPolicy())
    out = graph.invoke({"study_id": 1}, cfg, context=ctx, durability="sync", version="v2")
    for _ in range(20):
        intr = out.interrupts[0]
        if any(e.startswith("approval opened") for e in mem.events):
            return graph, cfg, ctx, intr
        first = intr.value["jobs"][0]
        mem.complete(first)
        out = resume(graph, cfg, ctx, intr, [first])
    raise AssertionError("no approval opened")


def test_stopping_withdraws_an_open_approval() -> None:
    mem = Memory(mode="approve", experiments=10)
    graph, cfg, ctx, intr = until_an_approval_opens(mem)
    assert intr.value["kind"] == "await_jobs" and intr.value["approval"] is not None
    mem.status = "stopping"
    out = graph.invoke(Command(resume={intr.id: []}), cfg, context=ctx, durability="sync", version="v2")
    assert not out.interrupts and mem.events[-1] == "finished: stopped by user"
    assert mem.rows[intr.value["approval"]]["status"] == "cancelled"
    assert any(e.startswith("withdrawn:") for e in mem.events)


def test_rejected_approval_keeps_trunk_and_continues() -> None:
    mem = Memory(mode="approve", experiments=4)
    drive(mem, {"approved": False, "by": "ada", "reason": "too risky"})
    assert mem.trunk == "c0" and "rejected: too risky" in mem.events
    assert mem.status == "finished"


def test_auto_mode_merges_without_asking_and_gate_failures_do_not_merge() -> None:
    mem = Memory(mode="auto", experiments=4)
    assert "approve" not in drive(mem, {})
    assert "merged by auto" in mem.events
    failing = Memory(mode="auto", experiments=4, gate_passes=False)
    drive(failing, {})
    assert failing.trunk == "c0" and not any(e.startswith("merged") for e in failing.events)
    assert any(n["gated"] and n["status"] == "rejected" for n in failing.rows.values())


class GateJobs(Memory):
    """The same double, with each gate run as a job whose verdict is read when the job ends."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.spec = parse_spec(
            tiny_files(mode=kw.get("mode", "auto"), experiments=kw.get("experiments", 6), values=KNOB)[
                "grove.toml"
            ].replace("parallel = 2", "parallel = 1")
        )
        self.gate_jobs: dict[int, int] = {}  # gate job -> node
        self.verdicts: dict[int, bool] = {}  # node -> verdict, once its gate job has ended
        self.running: list[tuple[str, int]] = []  # what was running each time a job ended

    def gate(self, study_id: int, node_id: int) -> bool | Pending:  # type: ignore[override]
        if node_id in self.verdicts:
            return super().gate(study_id, node_id)
        job = next((j for j, n in self.gate_jobs.items() if n == node_id), None)
        if job is None:
            job = 1000 + len(self.gate_jobs)
            self.gate_jobs[job] = node_id
            self.events.append(f"gate job for n{node_id}")
        return Pending(job)

    def complete(self, job_id: int) -> None:
        if job_id in self.gate_jobs:
            self.verdicts[self.gate_jobs[job_id]] = self.gate_passes
        else:
            super().complete(job_id)


def started(mem: Memory) -> tuple[Any, dict[str, Any], CoordinatorContext, Any]:
    """Compile the graph over the double and run it to its first interrupt; return graph, config, context, output."""
    graph = build_graph().compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "t"}}
    ctx = context(mem, SearchPolicy())
    return graph, cfg, ctx, graph.invoke({"study_id": 1}, cfg, context=ctx, durability="sync", version="v2")


def drive_jobs(mem: GateJobs) -> None:
    """Run the graph to the end, finishing the oldest watched job at each wait; note what ran beside it."""
    graph, cfg, ctx, out = started(mem)
    for _ in range(200):
        if not out.interrupts:
            return
        intr = out.interrupts[0]
        jobs = list(intr.value["jobs"])
        mem.running.append(tuple(jobs))  # type: ignore[arg-type]
        first = min(jobs)  # experiments (100+) before the gate job (1000+) they run beside
        mem.complete(first)
        out = resume(graph, cfg, ctx, intr, [first])
    raise AssertionError("the graph did not finish")


def test_experiments_run_while_a_gate_job_runs_and_its_verdict_is_acted_on_when_it_ends() -> None:
    mem = GateJobs(mode="auto", experiments=6)
    drive_jobs(mem)
    assert mem.gate_jobs, "no gate ran"
    # With one experiment slot, an experiment ran beside each gate job (it is not an experiment).
    beside = [w for w in mem.running if any(j >= 1000 for j in w) and any(j < 1000 for j in w)]
    assert beside and all(len([j for j in w if j < 1000]) <= 1 for w in mem.running)
    # One sealed query at a time, each verdict read once its job ended, and the pass merged.
    assert all(len([j for j in w if j >= 1000]) <= 1 for w in mem.running)
    assert set(mem.verdicts) == set(mem.gate_jobs.values())
    assert "merged by auto" in mem.events and mem.trunk != "c0"
    merged = [n for n in mem.rows.values() if n["status"] == "merged" and n["parent"] is not None]
    assert {n["id"] for n in merged} <= set(mem.verdicts)
    assert mem.events[-1] == "finished: experiment budget spent (6)"


class ChildrenMeanwhile(GateJobs):
    """While a candidate's gate job runs, three children of it complete without improving."""

    def gate(self, study_id: int, node_id: int) -> bool | Pending:  # type: ignore[override]
        first = node_id not in self.gate_jobs.values() and node_id not in self.verdicts
        out = super().gate(study_id, node_id)
        if first:
            for k in range(3):
                kid = self.add(
                    node_id, f"child {k}", {"config.toml:knob.x": 0}, status="evaluated", dev=[0.0, 0.0]
                )
                order = max(m["order"] for m in self.rows.values()) + 1
                self.rows[kid].update(order=order, gain=-5.0, lcb=-6.0, base=self.trunk)
        return out


def test_the_candidate_whose_gate_job_runs_is_not_pruned_and_its_pass_is_merged() -> None:
    mem = ChildrenMeanwhile(mode="auto", experiments=6)
    drive_jobs(mem)
    gated = sorted(mem.gate_jobs.values())
    assert gated, "no gate ran"
    first = gated[0]
    assert mem.verdicts[first] is True
    assert mem.rows[first]["status"] == "merged", mem.rows[first]["status"]


def test_a_gate_job_and_an_experiment_that_end_together_are_both_acted_on() -> None:
    mem = GateJobs(mode="auto", experiments=6)
    graph, cfg, ctx, out = started(mem)
    together = 0
    for _ in range(200):
        if not out.interrupts:
            break
        intr = out.interrupts[0]
        jobs = list(intr.value["jobs"])
        for j in jobs:  # every watched job ends at once
            mem.complete(j)
        together += len(jobs) > 1
        out = resume(graph, cfg, ctx, intr, jobs)
    assert not out.interrupts and mem.events[-1] == "finished: experiment budget spent (6)"
    assert together and set(mem.verdicts) == set(mem.gate_jobs.values())
    assert "merged by auto" in mem.events
    assert all(mem.rows[n]["status"] in ("merged", "rejected") or mem.rows[n]["gated"] for n in mem.verdicts)


def test_a_stop_while_a_gate_job_runs_finishes_the_study() -> None:
    mem = GateJobs(mode="auto", experiments=10)
    graph, cfg, ctx, out = started(mem)
    for _ in range(50):
        intr = out.interrupts[0]
        if any(j >= 1000 for j in intr.value["jobs"]):
            break
        first = intr.value["jobs"][0]
        mem.complete(first)
        out = resume(graph, cfg, ctx, intr, [first])
    else:
        raise AssertionError("no gate job started")
    mem.status = "stopping"
    out = resume(graph, cfg, ctx, intr, [])
    assert not out.interrupts and mem.events[-1] == "finished: stopped by user"
    assert not any(e.startswith("merged") for e in mem.events)
    left = graph.get_state(cfg).values  # nothing of the gate job is left for a resume to wait on
    assert left.get("gate_job") is None and left.get("gating") is None


def test_user_stop_cancels_and_finishes() -> None:
    mem = Memory(mode="auto", experiments=10)
    graph = build_graph().compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "t"}}
    ctx = context(mem, SearchPolicy())
    out = graph.invoke({"study_id": 1}, cfg, context=ctx, durability="sync", version="v2")
    intr = out.interrupts[0]
    assert intr.value["kind"] == "await_jobs" and len(intr.value["jobs"]) == 2
    mem.status = "stopping"
    out = graph.invoke(Command(resume={intr.id: []}), cfg, context=ctx, durability="sync", version="v2")
    assert not out.interrupts and mem.events[-1] == "finished: stopped by user"
    assert [n["status"] for n in mem.rows.values()].count("cancelled") >= 2


class Dispatched:
    """A dispatcher that only records what it was given."""

    def __init__(self) -> None:
        self.submitted: list[int] = []

    def submit(self, job_id: int) -> None:
        self.submitted.append(job_id)


def test_a_resume_runs_with_the_context_it_is_given_not_a_checkpointed_one() -> None:
    mem = Memory(mode="auto", experiments=10)
    saver = InMemorySaver()
    cfg = {"configurable": {"thread_id": "t"}}
    ctx = context(mem, SearchPolicy())
    graph = build_graph().compile(checkpointer=saver)
    out = graph.invoke({"study_id": 1}, cfg, context=ctx, durability="sync", version="v2")
    intr = out.interrupts[0]
    first = intr.value["jobs"][0]
    mem.complete(first)
    # A later process: a fresh graph over the same checkpoints, with new ports in its context.
    later = Dispatched()
    fresh = build_graph().compile(checkpointer=saver)
    out = fresh.invoke(
        Command(resume={intr.id: [first]}),
        cfg,
        context=context(mem, SearchPolicy(), dispatcher=later),
        durability="sync",
        version="v2",
    )
    assert out.interrupts[0].value["kind"] == "await_jobs"
    assert len(mem.submitted) == 2 and len(later.submitted) == 1
    assert later.submitted[0] not in mem.submitted


def test_replayed_ideation_round_does_not_duplicate_nodes() -> None:
    mem = Memory()
    first = mem.add_proposals(1, 0, [Proposal(1, "a", {}, 0.0, {"config.toml:knob.x": 1})])
    again = mem.add_proposals(1, 0, [Proposal(1, "b", {}, 0.0, {"config.toml:knob.x": 2})])
    assert first == again and len(mem.rows) == 2


class Judging(SearchPolicy):
    """The search policy with a scripted verifier (a deterministic double at the policy seam)."""

    def __init__(self, judgement: Any) -> None:
        super().__init__()
        self.judgement = judgement
        self.asked: list[list[dict[str, Any]]] = []

    def verify(self, node: NodeEvidence, soft: list[dict[str, Any]]) -> Any:
        self.asked.append(soft)
        return self.judgement


def _record(x: int, dev: list[float]) -> NodeRecord:
    ev = NodeEvidence(
        id=2,
        parent_id=1,
        depth=1,
        status="evaluated",
        title=f"x={x}",
        edits={"config.toml:knob.x": x},
        origin="policy",
        dev_mean=sum(dev) / len(dev),
        dev_std=0.0,
        dev_n=len(dev),
        gain=None,
        gain_lcb=None,
        dev_metrics={"size": x},
        constraints=[],
        summary="",
        insight="",
    )
    receipts = [(i, {"score": v, "size": x}) for i, v in enumerate(dev)]
    return NodeRecord(
        evidence=ev,
        round_no=0,
        prior=0.0,
        base_commit="c0",
        dev_values=dev,
        dev_receipts=receipts,
        attempts=1,
        completed_order=0,
    )


def test_verifier_can_turn_a_refine_into_a_restart() -> None:
    from agents.coordinator.evidence import integrate_one
    from agents.policies.base import Judgement
    from agents.verify.state import ImprovementState

    mem = Memory()
    rec = _record(5, [6.0, 6.01])  # improves on trunk (1.0) but size 5 > 4
    istate = ImprovementState()
    policy = Judging(Judgement(call="restart", why="the knob rail is broken"))
    out = integrate_one(mem.study(1), rec, policy, istate, {2: rec})
    assert out.status == "rejected" and out.verification["decision"] == "restart"
    assert out.verification["verifier"] == {"call": "restart", "why": "the knob rail is broken"}
    assert any("abandoned by the verifier" in c for c in istate.concerns)
    refine = integrate_one(mem.study(1), rec, Judging(Judgement()), ImprovementState(), {2: rec})
    assert refine.verification["decision"] == "refine" and "size" in refine.verification["refine_goal"]


def test_soft_constraints_pass_only_above_their_threshold() -> None:
    from agents.coordinator.evidence import integrate_one
    from agents.policies.base import Judgement
    from agents.spec import parse_spec
    from agents.verify.state import ImprovementState

    text = (
        tiny_files()["grove.toml"]
        .replace(
            "[search]",
            '[[constraints]]\nname = "clear"\njudge = "llm"\ndescription = "readable"\nthreshold = 80\n\n[search]',
        )
        .replace('kind = "search"', 'kind = "llm"')
    )
    mem = Memory()
    mem.spec = parse_spec(text)
    rec = _record(3, [10.0, 10.01])
    low = integrate_one(
        mem.study(1), rec, Judging(Judgement({"clear": (79, "dense")})), ImprovementState(), {2: rec}
    )
    assert {c["name"]: c["verdict"] for c in low.constraints} == {"small": "satisfied", "clear": "violated"}
    assert low.verification["decision"] == "refine"
    high = integrate_one(
        mem.study(1), rec, Judging(Judgement({"clear": (80, "fine")})), ImprovementState(), {2: rec}
    )
    assert high.verification["decision"] == "accept" and high.status == "evaluated"
    silent = integrate_one(mem.study(1), rec, Judging(Judgement()), ImprovementState(), {2: rec})
    assert {c["name"]: c["verdict"] for c in silent.constraints}["clear"] == "unknown"


class Deepening(SearchPolicy):
    """Proposes one child of the root and one of the newest measured node, every round."""

    def ideate(self, ctx: IdeationInput) -> list[Proposal]:
        x = len(ctx.nodes) % 6
        props = [Proposal(1, f"x={x}", {}, 0.0, {"config.toml:knob.x": x})]
        measured = [n for n in ctx.nodes if n.parent_id is not None and n.dev_mean is not None]
        if measured:
            props.append(Proposal(measured[-1].id, f"deeper x={(x + 1) % 6}", {}, 0.0,
                                  {"config.toml:knob.x": (x + 1) % 6}))  # fmt: skip
        return props


def deepen(gate_passes: bool) -> Memory:
    """Run the Deepening policy under `max_depth = 1` to the end."""
    mem = Memory(mode="auto", experiments=4, gate_passes=gate_passes)
    text = tiny_files(mode="auto", experiments=4)["grove.toml"]
    assert "[policy]\n" in text
    mem.spec = parse_spec(text.replace("[policy]\n", "[policy]\nmax_depth = 1\n"))
    graph = build_graph().compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "t"}}
    inp: Any = {"study_id": 1}
    for _ in range(100):
        out = graph.invoke(inp, cfg, context=context(mem, Deepening()), version="v2")
        if not out.interrupts:
            break
        intr = out.interrupts[0]
        first = intr.value["jobs"][0]
        mem.complete(first)
        inp = Command(resume={intr.id: [first]})
    assert mem.status == "finished"
    return mem


def test_max_depth_drops_proposals_under_unmerged_nodes_at_the_limit() -> None:
    mem = deepen(gate_passes=False)
    assert "proposal.dropped" in mem.events
    assert all(n["parent"] in (None, 1) for n in mem.rows.values())


def test_a_merged_node_takes_children_however_deep_it_sits() -> None:
    # max_depth bounds the unmerged steps below the last merge: trunk's own line may grow past it.
    mem = deepen(gate_passes=True)
    deep = [n for n in mem.rows.values() if n["parent"] not in (None, 1)]
    assert deep and all(mem.rows[n["parent"]]["status"] == "merged" for n in deep)


def test_a_better_candidate_on_an_older_trunk_is_revisited_once_on_the_current_one() -> None:
    from dataclasses import replace

    from agents.coordinator.evidence import ideation_input

    mem = Memory()
    old = mem.add(1, "x=3", {"config.toml:knob.x": 3}, status="evaluated", dev=[10.0, 10.01])
    mem.rows[old].update(verification={"decision": "accept"}, base="c0")
    merged = mem.add(1, "x=2", {"config.toml:knob.x": 2}, status="merged", dev=[9.0, 9.01])
    mem.trunk, mem.trunk_node, mem.trunk_dev = f"c{merged}", merged, [9.0, 9.01]
    ctx = ideation_input(mem.study(1), mem.nodes(1), k=2, round_no=3)
    assert ctx.revisit == [old]
    first = SearchPolicy().ideate(ctx)[0]
    assert (first.origin, first.origin_ref, first.parent_id) == ("revisit", old, merged)
    assert first.edits["config.toml:knob.x"] == 3 and first.title == "config.toml:knob.x 2 → 3"
    # Once asked, never again; and a worse one is not asked at all.
    records = mem.nodes(1)
    served = replace(
        records[0], evidence=replace(records[0].evidence, id=99, origin="revisit", origin_ref=old)
    )
    assert ideation_input(mem.study(1), [*records, served], k=2, round_no=4).revisit == []
    mem.trunk_dev = [11.0, 11.01]
    assert ideation_input(mem.study(1), mem.nodes(1), k=2, round_no=4).revisit == []


def test_an_approval_opened_by_a_step_that_crashed_is_adopted_not_doubled() -> None:
    mem = Memory(mode="approve", experiments=6)
    # A step opened this approval and crashed before its checkpoint: the state does not know it.
    orphan = mem.add(1, "x=3", {"config.toml:knob.x": 3}, status="awaiting_approval", dev=[10.0, 10.01])
    mem.rows[orphan].update(gated=True, order=1, base="c0", verification={"decision": "accept"})
    mem.opened[orphan] = 0
    mem.answer, mem.decide_after = {"approved": True, "by": "ada"}, 2
    drive(mem, {"approved": False, "by": "ada", "reason": "later ones"})
    assert mem.rows[orphan]["status"] == "merged" and "merged by ada" in mem.events
    first_other = next((i for i, e in enumerate(mem.events) if e.startswith("approval opened")), None)
    assert first_other is None or first_other > mem.events.index("merged by ada")


def test_a_decision_recorded_before_a_stop_is_applied() -> None:
    mem = Memory(mode="approve", experiments=10)
    graph, cfg, ctx, intr = until_an_approval_opens(mem)
    node = intr.value["approval"]
    mem.answer, mem.status = {"approved": True, "by": "ada"}, "stopping"  # approved, then Stop pressed
    out = graph.invoke(Command(resume={intr.id: []}), cfg, context=ctx, durability="sync", version="v2")
    assert not out.interrupts and mem.rows[node]["status"] == "merged"
    assert (
        mem.events.index("merged by ada") < len(mem.events) - 1
        and mem.events[-1] == "finished: stopped by user"
    )


def test_the_tree_view_of_changed_records_reads_as_one_built_afresh() -> None:
    from dataclasses import replace

    from agents.coordinator.evidence import tree_of
    from agents.tree.model import Tree

    def rec(i: int, parent: int | None, status: str) -> NodeRecord:
        return bare_record(i, parent, status, f"n{i}")

    first = [rec(1, None, "merged"), rec(2, 1, "running"), rec(3, 1, "proposed")]
    view = tree_of(first)
    assert tree_of(first) is view  # the same records: the same view
    view.children(1)
    # A step later: n2 finished (a new record object), n4 was proposed under it, n3 is unchanged.
    second = [first[0], replace(first[1], evidence=replace(first[1].evidence, status="evaluated")), first[2]]
    second.append(rec(4, 2, "proposed"))
    again = tree_of(second)
    fresh = Tree.of(again.nodes.values())
    assert again.nodes == tree_of([rec(1, None, "merged"), rec(2, 1, "evaluated"), rec(3, 1, "proposed"),
                                   rec(4, 2, "proposed")]).nodes  # fmt: skip
    assert all(again.children(i) == fresh.children(i) for i in (1, 2, 3, 4))
    assert again.nodes[2].status == "evaluated" and view.nodes[2].status == "running"
    # A node that left (a study's rows replaced) is gone from the view, not kept from the last one.
    third = [second[0], second[1], second[3]]
    assert sorted(tree_of(third).nodes) == [1, 2, 4]


def test_two_studies_whose_roots_share_an_id_keep_their_own_tree_views() -> None:
    from dataclasses import replace

    from agents.coordinator.evidence import tree_of

    def rec(i: int, parent: int | None, status: str, title: str) -> NodeRecord:
        return bare_record(i, parent, status, title)

    # Two databases, two studies, both rooted at node id 1, stepped in turn by one process.
    a = [rec(1, None, "merged", "a"), rec(2, 1, "running", "a2"), rec(3, 1, "evaluated", "a3")]
    b = [rec(1, None, "merged", "b"), rec(2, 1, "running", "b2")]
    view_a, view_b = tree_of(a), tree_of(b)
    a2 = [a[0], replace(a[1], evidence=replace(a[1].evidence, status="evaluated")), a[2]]
    b2 = [b[0], replace(b[1], evidence=replace(b[1].evidence, status="failed"))]
    new_a, new_b = tree_of(a2), tree_of(b2)
    assert new_a.nodes[3] is view_a.nodes[3] and new_b.nodes[1] is view_b.nodes[1]  # updated, not rebuilt
    assert new_a.nodes[2].status == "evaluated" and new_a.nodes[1] is view_a.nodes[1]
    assert (
        sorted(new_a.nodes) == [1, 2, 3]
        and sorted(new_b.nodes) == [1, 2]
        and new_b.nodes[2].status == "failed"
    )


def test_an_ideator_reads_the_latest_pruned_branches_lessons_first() -> None:
    from dataclasses import replace

    from agents.coordinator.evidence import PRUNED_LESSONS, pruned_lessons
    from agents.coordinator.records import RecordIndex

    base = _record(1, [1.0])

    def pruned(i: int, insight: str, lesson: str = "") -> NodeRecord:
        ev = replace(base.evidence, id=i, number=i, status="pruned", insight=insight, lesson=lesson)
        return replace(base, evidence=ev)

    # Two pruned branches with lessons at their tops, then one big branch of descendants without.
    tops = [
        pruned(10, "PRUNED (no gain). Lesson: x above 4 hurts", "PRUNED (no gain). Lesson: x above 4 hurts"),
        pruned(20, "PRUNED (broke size). Lesson: keep x small", "PRUNED (broke size). Lesson: keep x small"),
    ]
    # Below them, nodes whose insight reads like a lesson but whose branch was pruned above them.
    below = [pruned(100 + i, "PRUNED (x). Lesson: y") for i in range(2 * PRUNED_LESSONS)]
    got = pruned_lessons(RecordIndex([*tops, *below]))
    assert len(got) == PRUNED_LESSONS
    assert got[0].startswith("n10 ") and got[1].startswith("n20 ")  # kept, in node order
    assert got[-1].startswith(f"n{100 + 2 * PRUNED_LESSONS - 1} ")  # then the latest of the rest


class HeldOutBeside(Memory):
    """A gatekeeper whose held-out baseline is job 99, run beside the experiments until told it ended."""

    HELDOUT = 99

    def __init__(self) -> None:
        super().__init__(mode="auto", experiments=6)
        self.heldout: str = "running"  # running | done | failed

    def baseline(self, study_id: int) -> Pending | None:  # type: ignore[override]
        self.events.append("baseline")
        if self.heldout == "failed":
            raise RuntimeError("the sealed test evaluation fails on the unchanged repository")
        return None if self.heldout == "done" else Pending(self.HELDOUT, blocking=False)

    def gate(self, study_id: int, node_id: int) -> bool | Pending:  # type: ignore[override]
        if self.heldout != "done":
            self.events.append(f"gate of n{node_id} waits")
            return Pending(self.HELDOUT)
        return super().gate(study_id, node_id)


def test_experiments_run_beside_the_held_out_baseline_and_a_gate_waits_for_it() -> None:
    mem = HeldOutBeside()
    graph, cfg, ctx, out = started(mem)
    # The first step dispatched experiments (parallel = 2) without waiting for the held-out job,
    # and sent that job's task after theirs.
    assert sorted(out.interrupts[0].value["jobs"]) == sorted([*mem.jobs, mem.HELDOUT]) and len(mem.jobs) == 2
    assert mem.submitted == [*mem.jobs, mem.HELDOUT]
    ran_before = 0
    for _ in range(60):
        if not out.interrupts:
            break
        intr = out.interrupts[0]
        jobs = intr.value["jobs"]
        assert mem.HELDOUT in jobs or mem.heldout == "done"  # watched while it runs
        if mem.heldout == "running" and any(e.startswith("gate of") for e in mem.events):
            mem.heldout, ran_before = "done", len(mem.completed)  # it ends once a gate waits for it
        if mem.heldout == "done" and mem.HELDOUT in jobs:  # an ended job resumes the wait at once
            out = resume(graph, cfg, ctx, intr, [mem.HELDOUT])
            continue
        first = next(j for j in jobs if j != mem.HELDOUT)
        mem.complete(first)
        out = resume(graph, cfg, ctx, intr, [first])
    else:
        raise AssertionError("the graph did not finish")
    waited_at = next(i for i, e in enumerate(mem.events) if e.startswith("gate of"))
    assert ran_before >= 1 and mem.events[0] == "baseline"  # experiments ended while it was out
    assert "merged by auto" in mem.events[waited_at:]  # the waiting gate went on once it was in
    assert mem.events[-1] == "finished: experiment budget spent (6)"


def test_a_held_out_baseline_that_fails_stops_the_graph_before_anything_more_is_spent() -> None:
    mem = HeldOutBeside()
    graph, cfg, ctx, out = started(mem)
    intr = out.interrupts[0]
    first = next(j for j in intr.value["jobs"] if j != mem.HELDOUT)
    mem.complete(first)
    mem.heldout = "failed"  # in the same wake as an experiment's end
    submitted = len(mem.submitted)
    try:
        resume(graph, cfg, ctx, intr, [first, mem.HELDOUT])
    except RuntimeError as exc:
        assert "fails on the unchanged repository" in str(exc)
    else:
        raise AssertionError("the failure did not reach the driver")
    assert len(mem.submitted) == submitted and mem.completed == [mem.jobs[first]]


def test_a_study_with_nothing_left_to_run_still_sends_its_held_out_baseline_and_waits_for_it() -> None:
    class OutOfTime(HeldOutBeside):
        def study(self, study_id: int) -> StudyView:
            return replace(super().study(study_id), elapsed_hours=1e6)  # its time budget is spent at once

    mem = OutOfTime()
    graph, cfg, ctx, out = started(mem)
    intr = out.interrupts[0]
    assert intr.value["jobs"] == [mem.HELDOUT] and mem.submitted == [mem.HELDOUT] and not mem.jobs
    mem.heldout = "done"
    out = resume(graph, cfg, ctx, intr, [mem.HELDOUT])
    assert not out.interrupts and mem.events[-1].startswith("finished: time budget spent")


class DevBeside(HeldOutBeside):
    """A gatekeeper whose baseline dev runs are job 98 (blocking), then its held-out runs job 99."""

    DEV = 98

    def __init__(self) -> None:
        super().__init__()
        self.dev: str = "running"  # running | done | failed
        self.trunk_dev = []  # no value before the dev job ends

    def baseline(self, study_id: int) -> Pending | None:  # type: ignore[override]
        if self.dev == "failed":
            raise RuntimeError("the dev evaluation fails on the unchanged repository")
        if self.dev == "running":
            self.events.append("baseline dev")
            return Pending(self.DEV)
        self.trunk_dev = [1.0, 1.01]
        return super().baseline(study_id)

    def record(self, study_id: int, result: Integration) -> None:
        assert self.trunk_dev, "a node was integrated before trunk's dev value was in"
        super().record(study_id, result)


class ReadsBaseline(SearchPolicy):
    capabilities = replace(SEARCH, reads_baseline=True)


def test_the_first_experiments_run_beside_the_baseline_dev_job_and_wait_for_it_to_be_integrated() -> None:
    mem = DevBeside()
    graph, cfg, ctx, out = started(mem)
    intr = out.interrupts[0]
    # The search policy proposes without trunk's value: the first round went out with the dev job,
    # and only that job is watched (no gain can be measured before it ends).
    assert len(mem.jobs) == 2 and mem.submitted == list(mem.jobs)
    assert intr.value["jobs"] == [mem.DEV]
    first = next(iter(mem.jobs))
    mem.complete(first)  # an experiment that ends first waits, unread (`record` would fail)
    out = resume(graph, cfg, ctx, intr, [first])  # a wake that names it is not heard
    intr = out.interrupts[0]
    assert intr.value["jobs"] == [mem.DEV] and not any(r["order"] for r in mem.rows.values())
    mem.dev = "done"
    out = resume(graph, cfg, ctx, intr, [mem.DEV])
    intr = out.interrupts[0]
    # Once it ended: the held-out job went out (after the experiments'), and the ended experiment is read.
    assert mem.submitted == [*mem.jobs, mem.HELDOUT] and first in intr.value["jobs"]
    out = resume(graph, cfg, ctx, intr, [first])
    assert mem.rows[mem.jobs[first]]["order"] == 1


def test_a_baseline_dev_job_that_fails_stops_the_graph_before_more_is_sent() -> None:
    mem = DevBeside()
    graph, cfg, ctx, out = started(mem)
    mem.dev = "failed"
    submitted = list(mem.submitted)
    try:
        resume(graph, cfg, ctx, out.interrupts[0], [mem.DEV])
    except RuntimeError as exc:
        assert "fails on the unchanged repository" in str(exc)
    else:
        raise AssertionError("the failure did not reach the driver")
    assert mem.submitted == submitted and not any(r["order"] for r in mem.rows.values())


def test_a_policy_that_reads_the_baseline_proposes_only_once_it_is_in() -> None:
    mem = DevBeside()
    graph = build_graph().compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "t"}}
    ctx = context(mem, ReadsBaseline())
    out = graph.invoke({"study_id": 1}, cfg, context=ctx, durability="sync", version="v2")
    assert out.interrupts[0].value["jobs"] == [mem.DEV] and not mem.jobs and not mem.submitted
    mem.dev = "done"
    out = resume(graph, cfg, ctx, out.interrupts[0], [mem.DEV])
    assert len(mem.jobs) == 2 and mem.trunk_dev


def test_a_gain_is_paired_against_the_trunk_the_node_was_built_on() -> None:
    from dataclasses import replace

    from agents.coordinator.evidence import integrate_one
    from agents.verify.state import ImprovementState

    mem = Memory()
    mem.trunk, mem.trunk_dev = "c7", [10.0, 10.01]  # trunk moved on while the node ran
    rec = replace(_record(3, [3.0, 3.01]), base_commit="c5")
    made = replace(_record(2, [1.0, 1.01]), trunk_commit="c5")  # the merge that made trunk c5
    made = replace(made, evidence=replace(made.evidence, id=9, status="merged"))
    out = integrate_one(mem.study(1), rec, SearchPolicy(), ImprovementState(), {2: rec, 9: made})
    assert out.gain == pytest.approx(2.0) and out.verification["decision"] == "accept"
    assert out.verification["trunk_gain"]["gain"] == pytest.approx(-7.0)
    # On the current trunk the two gains are one, and no second is kept.
    now = integrate_one(
        mem.study(1), replace(rec, base_commit="c7"), SearchPolicy(), ImprovementState(), {2: rec}
    )
    assert now.gain == pytest.approx(-7.0) and "trunk_gain" not in now.verification


class Forgetful(Judging):
    """A verifier that abandons what it refines, and a state writer that rewrites every concern away."""

    def update_state(self, state: dict[str, Any], *args: Any) -> dict[str, Any]:
        return {**state, "concerns": ["the model's own concern"]}


def test_grove_s_own_concerns_survive_the_state_writer() -> None:
    from agents.policies.base import Judgement

    mem = Memory(mode="auto", experiments=1)
    mem.add(1, "x=5", {"config.toml:knob.x": 5})  # improves, but size 5 > 4: refined, then abandoned
    drive(mem, {}, Forgetful(Judgement(call="restart", why="the knob rail is broken")))
    assert mem.rows[2]["verification"]["decision"] == "restart"
    concerns = mem.state["concerns"]
    assert "the model's own concern" in concerns  # the rewrite is taken,
    assert any("abandoned by the verifier" in c for c in concerns), concerns  # and Grove's concern stays


def test_reach_counts_the_unmerged_steps_below_the_nearest_merge() -> None:
    from agents.coordinator.records import RecordIndex

    mem = Memory()  # n1, the root, is merged
    a = mem.add(1, "a", {"config.toml:knob.x": 1}, status="evaluated", dev=[1.0])
    b = mem.add(a, "b", {"config.toml:knob.x": 2}, status="merged", dev=[2.0])
    c = mem.add(b, "c", {"config.toml:knob.x": 3}, status="evaluated", dev=[3.0])
    d = mem.add(c, "d", {"config.toml:knob.x": 4}, status="proposed")
    index = RecordIndex(mem.nodes(1))
    assert index.reaches() == {1: 0, a: 1, b: 0, c: 1, d: 2}
    assert all(index.reach(n) == r for n, r in index.reaches().items())


class Recording(SearchPolicy):
    """The search policy, keeping the space each ideation was given."""

    def __init__(self) -> None:
        super().__init__()
        self.spaces: list[dict[str, dict[str, Any]]] = []

    def ideate(self, ctx: IdeationInput) -> list[Proposal]:
        self.spaces.append(ctx.search_space)
        return super().ideate(ctx)


def test_a_merge_on_a_range_bound_is_a_finding_and_widens_the_range_for_later_proposals() -> None:
    mem = Memory(mode="auto", experiments=4)
    toml = tiny_files(mode="auto", experiments=4)["grove.toml"]
    toml = toml.replace("parallel = 2\n", "parallel = 1\n")  # it runs alone, on the trunk it was built on
    mem.spec = parse_spec(toml.replace("values = [0, 1, 2, 3, 4, 5]", "low = 0.5, high = 3.0"))
    # Measured before it: the score rises toward x = 3 (10 - (x - 3)^2), evidence the bound may hold it back.
    for order, x in enumerate((1.0, 1.5, 2.0), start=1):
        row = mem.add(1, f"x to {x}", {"config.toml:knob.x": x}, status="evaluated", dev=[10 - (x - 3) ** 2])
        mem.rows[row]["order"] = order
    at_bound = mem.add(1, "x to its upper bound", {"config.toml:knob.x": 3.0})  # the best score: 10
    policy = Recording()
    drive(mem, {}, policy)
    assert mem.rows[at_bound]["status"] == "merged"
    assert "search.widened" in mem.events
    finding = next(f for f in mem.state["verified_findings"] if "high bound" in f["text"])
    assert finding["node_ids"] == [at_bound] and "later proposals may go to 4.25" in finding["text"]
    assert mem.spec.search["config.toml:knob.x"].high == 3.0  # the spec itself is not rewritten
    assert policy.spaces[-1]["config.toml:knob.x"]["high"] == 4.25  # half the width beyond the old bound
    assert any(
        r["edits"]["config.toml:knob.x"] > 3.0 for r in mem.rows.values()
    )  # a later proposal went there


def test_widening_is_off_with_policy_widen_false() -> None:
    mem = Memory(mode="auto", experiments=4)
    toml = tiny_files(mode="auto", experiments=4)["grove.toml"]
    toml = toml.replace("values = [0, 1, 2, 3, 4, 5]", "low = 0.5, high = 3.0")
    mem.spec = parse_spec(toml.replace("[policy]", "[policy]\nwiden = false"))
    at_bound = mem.add(1, "x to its upper bound", {"config.toml:knob.x": 3.0})
    policy = Recording()
    drive(mem, {}, policy)
    assert mem.rows[at_bound]["status"] == "merged" and "search.widened" not in mem.events
    assert all(s["config.toml:knob.x"]["high"] == 3.0 for s in policy.spaces)
