"""Research benchmark: Grove against Optuna's samplers and random search at equal experiment budget.

For each study in `studies.py` and each seed, Grove runs through the real CLI
(`grove run --auto-approve`, real worktrees, sandboxed evaluations, the sealed gate), and the
baselines run the same evaluator in-process, each spending the same number of dev experiments
(a configuration evaluated on the same `repeats` seeds):

- `tpe`: Optuna's TPE with its defaults, blind to the constraints;
- `tpe+c`: the same TPE given `constraints_func` (the study's constraints, `<= 0` feasible);
- `gp`: Optuna's GP sampler with its defaults, blind to the constraints;
- `gp+c`: the same GP given `constraints_func`;
- `random`: random search.

`tpe+c` and `gp+c` run only on studies with constraints: elsewhere they are `tpe` and `gp`.
A study with conditional keys (`Study.conditions`) is searched define-by-run by the baselines: a
key is suggested only where its parent took the value it depends on. Grove gets the flat space.

Each baseline chooses its final configuration by dev mean among the configurations that meet
the constraints on dev (the unchanged repository if none does or none beats it on dev). With
`--heldout-select` each baseline is also reported after the held-out check Grove's gate makes
(rows `<method> +check`): its dev choice is kept only if it passes `agents.tree.gate.heldout_decision`
against the unchanged repository on test seeds 0, 1, 2, ... with the same sequential looks
(`agents.tree.sequential.Plan`, up to 3 x `gate.test_repeats` seeds), otherwise the unchanged
repository is kept. Grove's gate additionally needs a significant dev gain first and may make
several such checks as its trunk moves; a baseline makes one.

Every method is scored by the same code (`Evaluator.score`), on fresh test seeds that no method
has seen (not even a gate, which used seeds 0..8): the held-out mean of its final configuration
over `SCORE_SEEDS`, its held-out gain over the unchanged repository on the same seeds, and
whether the final configuration meets the constraints on every one of those held-out runs.

    python benchmarks/research/run.py [--seeds 5] [--null-seeds 5] [--experiments 24] [--jobs 2]
                                      [--heldout-select] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import types
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import optuna  # noqa: E402
from optuna.distributions import (  # noqa: E402
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from sqlmodel import select  # noqa: E402
from studies import STUDIES  # noqa: E402
from studies import Study as BenchStudy  # noqa: E402

from agents import configfiles  # noqa: E402
from agents.policies import optuna_bridge  # noqa: E402
from agents.policies.space import Space  # noqa: E402
from agents.spec import parse_spec  # noqa: E402
from agents.tree.gate import heldout_decision  # noqa: E402
from agents.tree.sequential import Plan, Step  # noqa: E402
from backend.core import db  # noqa: E402
from backend.core.config import Settings  # noqa: E402
from backend.core.models import Job, Node, Study  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
# Optuna 5 deprecates `constraints_func` for `Trial.set_constraint`; both store the same trial attribute
# that the samplers read, but a constraint set on the trial would reach the constraint-blind baselines too.
warnings.filterwarnings("ignore", message=".*constraints_func.*", category=FutureWarning)
REPEATS = 3
DB_LOCK = threading.Lock()
SCORE_SEEDS = range(1000, 1010)
Assignment = dict[str, Any]
ConstraintsFunc = Callable[[optuna.trial.FrozenTrial], Sequence[float]]


def constraints_of(trial: optuna.trial.FrozenTrial) -> Sequence[float]:
    """Return the violations a baseline stored on its trial before telling it (`<= 0` feasible)."""
    return list(trial.user_attrs["constraints"])


BASELINES: dict[str, Callable[[int], optuna.samplers.BaseSampler]] = {
    "tpe": lambda seed: optuna.samplers.TPESampler(seed=seed),
    "tpe+c": lambda seed: optuna.samplers.TPESampler(seed=seed, constraints_func=constraints_of),
    "gp": lambda seed: optuna.samplers.GPSampler(seed=seed, warn_independent_sampling=False),
    "gp+c": lambda seed: optuna.samplers.GPSampler(
        seed=seed, constraints_func=constraints_of, warn_independent_sampling=False
    ),
    "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
}
CONSTRAINED_ONLY = {"tpe+c", "gp+c"}  # identical to tpe / gp where a study has no constraints
# `--quick`: a constraint, a conditional space, deterministic and noisy evaluators, nothing to find
QUICK = ["constrained", "conditional", "mixed", "null"]


class Evaluator:
    """The study's objective in-process: the same numbers its eval scripts print."""

    def __init__(self, study: BenchStudy, repo: Path) -> None:
        bench = types.ModuleType("bench")
        exec((repo / "bench.py").read_text(), bench.__dict__)
        sys.modules["bench"] = bench
        ns: dict[str, Any] = {}
        exec((repo / "objective.py").read_text(), ns)
        self.measure = ns["measure"]
        self.study = study
        self.spec = parse_spec((repo / "grove.toml").read_text())
        self.config_text = (repo / "config.toml").read_text()
        dims = {k: d.model_dump() for k, d in self.spec.search.items()}
        base = {k: configfiles.get_key("config.toml", self.config_text, k.split(":", 1)[1]) for k in dims}
        self.space = Space(dims, base)
        self.conditions = {
            f"config.toml:{k}": (f"config.toml:{parent}", v) for k, (parent, v) in study.conditions.items()
        }

    def config(self, a: Assignment) -> dict[str, Any]:
        text = configfiles.set_keys(
            "config.toml", self.config_text, {k.split(":", 1)[1]: v for k, v in a.items()}
        )
        return tomllib.loads(text)

    def runs(self, a: Assignment, split: str, seeds: range) -> list[dict[str, float]]:
        cfg = self.config(a)
        return [self.measure(cfg, split, seed) for seed in seeds]

    def objective(self, runs: list[dict[str, float]]) -> list[float]:
        return [r[self.study.metric] for r in runs]

    def violations(self, runs: list[dict[str, float]]) -> list[float]:
        """Return each constraint's worst violation over the runs, scaled by its bound (`<= 0` feasible)."""
        out = []
        for c in self.spec.constraints:
            worst = -math.inf
            for r in runs:
                v = r.get(c.metric)
                if v is None or math.isnan(v):
                    worst = max(worst, 1.0)
                    continue
                if c.max is not None:
                    worst = max(worst, (v - c.max) / (abs(c.max) or 1.0))
                if c.min is not None:
                    worst = max(worst, (c.min - v) / (abs(c.min) or 1.0))
            out.append(worst)
        return out

    def feasible(self, runs: list[dict[str, float]]) -> bool:
        return all(v <= 0 for v in self.violations(runs))

    def score(self, a: Assignment) -> tuple[float, bool]:
        """Return a final configuration's held-out mean over `SCORE_SEEDS` and whether every run met the constraints."""
        runs = self.runs(a, "test", SCORE_SEEDS)
        return statistics.fmean(self.objective(runs)), self.feasible(runs)

    def result(self, final: Assignment, **extra: Any) -> dict[str, Any]:
        """Return how a method's final configuration scores, beside the unchanged repository's score."""
        held_out, ok = self.score(final)
        base = self.space.full({})
        return {
            "held_out": held_out,
            "base": self.score(base)[0],
            "feasible": ok,
            "changed": self.space.key_of(final) != self.space.key_of(base),
            "config": final,
            **extra,
        }

    def heldout_check(self, candidate: Assignment) -> bool:
        """Return whether `candidate` passes Grove's held-out gate against the unchanged repository."""
        gate, sign = self.spec.gate, 1.0 if self.study.maximize else -1.0
        base = self.space.full({})
        plan = Plan(gate.test_repeats, 3 * gate.test_repeats)
        values = self.objective(self.runs(candidate, "test", range(gate.test_repeats)))
        trunk = self.objective(self.runs(base, "test", range(gate.test_repeats)))
        while True:  # Grove's `_look_again`: an unclear gain gets more paired seeds, both sides
            n = len(values)
            diffs = [sign * (v - t) - gate.margin for v, t in zip(values, trunk, strict=True)]
            if plan.step(diffs) != Step.MORE:
                break
            more = range(n, plan.next_n(n))
            values += self.objective(self.runs(candidate, "test", more))
            trunk += self.objective(self.runs(base, "test", more))
        d = heldout_decision(
            values, trunk, maximize=self.study.maximize, margin=gate.margin, alpha=plan.alpha_at(len(values))
        )
        return d.passed


