"""The tree as an Optuna study: replay every measured node as a trial, then ask for a batch.

Each round rebuilds an in-memory study from the nodes alone (the database is the only state):
evaluated nodes are complete trials with their dev objective and one constraint value per
metric rule (`<= 0` is feasible, the convention Optuna's samplers read), failed nodes are
failed trials, and nodes still proposed, queued or running are running trials, which the
samplers' constant liar keeps a batch away from. Samplers are seeded by (study seed, round),
so the same history and seed give the same suggestions.
"""

from __future__ import annotations

import heapq
import importlib.util
import json
import math
import operator
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import FrozenTrial, TrialState, create_trial
from threadpoolctl import threadpool_limits

from agents.policies.base import NodeEvidence
from agents.policies.space import Assignment, Space
from agents.spec import Judge
from agents.tree.status import NodeStatus
from agents.verify.constraints import Verdict

SamplerName = Literal["auto", "tpe", "gp", "random"]
PENDING = ("proposed", "queued", "running")
INFEASIBLE = 1.0  # constraint value of a rule whose metric a node did not report
ADMITTED = "grove:admitted"  # a constraint every trial carries: > 0 where the gate turned a node down

optuna.logging.set_verbosity(optuna.logging.WARNING)


class SamplerUnavailable(RuntimeError):
    """The sampler a spec names cannot run in this installation."""


def _encode(space: Space, k: str, v: Any) -> Any:
    """Return a value as Optuna holds it: an ordered list's by its place, a list value (`[64, 64]`) as JSON."""
    if space.is_ordered(k):
        return round(space.index(k, v))
    return json.dumps(v) if isinstance(v, list) else v


def _decode(space: Space, k: str, v: Any) -> Any:
    """Return the value an encoded one stands for."""
    if space.is_ordered(k):
        return space.ordered(k)[int(v)]
    if isinstance(v, str) and not space.is_range(k):
        return next((c for c in space.values(k) if isinstance(c, list) and json.dumps(c) == v), v)
    return v


def _params(space: Space, a: Assignment) -> dict[str, Any]:
    """Return an assignment's trial parameters: its active keys only (define-by-run, as Optuna records them)."""
    return {k: _encode(space, k, v) for k, v in a.items() if k not in space.conditions or space.active(a, k)}


def _of(dists: dict[str, BaseDistribution], params: dict[str, Any]) -> dict[str, BaseDistribution]:
    return {k: dists[k] for k in params}


def distributions(space: Space) -> dict[str, BaseDistribution]:
    """Return one Optuna distribution per `[search]` key: numbers in a list are ordered (by place)."""
    out: dict[str, BaseDistribution] = {}
    for k in space.keys:
        if space.is_ordered(k):
            out[k] = IntDistribution(0, len(space.ordered(k)) - 1)
            continue
        if not space.is_range(k):
            out[k] = CategoricalDistribution([_encode(space, k, c) for c in space.values(k)])
            continue
        lo, hi = space.bounds(k)
        log = bool(space.dims[k].get("log"))
        if space.is_int(k):
            out[k] = IntDistribution(int(lo), int(hi), log=log)
        else:
            out[k] = FloatDistribution(lo, hi, log=log)
    return out


def constraint_values(rules: Sequence[dict[str, Any]], metrics: dict[str, float]) -> dict[str, float]:
    """Return each metric rule's violation (`<= 0` feasible), scaled by the bound it must respect."""
    out: dict[str, float] = {}
    for r in rules:
        if r.get("judge", "metric") != Judge.METRIC:
            continue
        v = metrics.get(r["metric"])
        if v is None or math.isnan(v):
            out[r["name"]] = INFEASIBLE
            continue
        worst = -math.inf
        if r.get("max") is not None:
            worst = max(worst, (v - r["max"]) / (abs(r["max"]) or 1.0))
        if r.get("min") is not None:
            worst = max(worst, (r["min"] - v) / (abs(r["min"]) or 1.0))
        out[r["name"]] = worst
    return out


def judged_metrics(rules: Sequence[dict[str, Any]], node: NodeEvidence) -> dict[str, float]:
    """Return a node's dev metrics with each rule's metric at the worst value its verdict used."""
    out = dict(node.dev_metrics)
    metric_of = {r["name"]: r.get("metric") for r in rules}
    for c in node.constraints:
        if metric_of.get(c.get("name")) and isinstance(c.get("value"), int | float):
            out[str(metric_of[c["name"]])] = float(c["value"])
    return out


