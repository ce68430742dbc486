from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from agents import configfiles
from agents.llm.model import Turn
from agents.policies import optuna_bridge
from agents.policies.base import (
    IdeationInput,
    ImplementationError,
    NodeEvidence,
    RefineRequest,
)
from agents.policies.search import SearchPolicy
from agents.policies.space import Space
from backend.core.config import PROJECT_ROOT
from tests.support.inputs import edits_input

SPACE = {
    "c.toml:m.hidden": {"values": [8, 16, 32, 64], "low": None, "high": None, "log": False, "integer": False},
    "c.toml:t.lr": {"values": None, "low": 1e-4, "high": 1e-1, "log": True, "integer": False},
}
BASE = {"c.toml:m.hidden": 8, "c.toml:t.lr": 0.001}


def ev(
    i: int, parent: int | None, edits: dict[str, object], mean: float | None, status: str = "evaluated"
) -> NodeEvidence:
    return NodeEvidence(
        id=i, parent_id=parent, depth=0 if parent is None else 1, status=status, title=f"n{i}",
        edits=edits, origin="policy", dev_mean=mean, dev_std=0.0, dev_n=3,
        gain=None if mean is None else mean - 0.5, gain_lcb=None, dev_metrics={}, constraints=[],
        summary="", insight="", number=i,
    )  # fmt: skip


def ctx(nodes: list[NodeEvidence], round_no: int = 0, k: int = 3) -> IdeationInput:
    return IdeationInput(
        goal="g", metric="acc", maximize=True, search_space=SPACE, base_values=BASE, trunk_node_id=1,
        trunk_dev_mean=0.5, nodes=nodes, improvement_state={}, pruned_lessons=[], validated_findings=[],
        refine=[], plateau_level=0, k=k, round_no=round_no, seed=1,
    )  # fmt: skip


def test_ideation_is_deterministic_concrete_and_new() -> None:
    nodes = [ev(1, None, BASE, 0.5, "merged"), ev(2, 1, {**BASE, "c.toml:m.hidden": 16}, 0.6)]
    a = SearchPolicy().ideate(ctx(nodes))
    b = SearchPolicy().ideate(ctx(nodes))
    assert [p.edits for p in a] == [p.edits for p in b] and len(a) == 3
    seen = {json.dumps(n.edits, sort_keys=True) for n in nodes}
    for p in a:
        assert set(p.edits) == set(SPACE)
        assert p.edits["c.toml:m.hidden"] in (8, 16, 32, 64)
        assert 1e-4 <= p.edits["c.toml:t.lr"] <= 1e-1
        assert json.dumps(p.edits, sort_keys=True) not in seen
        assert set(p.hypothesis) == {"mechanism", "hypothesis", "observable", "risks"}
    # Exploit: at least one child is a one-key move under the best node.
    assert any(p.parent_id == 2 for p in a)


def test_ideation_depends_on_round_and_seed() -> None:
    nodes = [ev(1, None, BASE, 0.5, "merged")]
    assert [p.edits for p in SearchPolicy().ideate(ctx(nodes, 0))] != [
        p.edits for p in SearchPolicy().ideate(ctx(nodes, 1))
    ]


@pytest.mark.parametrize(
    ("name", "text", "check"),
    [
        ("c.toml", "# keep me\n[m]\nhidden = 8  # units\n[t]\nlr = 0.001\n", "# keep me"),
        ("c.yaml", "m:\n  hidden: 8\nt:\n  lr: 0.001\n", "hidden: 32"),
        ("c.json", '{\n  "m": {"hidden": 8},\n  "t": {"lr": 0.001}\n}\n', '"hidden": 32'),
    ],
)
def test_implementer_applies_edits_exactly(tmp_path: Path, name: str, text: str, check: str) -> None:
    (tmp_path / name).write_text(text)
    edits = {f"{name}:m.hidden": 32, f"{name}:t.lr": 0.02}
    SearchPolicy().implement(
        tmp_path,
        edits_input(edits, [name]),
    )
    new = (tmp_path / name).read_text()
    assert configfiles.get_key(name, new, "m.hidden") == 32
    assert configfiles.get_key(name, new, "t.lr") == 0.02
    assert check in new