def suggest(trial: optuna.Trial, ev: Evaluator) -> Assignment:
    """Suggest a configuration define-by-run: a conditional key only where its parent took its value."""
    dists = optuna_bridge.distributions(ev.space)
    a: Assignment = {}
    for k in sorted(dists, key=lambda k: k in ev.conditions):  # parents before the keys they govern
        if k in ev.conditions and a.get(ev.conditions[k][0]) != ev.conditions[k][1]:
            continue
        a[k] = decode(ev.space, k, suggest_one(trial, k, dists[k]))
    return ev.space.full(a)


def suggest_one(trial: optuna.Trial, name: str, d: BaseDistribution) -> Any:
    if isinstance(d, FloatDistribution):
        return trial.suggest_float(name, d.low, d.high, log=d.log)
    if isinstance(d, IntDistribution):
        return trial.suggest_int(name, d.low, d.high, log=d.log)
    assert isinstance(d, CategoricalDistribution)
    return trial.suggest_categorical(name, d.choices)


def decode(space: Space, k: str, v: Any) -> Any:
    """Return the value a suggestion stands for (a list of numbers is suggested by place), rounded as written."""
    if space.is_ordered(k):
        return space.ordered(k)[int(v)]
    return space.clean(k, v)


def baseline(ev: Evaluator, method: str, seed: int, experiments: int, check: bool) -> dict[str, Any]:
    """Run one baseline on dev and score its choice (and, with `check`, its choice after the held-out check)."""
    started = time.monotonic()
    metric, sign = ev.study.metric, 1.0 if ev.study.maximize else -1.0
    study = optuna.create_study(
        direction="maximize" if ev.study.maximize else "minimize", sampler=BASELINES[method](seed)
    )
    base = ev.space.full({})
    best = (sign * statistics.fmean(r[metric] for r in ev.runs(base, "dev", range(REPEATS))), base)
    for _ in range(experiments):
        trial = study.ask()
        a = suggest(trial, ev)
        runs = ev.runs(a, "dev", range(REPEATS))
        dev = statistics.fmean(ev.objective(runs))
        trial.set_user_attr("constraints", ev.violations(runs))
        study.tell(trial, dev)
        if ev.feasible(runs) and sign * dev > best[0]:
            best = (sign * dev, a)
    out = {"dev": ev.result(best[1], seconds=time.monotonic() - started)}
    if check:
        out["check"] = ev.result(best[1] if best[1] is not base and ev.heldout_check(best[1]) else base)
    return out