def feasible(rules: Sequence[dict[str, Any]], node: NodeEvidence) -> bool:
    """Return whether a measured node meets every metric rule on its dev metrics."""
    if node.constraints:
        return all(c.get("verdict") == Verdict.SATISFIED for c in node.constraints)
    return all(v <= 0 for v in constraint_values(rules, judged_metrics(rules, node)).values())


def gp_available() -> bool:
    """Return whether Optuna's GP sampler can run here (it needs torch and scipy)."""
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "scipy"))


def preload() -> None:
    """Import what the GP sampler needs (torch, scipy), so no study's first GP step waits for it."""
    if not gp_available():
        return
    for module in ("torch", "scipy.stats", "optuna._gp.gp", "optuna._gp.optim_mixed"):
        importlib.import_module(module)


def warm_up() -> None:
    """Ask a GP once on a small synthetic study, so a process's first GP step runs at full speed.

    The first GP asks of a process are several times slower than the rest (torch's thread pool,
    first kernel calls, scipy's quasi-random tables). Call it in the process that will ask: after
    a fork, not before (a thread pool does not survive one).
    """
    if not gp_available():
        return
    dists: dict[str, BaseDistribution] = {"x": FloatDistribution(0.0, 1.0), "y": FloatDistribution(0.0, 1.0)}
    study = optuna.create_study(sampler=make_sampler("gp", 0))
    for i in range(12):
        x, y = (i * 0.37) % 1.0, (i * 0.61) % 1.0
        study.add_trial(create_trial(params={"x": x, "y": y}, distributions=dists, value=(x - 0.3) ** 2 + y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            study.ask(dists)


def one_thread() -> None:
    """Keep torch and BLAS to one thread, in a process that does nothing with them but ask GPs.

    A GP of at most `HISTORY` points gains nothing from more, and threads that contend with the
    workers for the cores make an ask take about twice as long. BLAS's (numpy's and scipy's
    OpenBLAS) also spin a while after each call: measured on two cores, a tenth of a core taken
    from the experiments beside it. Not for a process that also trains (a worker that takes
    learning jobs beside the coordinator's).
    """
    threadpool_limits(limits=1, user_api="blas")
    if gp_available():
        import torch

        torch.set_num_threads(1)


def resolve(name: SamplerName) -> SamplerName:
    """Return the sampler `name` stands for: `auto` is GP where torch and scipy are installed, else TPE."""
    if name == "auto":
        return "gp" if gp_available() else "tpe"
    return name


def make_sampler(name: SamplerName, seed: int, conditional: bool = False) -> optuna.samplers.BaseSampler:
    """Return a seeded sampler: GP, TPE (multivariate, constant liar) or random; `auto` picks GP or TPE.

    For a space with conditional keys (`conditional`), TPE models each group of keys that appear
    together (`group`); the GP models the keys every trial has and draws a conditional key at
    random (a TPE of the few trials where it was active did worse on the research suite's
    conditional study: +0.151 against +0.174 held-out gain, 5 seeds).
    """
    name = resolve(name)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if name == "gp":
            if not gp_available():
                raise SamplerUnavailable(
                    "policy.sampler = 'gp' needs torch and scipy (pip install 'grove[learning]')"
                )
            return optuna.samplers.GPSampler(
                seed=seed, warn_independent_sampling=False,
            )  # fmt: skip
        if name != "tpe":
            raise ValueError(f"unknown sampler {name!r} (use 'auto', 'gp', 'tpe' or 'random')")
        return optuna.samplers.TPESampler(
            seed=seed, multivariate=True, constant_liar=True, n_startup_trials=6, group=conditional,
        )  # fmt: skip


HISTORY = 128  # trials a sampler sees at most


def replay(
    space: Space,
    nodes: Sequence[NodeEvidence],
    rules: Sequence[dict[str, Any]],
    *,
    maximize: bool,
    sampler: optuna.samplers.BaseSampler,
    windowed: bool = False,
) -> optuna.Study:
    """Return an in-memory study holding one trial per node whose assignment lies in the space.

    A long study shows the sampler a window of its history (`HISTORY` trials at most: every running
    one, the best measured half, the most recent of the rest), so asking costs the same at node
    5,000 as at node 150; a GP could not fit thousands of points in a step anyway. Pass
    `windowed=True` when `nodes` is already `window(...)`'s answer.
    """
    study = optuna.create_study(direction="maximize" if maximize else "minimize", sampler=sampler)
    study.add_trials(_trials(space, nodes if windowed else window(nodes, maximize), rules))
    return study


def window(nodes: Sequence[NodeEvidence], maximize: bool) -> Sequence[NodeEvidence]:
    """Return about `HISTORY` nodes: the root, every pending one, the best measured half, the most recent."""
    if len(nodes) <= HISTORY:
        return nodes
    sign = 1.0 if maximize else -1.0
    ordered = sorted(nodes, key=operator.attrgetter("id"))
    keep: dict[int, NodeEvidence] = {}
    scored: list[tuple[float, int, NodeEvidence]] = []
    for n in ordered:  # one pass: a long study's tree is walked at every step
        if n.status in PENDING or n.parent_id is None:
            keep[n.id] = n
        if n.dev_mean is not None and n.status != NodeStatus.FAILED and math.isfinite(n.dev_mean):
            scored.append((-sign * n.dev_mean, n.id, n))
    for _, i, n in heapq.nsmallest(HISTORY // 2, scored):  # ids differ: nodes are never compared
        keep[i] = n
    room = HISTORY - len(keep)
    for n in reversed(ordered):
        if room <= 0:
            break
        if n.id not in keep:
            keep[n.id] = n
            room -= 1
    return sorted(keep.values(), key=operator.attrgetter("id"))


class _Replayed(FrozenTrial):
    """A trial built for one replayed study alone, which a study may keep without copying it.

    A study deep-copies every trial it is given, and replaying a window of 128 trials spent half
    of an ideation step in those copies; nothing else ever holds these trials.
    """

    def __deepcopy__(self, memo: dict[int, Any]) -> _Replayed:
        return self


def _replayed(trial: FrozenTrial) -> FrozenTrial:
    trial.__class__ = _Replayed
    return trial


def _trials(
    space: Space, nodes: Sequence[NodeEvidence], rules: Sequence[dict[str, Any]]
) -> list[optuna.trial.FrozenTrial]:
    """Return one trial per node whose assignment lies in the space, oldest first.

    Trials carry their constraint values only where some trial violates one: a constraint no
    trial has violated teaches a sampler nothing, and the GP sampler fits a model per constraint.
    """
    dists = distributions(space)
    rows: list[tuple[NodeEvidence, dict[str, Any], dict[str, float] | None]] = []
    for n in sorted(nodes, key=lambda n: n.id):
        params = space.full({**space.base, **n.edits})
        if not all(space.contains(k, v) for k, v in params.items()):
            continue
        cons = None
        if n.dev_mean is not None and n.status != NodeStatus.FAILED and math.isfinite(n.dev_mean):
            cons = constraint_values(rules, judged_metrics(rules, n))
            # Rejected although every constraint held: the sealed gate (or a human) turned it down,
            # which the coordinator may know. The region is not admissible.
            turned_down = n.status == NodeStatus.REJECTED and all(v <= 0 for v in cons.values())
            cons[ADMITTED] = 1.0 if turned_down else -1.0
        rows.append((n, _params(space, params), cons))
    binding = any(v > 0 for _, _, cons in rows if cons for v in cons.values())
    out = []
    for n, params, cons in rows:
        used = _of(dists, params)
        if cons is not None:
            trial = create_trial(
                params=params, distributions=used, value=n.dev_mean, constraints=cons if binding else None
            )
        elif n.status in PENDING:
            trial = create_trial(state=TrialState.RUNNING, params=params, distributions=used)
        elif n.status in (NodeStatus.FAILED, NodeStatus.REJECTED) and n.dev_mean is None:
            trial = create_trial(state=TrialState.FAIL, params=params, distributions=used)
        else:
            continue
        out.append(_replayed(trial))
    return out


def pending_trial(space: Space, a: Assignment) -> optuna.trial.FrozenTrial:
    """Return a running trial for an assignment that is proposed but not yet measured."""
    params = _params(space, space.full(a))
    return _replayed(
        create_trial(state=TrialState.RUNNING, params=params, distributions=_of(distributions(space), params))
    )


def ask(
    study: optuna.Study, space: Space, n: int, seen: set[tuple[str, ...]], seed: int = 0
) -> list[Assignment]:
    """Ask for up to `n` new assignments; each stays a running trial so the next one moves away.

    A sampler that keeps suggesting what was already tried (a Gaussian process sure of its optimum
    on a noiseless objective) would end the study with budget left: the rest is drawn at random.
    """
    out: list[Assignment] = []
    _take(study, space, n, seen, out)
    if len(out) < n:
        _take(optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed)), space, n, seen, out)
    return out


def _take(
    study: optuna.Study, space: Space, n: int, seen: set[tuple[str, ...]], out: list[Assignment]
) -> None:
    """Append new assignments from `study` to `out` until it holds `n` (or the tries run out)."""
    dists = distributions(space)
    for _ in range(max(8 * n, 32)):
        if len(out) >= n:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if space.conditions:
                a = _ask_by_run(study, space, dists)
            else:
                trial = study.ask(dists)
                a = {k: space.clean(k, _decode(space, k, trial.params[k])) for k in space.keys}
        key = space.key_of(a)
        if key not in seen:
            seen.add(key)
            out.append(a)


def _ask_by_run(study: optuna.Study, space: Space, dists: dict[str, BaseDistribution]) -> Assignment:
    """Ask define-by-run: the unconditional keys first, then each conditional key that they make active."""
    trial = study.ask()
    a: Assignment = {}
    for k in [*space.roots, *(k for k in space.keys if k in space.conditions)]:
        if k in space.conditions and not space.active(a, k):
            continue
        a[k] = space.clean(k, _decode(space, k, _suggest(trial, k, dists[k])))
    return space.full(a)


def _suggest(trial: optuna.Trial, name: str, dist: BaseDistribution) -> Any:
    """Suggest a parameter from its distribution (the trial records it as define-by-run does)."""
    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, dist.choices)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, log=dist.log)
    assert isinstance(dist, FloatDistribution)
    return trial.suggest_float(name, dist.low, dist.high, log=dist.log)