def test_implementer_refuses_non_editable_and_escaping_files(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text("[m]\nhidden = 8\n")
    with pytest.raises(ImplementationError, match="not editable"):
        SearchPolicy().implement(
            tmp_path,
            edits_input({"c.toml:m.hidden": 4}, ["other.toml"]),
        )
    outside = tmp_path.parent / "outside.toml"
    outside.write_text("[m]\nhidden = 8\n")
    (tmp_path / "link.toml").symlink_to(outside)
    with pytest.raises(ImplementationError, match="outside the worktree"):
        SearchPolicy().implement(
            tmp_path,
            edits_input({"link.toml:m.hidden": 4}, ["*.toml"]),
        )
    with pytest.raises(ImplementationError, match="must be a path inside the repository"):
        SearchPolicy().implement(
            tmp_path,
            edits_input({"../outside.toml:m.hidden": 4}, ["**"]),
        )
    assert "hidden = 8" in outside.read_text()


# -- the Optuna bridge --------------------------------------------------------------------------

MIXED = {
    "c.toml:m.kind": {"values": ["a", "b", "c"], "low": None, "high": None, "log": False, "integer": None},
    "c.toml:m.layers": {"values": None, "low": 1, "high": 9, "log": False, "integer": None},
    "c.toml:t.lr": {"values": None, "low": 1e-4, "high": 1e-1, "log": True, "integer": None},
}
MIXED_BASE = {"c.toml:m.kind": "a", "c.toml:m.layers": 2, "c.toml:t.lr": 0.001}
SIZE = {"name": "size", "metric": "n_params", "max": 1000.0, "min": None, "judge": "metric"}


def mixed_nodes() -> list[NodeEvidence]:
    out = [ev(1, None, MIXED_BASE, 0.5, "merged")]
    for i, (kind, layers, lr, acc) in enumerate(
        [("b", 3, 0.01, 0.6), ("c", 5, 0.02, 0.7), ("a", 8, 0.05, 0.65), ("b", 6, 0.003, 0.62)], start=2
    ):
        n = ev(i, 1, {"c.toml:m.kind": kind, "c.toml:m.layers": layers, "c.toml:t.lr": lr}, acc)
        out.append(replace(n, dev_metrics={"n_params": 200.0 * layers}))
    return out


def suggest(
    nodes: list[NodeEvidence], seed: int, sampler: str = "tpe", n: int = 4
) -> list[dict[str, object]]:
    space = Space(MIXED, MIXED_BASE)
    study = optuna_bridge.replay(
        space,
        nodes,
        [SIZE],
        maximize=True,
        sampler=optuna_bridge.make_sampler(sampler, seed),  # type: ignore[arg-type]
    )
    seen = {space.key_of({**MIXED_BASE, **n.edits}) for n in nodes}
    return optuna_bridge.ask(study, space, n, seen)


def test_replaying_the_same_history_with_the_same_seed_gives_the_same_suggestions() -> None:
    nodes = mixed_nodes()
    for sampler in ("tpe", "random", "gp"):
        assert suggest(nodes, 7, sampler) == suggest(nodes, 7, sampler)
    assert suggest(nodes, 7) != suggest(nodes, 8)


def test_distributions_follow_the_search_section() -> None:
    dists = optuna_bridge.distributions(Space(MIXED, MIXED_BASE))
    assert isinstance(dists["c.toml:m.kind"], CategoricalDistribution)
    assert dists["c.toml:m.kind"].choices == ("a", "b", "c")
    assert isinstance(dists["c.toml:m.layers"], IntDistribution) and dists["c.toml:m.layers"].high == 9
    assert isinstance(dists["c.toml:t.lr"], FloatDistribution) and dists["c.toml:t.lr"].log
    for a in suggest(mixed_nodes(), 3, n=12):
        assert a["c.toml:m.kind"] in ("a", "b", "c")
        assert type(a["c.toml:m.layers"]) is int and 1 <= a["c.toml:m.layers"] <= 9  # type: ignore[operator]
        assert 1e-4 <= a["c.toml:t.lr"] <= 1e-1  # type: ignore[operator]


def test_trials_carry_constraints_from_dev_metrics_failures_and_pending_nodes() -> None:
    nodes = mixed_nodes()
    nodes[4] = replace(nodes[4], dev_metrics={"n_params": 1600.0})  # over the 1000 limit
    failed = replace(
        ev(6, 1, {"c.toml:m.kind": "c", "c.toml:m.layers": 9, "c.toml:t.lr": 0.1}, None), status="failed"
    )
    pending = replace(
        ev(7, 1, {"c.toml:m.kind": "a", "c.toml:m.layers": 1, "c.toml:t.lr": 0.1}, None), status="queued"
    )
    outside = ev(8, 1, {"c.toml:m.kind": "zzz"}, 0.9)  # a value outside the space is not a trial
    space = Space(MIXED, MIXED_BASE)
    sampler = optuna_bridge.make_sampler("tpe", 0)
    study = optuna_bridge.replay(
        space, [*nodes, failed, pending, outside], [SIZE], maximize=True, sampler=sampler
    )
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 5 + [TrialState.FAIL, TrialState.RUNNING]
    ok = {optuna_bridge.ADMITTED: -1.0}
    assert trials[1].constraints == {"size": pytest.approx(-0.4), **ok}  # 600 params: feasible
    assert trials[4].constraints == {"size": pytest.approx(0.6), **ok}  # 1600 params: 60% over
    assert trials[0].constraints == {"size": optuna_bridge.INFEASIBLE, **ok}  # the metric was not reported
    assert trials[2].value == 0.7


def test_a_sampler_that_repeats_itself_still_fills_the_batch() -> None:
    space = Space({"config.toml:x": {"low": 0.0, "high": 6.0}}, {"config.toml:x": 1.0})
    # A sampler sure of one point (what a Gaussian process does on a noiseless objective).
    stuck = optuna.create_study(sampler=optuna.samplers.GridSampler({"config.toml:x": [3.0]}))
    seen = {space.key_of({"config.toml:x": 3.0})}
    got = optuna_bridge.ask(stuck, space, 3, seen, seed=5)
    assert len(got) == 3 and len({space.key_of(a) for a in got}) == 3
    assert all(0.0 <= a["config.toml:x"] <= 6.0 and a["config.toml:x"] != 3.0 for a in got)


def test_samplers_by_name() -> None:
    names = {n: optuna_bridge.make_sampler(n, 0).__class__.__name__ for n in ("tpe", "gp", "random")}  # type: ignore[arg-type]
    assert names == {"tpe": "TPESampler", "gp": "GPSampler", "random": "RandomSampler"}
    with pytest.raises(ValueError, match="cmaes"):
        optuna_bridge.make_sampler("cmaes", 0)  # type: ignore[arg-type]


def test_auto_is_gp_where_torch_and_scipy_are_installed_and_tpe_elsewhere() -> None:
    # The test environment installs torch and scipy (the dev extra).
    assert optuna_bridge.resolve("auto") == "gp" and SearchPolicy().sampler == "gp"
    assert isinstance(optuna_bridge.make_sampler("auto", 0), optuna.samplers.GPSampler)
    hidden = (
        "import sys; sys.modules['torch'] = None\n"
        "from agents.policies import optuna_bridge as b\n"
        "print(b.resolve('auto'), type(b.make_sampler('auto', 0)).__name__)\n"
        "try:\n    b.make_sampler('gp', 0)\nexcept b.SamplerUnavailable as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", hidden], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "tpe TPESampler" and "needs torch and scipy" in out[1]


# -- AREX in the search policy -------------------------------------------------------------------


def constrained_ctx(refine: list[RefineRequest], max_depth: int = 6) -> IdeationInput:
    """Accuracy grows with layers; n_params = 200 * layers must stay <= 1000 (layers <= 5)."""
    nodes = mixed_nodes()
    big = replace(
        ev(6, 3, {"c.toml:m.kind": "c", "c.toml:m.layers": 9, "c.toml:t.lr": 0.02}, 0.8),
        depth=2, dev_metrics={"n_params": 1800.0}, status="rejected",
        constraints=[{"name": "size", "verdict": "violated"}],
    )  # fmt: skip
    return IdeationInput(
        goal="g", metric="acc", maximize=True, search_space=MIXED, base_values=MIXED_BASE, trunk_node_id=1,
        trunk_dev_mean=0.5, nodes=[*nodes, big], improvement_state={}, pruned_lessons=[], validated_findings=[],
        refine=refine, plateau_level=0, k=3, round_no=2, seed=1, constraints=[SIZE], max_depth=max_depth,
    )  # fmt: skip


def test_a_refine_request_comes_first_with_a_move_predicted_feasible() -> None:
    req = RefineRequest(6, ("size",), "fix size")
    props = SearchPolicy().ideate(constrained_ctx([req]))
    first = props[0]
    assert first.origin == "refine" and first.origin_ref == 6 and first.parent_id == 6
    assert 200 * first.edits["c.toml:m.layers"] <= 1000  # predicted and actually within the limit
    assert first.edits["c.toml:m.layers"] >= 4  # keeps as much of the size-driven gain as it can
    # The infeasible node never serves as a base for the sampler's suggestions.
    assert all(p.parent_id != 6 for p in props[1:])


def test_a_refine_chain_ends_at_max_depth() -> None:
    props = SearchPolicy().ideate(constrained_ctx([RefineRequest(6, ("size",), "fix size")], max_depth=2))
    assert all(p.origin != "refine" for p in props)
    assert all(p.parent_id in (1, 2, 3, 4, 5) for p in props)  # depth-1 parents at most


def test_a_restart_request_leaves_the_abandoned_branch_from_the_root() -> None:
    ctx = replace(constrained_ctx([]), restart=[6])
    props = SearchPolicy().ideate(ctx)
    restart = [p for p in props if p.origin == "restart"]
    assert len(restart) == 1 and restart[0].parent_id == 1 and restart[0].origin_ref == 6
    space = Space(MIXED, MIXED_BASE)
    abandoned = {**MIXED_BASE, **ctx.nodes[-1].edits}
    others = [space.distance(restart[0].edits, {**MIXED_BASE, **n.edits}) for n in ctx.nodes[1:-1]]
    assert space.distance(restart[0].edits, abandoned) >= 0.5 * max(others)


def test_pruned_directions_do_not_parent_suggestions() -> None:
    ctx = constrained_ctx([])
    nodes = [replace(n, status="pruned") if n.id in (3, 4) else n for n in ctx.nodes]
    props = SearchPolicy().ideate(replace(ctx, nodes=nodes, k=6))
    assert props and all(p.parent_id not in (3, 4, 6) for p in props)


def test_a_refine_request_for_an_unreported_metric_still_gets_a_child() -> None:
    ctx = constrained_ctx([RefineRequest(6, ("size",), "size unknown")])
    nodes = [replace(n, dev_metrics={}, constraints=[]) for n in ctx.nodes]  # nobody reported n_params
    props = SearchPolicy().ideate(replace(ctx, nodes=nodes))
    assert props[0].origin == "refine" and props[0].parent_id == 6


def test_the_restart_child_is_far_from_the_abandoned_branch() -> None:
    import random as _random

    ctx = replace(constrained_ctx([]), restart=[6])
    child = next(p for p in SearchPolicy().ideate(ctx) if p.origin == "restart")
    space = Space(MIXED, MIXED_BASE)
    branch = [{**MIXED_BASE, **n.edits} for n in ctx.nodes if n.id in (3, 6)]  # n6 and its ancestor n3
    rng = _random.Random(0)
    randoms = [
        min(space.distance({"c.toml:m.kind": rng.choice("abc"), "c.toml:m.layers": rng.randint(1, 9),
                            "c.toml:t.lr": 10 ** rng.uniform(-4, -1)}, b) for b in branch)
        for _ in range(200)
    ]  # fmt: skip
    mine = min(space.distance(child.edits, b) for b in branch)
    assert mine >= sorted(randoms)[int(0.9 * len(randoms))]  # farther than 90% of random points


def test_a_node_the_gate_turned_down_marks_its_region_inadmissible() -> None:
    nodes = mixed_nodes()
    gate_failed = replace(
        nodes[2], status="rejected", constraints=[{"name": "size", "verdict": "satisfied", "value": 1000.0}]
    )
    broke_size = replace(nodes[3], status="rejected", dev_metrics={"n_params": 1600.0})
    space = Space(MIXED, MIXED_BASE)
    sampler = optuna_bridge.make_sampler("tpe", 0)
    study = optuna_bridge.replay(
        space, [*nodes[:2], gate_failed, broke_size], [SIZE], maximize=True, sampler=sampler
    )
    admitted = [t.constraints[optuna_bridge.ADMITTED] for t in study.get_trials(deepcopy=False)]
    assert admitted == [-1.0, -1.0, 1.0, -1.0]  # a broken constraint says so through its own value


class ScriptedIdeator:
    """A deterministic model double: answers every ideator call with the same children."""

    name = "scripted"

    def __init__(self, children: list[dict[str, object]]) -> None:
        self.children = children
        self.seen: list[str] = []

    def complete(
        self, role: str, messages: list[dict[str, object]], tools: object = None, schema: object = None
    ) -> Turn:
        self.seen.append(str(messages[-1]["content"]))
        return Turn(json.dumps({"children": self.children}), [], 10, 10, 0.0)


def test_the_llm_ideators_first_root_child_answers_a_restart_request() -> None:
    from agents.policies.llm.policy import LlmPolicy

    child = {"hypothesis": "h", "observable": "o", "risks": "r", "expected_gain": 0.1}
    model = ScriptedIdeator([
        {"parent_id": 2, "title": "tune the second idea further", "mechanism": "tune it", **child},
        {"parent_id": 1, "title": "a different approach entirely", "mechanism": "another model", **child},
        {"parent_id": 1, "title": "another fresh direction from scratch", "mechanism": "new data", **child},
    ])  # fmt: skip
    nodes = [ev(1, None, {}, 0.5, "merged"), ev(2, 1, {}, 0.6), replace(ev(3, 1, {}, None), status="failed")]
    ctx = replace(ctx_of(nodes), restart=[3])
    props = LlmPolicy(model).ideate(ctx)  # type: ignore[arg-type]
    assert [(p.parent_id, p.origin, p.origin_ref) for p in props] == [
        (2, "policy", None), (1, "restart", 3), (1, "policy", None),
    ]  # fmt: skip
    assert '"restart_from_root_away_from": [\n  3\n ]' in model.seen[0]


def test_the_llm_ideator_sees_and_answers_node_numbers_not_database_ids() -> None:
    from agents.policies.llm.policy import LlmPolicy

    child = {"mechanism": "m", "hypothesis": "h", "observable": "o", "risks": "r", "expected_gain": 0.1}
    model = ScriptedIdeator([
        {"parent_id": 2, "title": "tune the second idea further", **child},
        {"parent_id": 102, "title": "a parent the model was never shown", **child},
    ])  # fmt: skip
    # Study 2's nodes: ids 101-103 in the database, n1-n3 on every page.
    nodes = [
        replace(ev(100 + i, None if i == 1 else 101, {}, 0.5), number=i, parent_id=None if i == 1 else 101)
        for i in (1, 2, 3)
    ]
    ctx = replace(ctx_of(nodes), trunk_node_id=101, restart=[103])
    props = LlmPolicy(model).ideate(ctx)  # type: ignore[arg-type]
    assert [(p.parent_id, p.title) for p in props if not p.dropped] == [(102, "tune the second idea further")]
    assert [p.dropped for p in props if p.dropped] == [
        "its parent n102 is not a node that may take children (unknown, pruned, cancelled)"
    ]
    shown = json.loads(model.seen[0])
    assert [(n["id"], n["parent_id"]) for n in shown["nodes"]] == [(1, None), (2, 1), (3, 1)]
    assert shown["trunk_node_id"] == 1 and shown["restart_from_root_away_from"] == [3]


class ScriptedState:
    """A deterministic model double for the state updater: answers with a fixed state."""

    name = "scripted"

    def __init__(self, answer: dict[str, object]) -> None:
        self.answer = answer
        self.seen: list[str] = []

    def complete(
        self, role: str, messages: list[dict[str, object]], tools: object = None, schema: object = None
    ) -> Turn:
        self.seen.append(str(messages[-1]["content"]))
        return Turn(json.dumps(self.answer), [], 10, 10, 0.0)


def test_the_llm_state_updater_sees_node_numbers_and_its_answer_is_stored_by_id() -> None:
    from agents.policies.llm.policy import LlmPolicy

    numbers = {101: 1, 102: 2, 103: 3}  # study 2: ids in the database, numbers on every page
    state = {
        "verified_findings": [{"text": "x helps", "node_ids": [102]}],
        "open_constraints": [{"name": "size", "status": "violated", "detail": "", "node_ids": [103]}],
        "rejected_candidates": [{"node_id": 103, "reason": "too big"}],
        "concerns": [],
        "next_plan": [],
    }
    model = ScriptedState({
        "verified_findings": [{"text": "x helps, y too", "node_ids": [2, 3, 9]}],  # n9 does not exist
        "open_constraints": [],
        "rejected_candidates": [{"node_id": 1, "reason": "baseline"}, {"node_id": 7, "reason": "unknown"}],
        "concerns": ["c"],
        "next_plan": ["p"],
    })  # fmt: skip
    recent = [replace(ev(103, 101, {}, 0.6), number=3)]
    new = LlmPolicy(model).update_state(state, recent, numbers)  # type: ignore[arg-type]
    shown = json.loads(model.seen[0])
    assert shown["state"]["verified_findings"][0]["node_ids"] == [2]
    assert shown["state"]["rejected_candidates"] == [{"node_id": 3, "reason": "too big"}]
    assert [e["id"] for e in shown["new_evidence"]] == [3]
    assert new["verified_findings"] == [{"text": "x helps, y too", "node_ids": [102, 103]}]
    assert new["rejected_candidates"] == [{"node_id": 101, "reason": "baseline"}]


def ctx_of(nodes: list[NodeEvidence]) -> IdeationInput:
    return replace(ctx(nodes), k=3)


def test_a_long_history_is_windowed_keeping_the_best_the_running_and_the_recent() -> None:
    space = Space(SPACE, BASE)
    nodes = [ev(1, None, {}, 0.5)]
    for i in range(2, 1202):  # 1,200 measured nodes, scores rising with id except a few early stars
        score = 10.0 if i in (5, 6, 7) else i / 10_000
        nodes.append(ev(i, 1, {"c.toml:t.lr": 1e-4 + i * 1e-5}, score))
    nodes.append(ev(1300, 1, {"c.toml:t.lr": 0.05}, None, status="running"))
    study = optuna_bridge.replay(
        space, nodes, [], maximize=True, sampler=optuna.samplers.RandomSampler(seed=0)
    )
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == optuna_bridge.HISTORY
    kept = optuna_bridge.window(nodes, maximize=True)
    assert kept[0].parent_id is None and {5, 6, 7, 1201, 1300} <= {n.id for n in kept}
    # A search proposal still hangs under a node, and asking stays deterministic.
    policy = SearchPolicy(sampler="tpe")
    first = policy.ideate(ctx(nodes, k=2))
    assert first == policy.ideate(ctx(nodes, k=2)) and len(first) == 2
    lrs = {round(t.params["c.toml:t.lr"], 8) for t in trials}
    assert {round(1e-4 + i * 1e-5, 8) for i in (5, 6, 7)} <= lrs  # the best, however old
    assert round(1e-4 + 1201 * 1e-5, 8) in lrs  # the newest
    assert any(t.state == TrialState.RUNNING for t in trials)  # what is running now
    assert study.best_value == 10.0
    # Minimizing keeps the other end.
    low = optuna_bridge.replay(
        space, nodes, [], maximize=False, sampler=optuna.samplers.RandomSampler(seed=0)
    )
    assert low.best_value == min(n.dev_mean for n in nodes if n.dev_mean is not None)


def test_preloading_imports_the_gp_samplers_dependencies_before_any_study_asks() -> None:
    code = (
        "import sys; from agents.policies import optuna_bridge as o\n"
        "assert 'scipy.stats' not in sys.modules and 'torch' not in sys.modules\n"
        "o.preload(); assert 'scipy.stats' in sys.modules and 'torch' in sys.modules"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


class Answers:
    """A model double that answers each call with the next text of a list (and records the prompts)."""

    name = "scripted"

    def __init__(self, *texts: str) -> None:
        self.texts = list(texts)
        self.prompts: list[list[dict[str, object]]] = []

    def complete(
        self, role: str, messages: list[dict[str, object]], tools: object = None, schema: object = None
    ) -> Turn:
        self.prompts.append(list(messages))
        return Turn(self.texts.pop(0), [], 10, 10, 0.0)


def test_one_bad_child_does_not_sink_the_batch_and_a_useless_answer_is_asked_again_with_the_error() -> None:
    from agents.policies.llm.policy import LlmPolicy

    good = {"parent_id": 1, "title": "a sound idea", "mechanism": "m", "expected_gain": 0.05}
    model = Answers(
        "I think the knob matters.",  # no JSON: asked again, told why
        json.dumps({"children": [{"parent_id": 1, "title": ""}, good, {"title": "no parent"}]}),
    )
    nodes = [ev(1, None, {}, 0.5, "merged")]
    props = LlmPolicy(model).ideate(ctx_of(nodes))  # type: ignore[arg-type]
    assert [p.title for p in props] == ["a sound idea"]
    retry = str(model.prompts[1][-1]["content"])
    assert "could not be used: it holds no JSON object" in retry


def test_expected_gain_is_clipped_and_shrunk_against_measured_gains() -> None:
    from agents.policies.llm.ideation import prior_of

    nodes = [
        ev(1, None, {}, 0.5, "merged"),
        replace(ev(2, 1, {}, 0.6), gain=0.1),
        replace(ev(3, 1, {}, 0.4), gain=-0.05),
    ]
    assert prior_of(50.0, nodes, 0.5) == pytest.approx(0.2 * 3 / 6)  # clipped to 2 x 0.1, shrunk by 3/6
    assert prior_of(-50.0, nodes, 0.5) == pytest.approx(-0.2 * 3 / 6)
    assert prior_of(0.04, nodes, 0.5) == pytest.approx(0.04 * 3 / 6)
    assert prior_of(9.0, nodes[:1], 0.5) == pytest.approx(0.05 / 4)  # nothing measured: a tenth of trunk
    assert prior_of(float("nan"), nodes, 0.5) == 0.0


def test_findings_that_cite_nodes_not_accepted_are_dropped_and_the_verifier_sees_the_diff() -> None:
    from agents.policies.llm.policy import LlmPolicy

    model = Answers(json.dumps({
        "verified_findings": [{"text": "x helps", "node_ids": [2]}, {"text": "y helps", "node_ids": [3]},
                              {"text": "unsupported", "node_ids": []}],
        "open_constraints": [], "rejected_candidates": [], "concerns": [], "next_plan": [],
    }))  # fmt: skip
    state = {
        "verified_findings": [],
        "open_constraints": [],
        "rejected_candidates": [],
        "concerns": [],
        "next_plan": [],
    }
    new = LlmPolicy(model).update_state(state, [], {1: 1, 2: 2, 3: 3}, accepted=frozenset({2}))  # type: ignore[arg-type]
    assert new["verified_findings"] == [{"text": "x helps", "node_ids": [2]}]
    verifier = Answers("not json", json.dumps({"verdicts": [{"name": "small", "confidence": 80}]}))
    node = replace(ev(2, 1, {}, 0.6), diff="-x = 0\n+x = 3")
    judged = LlmPolicy(verifier).verify(node, [{"name": "small", "description": "a small change"}])  # type: ignore[arg-type]
    assert judged.verdicts == {"small": (80, "")}
    assert "+x = 3" in str(verifier.prompts[0][-1]["content"]) and "could not be used" in str(
        verifier.prompts[1][-1]["content"]
    )


def test_the_ideator_sees_a_bounded_tree_keeping_root_trunk_best_recent_and_their_parents() -> None:
    from agents.policies.llm.ideation import SHOWN_NODES, shown_nodes
    from agents.policies.llm.policy import LlmPolicy

    nodes = [ev(1, None, {}, 0.5, "merged")] + [
        replace(ev(i, 1 if i < 40 else i - 30, {}, 0.5 + (0.3 if i == 7 else 0.0001 * (i % 17))), number=i)
        for i in range(2, 1201)
    ]
    ctx = replace(ctx_of(nodes), trunk_node_id=500)
    shown = shown_nodes(ctx)
    ids = {n.id for n in shown}
    assert len(shown) <= SHOWN_NODES and {1, 500, 7, 1200} <= ids
    assert 1170 in ids or len(shown) == SHOWN_NODES  # the recent node's parent, where there was room
    model = ScriptedIdeator([])
    LlmPolicy(model).ideate(ctx)  # type: ignore[arg-type]
    seen = json.loads(model.seen[0])
    assert len(seen["nodes"]) == len(shown) and seen["nodes_shown"].startswith(f"{len(shown)} of 1200")


def test_a_proposal_that_repeats_a_nodes_mechanism_in_other_words_is_dropped() -> None:
    from agents.policies.llm.policy import LlmPolicy

    nodes = [
        ev(1, None, {}, 0.5, "merged"),
        replace(ev(2, 1, {}, 0.6), title="Centre the knob", mechanism="set knob.x to 3"),
    ]
    model = ScriptedIdeator([
        {"parent_id": 1, "title": "Set the knob to its centre", "mechanism": "set knob.x to 3"},
        {"parent_id": 1, "title": "Widen the knob's range", "mechanism": "allow knob.x up to 8"},
    ])  # fmt: skip
    props = LlmPolicy(model).ideate(ctx_of(nodes))  # type: ignore[arg-type]
    assert [p.title for p in props if not p.dropped] == ["Widen the knob's range"]
    assert [p.dropped for p in props if p.dropped] == [
        "a duplicate of n2 (Centre the knob): the same mechanism and parameters"
    ]
    assert json.loads(model.seen[0])["nodes"][1]["mechanism"] == "set knob.x to 3"


def test_a_revisit_hangs_under_trunk_however_deep_trunk_s_line_has_grown() -> None:
    # Trunk (n3) sits at depth 2 = max_depth, but a merged node is 0 steps below the last merged
    # change: max_depth bounds unmerged steps, so trunk takes the revisit of n2.
    root = ev(1, None, BASE, 0.5, "merged")
    old = ev(2, 1, {**BASE, "c.toml:m.hidden": 16}, 0.9)
    trunk = replace(ev(3, 1, {**BASE, "c.toml:m.hidden": 32}, 0.8, "merged"), depth=2)
    base = replace(
        ctx([root, old, trunk], k=1), trunk_node_id=3, revisit=[2], max_depth=2, reach={1: 0, 2: 1, 3: 0}
    )
    served = SearchPolicy().ideate(base)
    assert (served[0].origin, served[0].origin_ref, served[0].parent_id) == ("revisit", 2, 3)
    # A node max_depth unmerged steps down takes no child: the sampler fills the slot elsewhere.
    out = SearchPolicy().ideate(replace(base, reach={1: 0, 2: 1, 3: 2}))
    assert len(out) == 1 and out[0].origin != "revisit" and out[0].parent_id != 3


def test_a_coordinator_process_keeps_blas_and_torch_to_one_thread() -> None:
    probe = (
        "import json, numpy, scipy.linalg, torch\n"
        "from threadpoolctl import threadpool_info\n"
        "from agents.policies import optuna_bridge\n"
        "before = [p['num_threads'] for p in threadpool_info() if p['user_api'] == 'blas']\n"
        "optuna_bridge.one_thread()\n"
        "after = [p['num_threads'] for p in threadpool_info() if p['user_api'] == 'blas']\n"
        "print(json.dumps([before, after, torch.get_num_threads()]))\n"
    )
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"}  # as on a two-core machine
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    before, after, torch_threads = json.loads(out.stdout)
    assert before and max(before) == 2  # OpenBLAS would use a second thread
    assert after == [1] * len(before) and torch_threads == 1


# -- ordered lists and repairs at the boundary -----------------------------------------------------

WIDTHS = {
    "c.toml:m.width": {
        "values": [256, 16, 64, 32, 128],
        "low": None,
        "high": None,
        "log": False,
        "integer": None,
    },
    "c.toml:m.act": {"values": ["relu", "tanh"], "low": None, "high": None, "log": False, "integer": None},
    "c.toml:t.lr": {"values": None, "low": 1e-4, "high": 1e-1, "log": True, "integer": None},
}
WIDTHS_BASE = {"c.toml:m.width": 16, "c.toml:m.act": "relu", "c.toml:t.lr": 0.001}
PARAMS = {"name": "size", "metric": "n_params", "max": 7000.0, "min": None, "judge": "metric"}


def test_a_list_of_numbers_is_ordered_for_the_sampler_and_strings_stay_categories() -> None:
    space = Space(WIDTHS, WIDTHS_BASE)
    dists = optuna_bridge.distributions(space)
    width = dists["c.toml:m.width"]
    assert isinstance(width, IntDistribution) and (width.low, width.high) == (0, 4)
    assert isinstance(dists["c.toml:m.act"], CategoricalDistribution)
    assert space.values("c.toml:m.width") == [16, 32, 64, 128, 256]
    # Neighbouring sizes are near, far sizes far (a category would put every other value at 1).
    near = space.distance(WIDTHS_BASE, {**WIDTHS_BASE, "c.toml:m.width": 32})
    far = space.distance(WIDTHS_BASE, {**WIDTHS_BASE, "c.toml:m.width": 256})
    assert near == pytest.approx(0.25) and far == pytest.approx(1.0)
    # A replayed trial holds the value's place; the sampler's suggestions come back as values.
    nodes = [ev(1, None, WIDTHS_BASE, 0.5, "merged"), ev(2, 1, {"c.toml:m.width": 128}, 0.7)]
    study = optuna_bridge.replay(
        space, nodes, [], maximize=True, sampler=optuna_bridge.make_sampler("tpe", 0)
    )
    assert [t.params["c.toml:m.width"] for t in study.get_trials(deepcopy=False)] == [0, 3]
    got = optuna_bridge.ask(study, space, 6, {space.key_of(n.edits) for n in nodes}, seed=1)
    assert got and all(a["c.toml:m.width"] in (16, 32, 64, 128, 256) for a in got)


def widths_ctx(refine: list[RefineRequest]) -> IdeationInput:
    """Accuracy grows with width; n_params = 100 * width must stay <= 7000 (width <= 64)."""
    nodes = [ev(1, None, WIDTHS_BASE, 0.5, "merged")]
    for i, (w, act, lr) in enumerate([(32, "tanh", 0.01), (128, "relu", 0.003), (16, "tanh", 0.05)], start=2):
        n = ev(i, 1, {"c.toml:m.width": w, "c.toml:m.act": act, "c.toml:t.lr": lr}, 0.5 + w / 1000)
        nodes.append(replace(n, dev_metrics={"n_params": 100.0 * w}))
    big = replace(
        ev(5, 3, {"c.toml:m.width": 256, "c.toml:m.act": "tanh", "c.toml:t.lr": 0.02}, 0.5 + 256 / 1000),
        depth=2, dev_metrics={"n_params": 25600.0}, status="rejected",
        constraints=[{"name": "size", "verdict": "violated"}],
    )  # fmt: skip
    return IdeationInput(
        goal="g", metric="acc", maximize=True, search_space=WIDTHS, base_values=WIDTHS_BASE, trunk_node_id=1,
        trunk_dev_mean=0.5, nodes=[*nodes, big], improvement_state={}, pruned_lessons=[], validated_findings=[],
        refine=refine, plateau_level=0, k=3, round_no=2, seed=1, constraints=[PARAMS],
    )  # fmt: skip


def test_a_repair_of_an_over_size_node_lands_at_the_largest_admissible_size_and_keeps_the_rest() -> None:
    props = SearchPolicy().ideate(widths_ctx([RefineRequest(5, ("size",), "fix size")]))
    first = props[0]
    assert first.origin == "refine" and first.parent_id == 5
    # 64 is the widest that fits (6,400 of 7,000 parameters); the knobs size does not depend on
    # (the activation, the learning rate) stay as the parent had them.
    assert first.edits["c.toml:m.width"] == 64
    assert first.edits["c.toml:m.act"] == "tanh" and first.edits["c.toml:t.lr"] == 0.02


# -- the finishing phase ------------------------------------------------------------------------------


def finishing_ctx(budget_left: int) -> IdeationInput:
    """Accuracy peaks at lr = 0.01 (any width): the best node so far has lr = 0.005, width 32."""
    space = Space(SPACE, BASE)

    def acc(lr: float) -> float:
        return 0.9 - 2.0 * (space.coord("c.toml:t.lr", lr) - space.coord("c.toml:t.lr", 0.01)) ** 2

    tried = [(8, 0.001), (16, 0.0002), (64, 0.05), (32, 0.002), (32, 0.005), (16, 0.003), (64, 0.0008)]
    nodes = [ev(1, None, BASE, acc(0.001), "merged")]
    for i, (w, lr) in enumerate(tried, start=2):
        nodes.append(ev(i, 1, {"c.toml:m.hidden": w, "c.toml:t.lr": lr}, acc(lr) + 0.001 * (w == 32)))
    return replace(ctx(nodes, round_no=9, k=3), budget=20, budget_left=budget_left, finish=0.25)


def test_the_last_share_of_the_budget_searches_locally_around_the_best_node() -> None:
    space = Space(SPACE, BASE)
    early = SearchPolicy("tpe").ideate(finishing_ctx(budget_left=12))
    assert not any("finishing" in p.hypothesis["mechanism"] for p in early), "not yet: the sampler explores"
    late = finishing_ctx(budget_left=4)  # 4 of 20 left: within the last 25%
    assert late.finishing()
    props = SearchPolicy("tpe").ideate(late)
    assert len(props) == 3 and all(
        "finishing: local search around n6" in p.hypothesis["mechanism"] for p in props
    )
    best = {**BASE, "c.toml:m.hidden": 32, "c.toml:t.lr": 0.005}
    tried = {space.key_of(space.full({**BASE, **n.edits})) for n in late.nodes}
    for p in props:
        assert p.parent_id == 6 and space.key_of(p.edits) not in tried
        # Inside the trust region: at most 2 x its radius (0.05 + 0.15 * 4/5 = 0.17) from the best node.
        assert space.distance(p.edits, best) <= 2 * 0.17 + 1e-9, p.edits
    # The first move follows the local model of the objective: up toward lr = 0.01, width kept.
    first = props[0].edits
    assert 0.005 < first["c.toml:t.lr"] <= 0.02 and first["c.toml:m.hidden"] == 32


def test_a_space_of_mostly_unordered_choices_keeps_its_sampler_to_the_end() -> None:
    choices = {
        f"c.toml:m.{k}": {"values": vs, "low": None, "high": None, "log": False, "integer": None}
        for k, vs in (
            ("act", ["relu", "tanh", "gelu"]),
            ("norm", ["none", "layer"]),
            ("opt", ["sgd", "adam"]),
        )
    }
    space = {**choices, "c.toml:t.lr": SPACE["c.toml:t.lr"]}
    base = {"c.toml:m.act": "relu", "c.toml:m.norm": "none", "c.toml:m.opt": "sgd", "c.toml:t.lr": 0.001}
    nodes = [ev(1, None, base, 0.5, "merged")]
    for i, (act, norm, opt) in enumerate([("tanh", "layer", "adam"), ("gelu", "none", "adam")], start=2):
        nodes.append(
            ev(i, 1, {"c.toml:m.act": act, "c.toml:m.norm": norm, "c.toml:m.opt": opt}, 0.5 + i / 100)
        )
    late = replace(
        ctx(nodes, round_no=9, k=2),
        search_space=space,
        base_values=base,
        budget=20,
        budget_left=3,
        finish=0.25,
    )
    assert late.finishing()
    props = SearchPolicy("tpe").ideate(late)
    assert len(props) == 2 and not any("finishing" in p.hypothesis["mechanism"] for p in props)


def test_the_finishing_phase_never_proposes_a_move_predicted_to_break_a_constraint() -> None:
    wide = widths_ctx([])
    # The best feasible node (width 32, 3,200 parameters) is the centre; width 128 broke the size bound.
    late = replace(wide, budget=20, budget_left=3, finish=0.25, k=4)
    props = SearchPolicy("tpe").ideate(late)
    assert props and all("finishing" in p.hypothesis["mechanism"] for p in props)
    assert all(p.edits["c.toml:m.width"] <= 64 for p in props), [p.edits for p in props]


# -- conditional dimensions ---------------------------------------------------------------------------

OPT = {
    "c.toml:t.opt": {"values": ["sgd", "adam"], "low": None, "high": None, "log": False, "integer": None},
    "c.toml:t.sgd_lr": {"low": 1e-4, "high": 1.0, "log": True, "values": None, "integer": None,
                        "when": {"c.toml:t.opt": "sgd"}},
    "c.toml:t.adam_lr": {"low": 1e-5, "high": 1e-1, "log": True, "values": None, "integer": None,
                         "when": {"c.toml:t.opt": ["adam"]}},
}  # fmt: skip
OPT_BASE = {"c.toml:t.opt": "sgd", "c.toml:t.sgd_lr": 0.1, "c.toml:t.adam_lr": 0.001}


def test_a_conditional_key_is_inactive_unless_its_parent_takes_the_named_value() -> None:
    space = Space(OPT, OPT_BASE)
    sgd = {"c.toml:t.opt": "sgd", "c.toml:t.sgd_lr": 0.3, "c.toml:t.adam_lr": 0.05}
    assert space.active(sgd, "c.toml:t.sgd_lr") and not space.active(sgd, "c.toml:t.adam_lr")
    # Where it is inactive the key keeps the repository's value: those two are one configuration.
    assert space.full(sgd)["c.toml:t.adam_lr"] == 0.001
    assert space.key_of(sgd) == space.key_of({**sgd, "c.toml:t.adam_lr": 0.02})
    assert space.differing(sgd, {**sgd, "c.toml:t.adam_lr": 0.02}) == []
    # The trial Optuna sees holds the active keys only, as define-by-run records them.
    nodes = [
        ev(1, None, OPT_BASE, 0.5, "merged"),
        ev(2, 1, {"c.toml:t.opt": "adam", "c.toml:t.adam_lr": 0.01}, 0.7),
    ]
    study = optuna_bridge.replay(
        space, nodes, [], maximize=True, sampler=optuna_bridge.make_sampler("tpe", 0, True)
    )
    assert [set(t.params) for t in study.get_trials(deepcopy=False)] == [
        {"c.toml:t.opt", "c.toml:t.sgd_lr"}, {"c.toml:t.opt", "c.toml:t.adam_lr"}
    ]  # fmt: skip


@pytest.mark.parametrize("sampler", ["tpe", "gp", "random"])
def test_suggestions_set_only_the_chosen_branch_and_leave_the_other_as_it_is(sampler: str) -> None:
    nodes = [ev(1, None, OPT_BASE, 0.5, "merged")]
    for i, (opt, lr) in enumerate([("sgd", 0.01), ("adam", 0.003), ("sgd", 0.5), ("adam", 0.0001)], start=2):
        nodes.append(ev(i, 1, {"c.toml:t.opt": opt, f"c.toml:t.{opt}_lr": lr}, 0.5 + lr))
    base = ctx(nodes, round_no=3, k=6)
    props = SearchPolicy(sampler).ideate(replace(base, search_space=OPT, base_values=OPT_BASE))  # type: ignore[arg-type]
    assert len(props) == 6
    for p in props:
        other = "adam" if p.edits["c.toml:t.opt"] == "sgd" else "sgd"
        assert p.edits[f"c.toml:t.{other}_lr"] == OPT_BASE[f"c.toml:t.{other}_lr"], p.edits
        assert f"t.{other}_lr" not in p.title, "an inactive knob is not edited"


def test_a_condition_must_name_a_list_key_and_one_of_its_values() -> None:
    from agents.spec import SpecError, parse_spec

    spec = (PROJECT_ROOT / "examples" / "digits" / "grove.toml").read_text()
    head = spec[: spec.index("[search]")]
    for when, says in [
        ('{ "c.toml:t.nope" = "sgd" }', "which is not a [search] key"),
        ('{ "c.toml:t.sgd_lr" = 0.1 }', "which must be a list of values"),
        ('{ "c.toml:t.opt" = "rmsprop" }', "'rmsprop' is not one of"),
    ]:
        text = (
            head + '[search]\n"c.toml:t.opt" = { values = ["sgd", "adam"] }\n'
            '"c.toml:t.sgd_lr" = { low = 0.0001, high = 1.0 }\n'
            f'"c.toml:t.adam_lr" = {{ low = 0.0001, high = 1.0, when = {when} }}\n'
        )
        with pytest.raises(SpecError) as err:
            parse_spec(text)
        (issue,) = err.value.issues
        assert issue.key == 'search."c.toml:t.adam_lr"' and says in issue.message, issue