def grove(ev: Evaluator, repo: Path, data: Path) -> dict[str, Any]:
    """Run Grove on the study through its CLI; score its final trunk and the baseline."""
    env = {**os.environ, "GROVE_DATA_DIR": str(data), "GROVE_WORKTREES_DIR": str(data / "wt")}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "backend.cli.main", "run", str(repo), "--auto-approve", "--fresh", "--quiet"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"grove run failed on {repo.name}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    settings = Settings(data_dir=data, worktrees_dir=data / "wt")
    with DB_LOCK, db.session(settings.db_url) as s:  # opening a database migrates it: not thread-safe
        st = s.exec(select(Study)).one()
        merged = select(Node.id).where(
            Node.study_id == st.id,
            Node.status == "merged",
            Node.parent_id != None,  # noqa: E711
        )
        merges = len(list(s.exec(merged)))
        jobs = len(list(s.exec(select(Job.id).where(Job.study_id == st.id))))
        trunk = s.get(Node, st.trunk_node_id)
        assert trunk is not None
        final = ev.space.full({**ev.space.base, **trunk.edits})
    return ev.result(final, merges=merges, jobs=jobs, seconds=time.monotonic() - started)


def gain(study: BenchStudy, r: dict[str, Any]) -> float:
    return float((r["held_out"] - r["base"]) * (1.0 if study.maximize else -1.0))