def _finite_number(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an integer past a float's range
        return False


def importances(
    space: Space, measured: Sequence[tuple[Assignment, float]], maximize: bool = True
) -> dict[str, float]:
    """Return how much each searched key tells the best tenth of the measured nodes apart (PED-ANOVA).

    Optuna's PED-ANOVA compares where the top 10% of the dev scores lie with the whole history,
    key by key; the shares sum to 1. It takes tens of milliseconds at hundreds of nodes (fANOVA's
    forest took seconds).

    Range bounds stretch to the values seen (a widened range's merges count); a node whose value
    lies outside a list's choices is left out. Keys a node leaves inactive are not compared.
    """
    dims = {k: dict(d) for k, d in space.dims.items()}
    for k, d in dims.items():
        if d.get("values") is not None:
            continue
        seen = [float(a[k]) for a, _ in measured if _finite_number(a.get(k))]
        seen = [x for x in seen if x > 0] if d.get("log") else seen  # a log range stays above 0
        if seen:
            d["low"], d["high"] = min([float(d["low"]), *seen]), max([float(d["high"]), *seen])
    try:
        wide = Space(dims, space.base)
        dists = distributions(wide)
    except (ValueError, TypeError):
        return {}
    study = optuna.create_study(direction="maximize" if maximize else "minimize")
    for a, v in measured:
        if not _finite_number(v):
            continue
        params = _params(wide, {k: a.get(k, wide.base.get(k)) for k in wide.keys})
        try:
            study.add_trial(create_trial(params=params, distributions=_of(dists, params), value=v))
        except (
            ValueError,
            TypeError,
            OverflowError,
        ):  # a value outside its dimension (a string on a range, say)
            continue
    trials = study.get_trials(deepcopy=False)
    if len(trials) < 3 or len({t.value for t in trials}) < 2:
        return {}
    try:
        with threadpool_limits(limits=1, user_api="blas"), warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            found = optuna.importance.get_param_importances(
                study, evaluator=optuna.importance.PedAnovaImportanceEvaluator()
            )
    except (RuntimeError, ValueError, TypeError):
        return {}
    return {k: float(v) for k, v in found.items()}