def mean_sd(xs: list[float], fmt: str = "+.4f") -> str:
    if not xs:
        return "—"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs) + 0.0:{fmt}} ± {sd:.4f}"  # + 0.0: no "-0.0000"


def methods_for(study: BenchStudy, baselines: list[str]) -> list[str]:
    return [m for m in baselines if study.constraints or m not in CONSTRAINED_ONLY]


def report(results: dict[str, dict[str, list[dict[str, Any]]]], rows: list[str]) -> None:
    """Print one table per study, then the held-out gains of every study side by side."""
    for name, by in results.items():
        study = STUDIES[name]
        n = len(by["grove"])
        print(f"## {name} — {study.about} ({'maximize' if study.maximize else 'minimize'} {study.metric})")
        feas = " held-out feasible |" if study.constraints else ""
        print(f"| method | final held-out mean ± sd | held-out gain mean ± sd | changed the repo |{feas}")
        print("|---|---|---|---|" + ("---|" if study.constraints else ""))
        for method in [m for m in rows if m in by]:
            rs = by[method]
            line = (
                f"| {method} | {mean_sd([r['held_out'] for r in rs], '.4f')} "
                f"| {mean_sd([gain(study, r) for r in rs])} "
                f"| {sum(1 for r in rs if r['changed'])} of {len(rs)} |"
            )
            if study.constraints:
                line += f" {sum(1 for r in rs if r['feasible'])} of {len(rs)} |"
            print(line)
        if study.null:
            merged = sum(1 for r in by["grove"] if r["merges"])
            print(f"\nnull study: Grove merged anything on {merged} of {n} seeds")
        print()
    cols = [m for m in rows if any(m in by for by in results.values())]
    for title, part in (
        ("as chosen on dev", [m for m in cols if not m.endswith("+check")]),
        ("baselines after the held-out check", ["grove", *(m for m in cols if m.endswith("+check"))]),
    ):
        if len(part) < 2:
            continue
        print(f"## held-out gain over the unchanged repository, mean ± sd over seeds: {title}")
        print("| study | " + " | ".join(part) + " |")
        print("|---|" + "---|" * len(part))
        for name, by in results.items():
            cells = [mean_sd([gain(STUDIES[name], r) for r in by[m]]) if m in by else "=" for m in part]
            print(f"| {name} | " + " | ".join(cells) + " |")
        print()
    print("= : the study has no constraints, so the method is the same as the one without +c")
    print()
    print("## Grove minus the best baseline (by mean held-out gain, as chosen on dev), paired by seed")
    print("| study | best baseline | difference mean ± sd | ahead by more than one sd |")
    print("|---|---|---|---|")
    for name, by in results.items():
        best, diffs = paired(STUDIES[name], by)
        if best:
            ahead = len(diffs) > 1 and statistics.fmean(diffs) > statistics.stdev(diffs)
            print(f"| {name} | {best} | {mean_sd(diffs)} | {'yes' if ahead else 'no'} |")


def paired(study: BenchStudy, by: dict[str, list[dict[str, Any]]]) -> tuple[str, list[float]]:
    """Return the baseline with the best mean held-out gain and Grove's gain minus its gain, seed by seed."""
    means = {
        m: statistics.fmean(gain(study, r) for r in rs)
        for m, rs in by.items()
        if m != "grove" and not m.endswith("+check") and rs
    }
    if not means or not by.get("grove"):
        return "", []
    best = max(means, key=lambda m: (means[m], m))
    theirs = {r.get("seed", i): gain(study, r) for i, r in enumerate(by[best])}
    ours = {r.get("seed", i): gain(study, r) for i, r in enumerate(by["grove"])}
    return best, [ours[s] - theirs[s] for s in sorted(ours) if s in theirs]


def main() -> None:
    """Run the suite and print one table per study."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--studies", nargs="+", choices=list(STUDIES))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--null-seeds", type=int, default=5)
    ap.add_argument("--experiments", type=int, default=24)
    # One experiment at a time, like the baselines: at equal budget every method sees the same number
    # of results before each choice.
    ap.add_argument("--parallel", type=int, default=1, help="experiments at once inside one Grove study")
    ap.add_argument("--jobs", type=int, default=2, help="Grove studies at once")
    ap.add_argument("--max-repeats", type=int, help="Grove's evaluate.max_repeats (default: 3 x repeats)")
    ap.add_argument(
        "--sampler", default="auto", choices=["auto", "gp", "tpe", "random"], help="Grove's policy.sampler"
    )
    ap.add_argument("--finish", type=float, help="Grove's policy.finish (default: the spec's default)")
    ap.add_argument(
        "--no-widen", action="store_true", help="Grove keeps every range as declared (policy.widen = false)"
    )
    ap.add_argument("--baselines", nargs="+", choices=list(BASELINES), default=list(BASELINES))
    ap.add_argument(
        "--heldout-select",
        action="store_true",
        help="also report each baseline after Grove's held-out check of its dev choice (rows '+check')",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: one seed, 12 experiments, studies {' '.join(QUICK)} unless --studies names others",
    )
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.null_seeds, args.experiments = 1, 1, 12
    args.studies = args.studies or (QUICK if args.quick else list(STUDIES))
    optuna_bridge.one_thread()  # the GP baselines share the cores with Grove's runs
    started = time.monotonic()
    rows = ["grove"]
    for m in args.baselines:
        rows += [m, f"{m} +check"] if args.heldout_select else [m]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="grove-research-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        runs: list[tuple[str, int, Evaluator, Future[dict[str, Any]]]] = []
        for name in args.studies:
            study = STUDIES[name]
            results[name] = {"grove": []}
            for seed in range(args.null_seeds if study.null else args.seeds):
                repo = study.make_repo(
                    Path(tmp) / f"{name}-{seed}",
                    seed,
                    args.experiments,
                    args.parallel,
                    args.max_repeats,
                    args.sampler,
                    args.finish,
                    not args.no_widen,
                )
                ev = Evaluator(study, repo)
                fut = pool.submit(grove, ev, repo, Path(tmp) / f"data-{name}-{seed}")
                runs.append((name, seed, ev, fut))
        # The baselines run here while Grove's studies run in the pool.
        for name, seed, ev, _ in runs:
            for method in methods_for(ev.study, args.baselines):
                r = baseline(ev, method, seed, args.experiments, args.heldout_select)
                for kept in r.values():
                    kept["seed"] = seed
                results[name].setdefault(method, []).append(r["dev"])
                if "check" in r:
                    results[name].setdefault(f"{method} +check", []).append(r["check"])
            print(f"{name} seed {seed}: baselines done ({time.monotonic() - started:.0f} s)", flush=True)
        for name, seed, ev, fut in runs:
            try:
                r = fut.result()
            except Exception as exc:  # one broken run is reported, the suite goes on
                print(f"{name} seed {seed}: grove run failed: {exc}", flush=True)
                continue
            results[name]["grove"].append({**r, "seed": seed})
            print(
                f"{name} seed {seed}: grove held-out gain {gain(ev.study, r):+.4f} "
                f"(merges {r['merges']}, jobs {r['jobs']}, {r['seconds']:.0f} s)",
                flush=True,
            )
    print()
    report(results, rows)
    print(f"\nsuite wall time: {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
