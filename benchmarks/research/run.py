"""Research benchmark: Grove vs random search vs plain Optuna TPE at equal experiment budget.

For each study in `studies.py` and each seed, Grove runs through the real CLI
(`grove run --auto-approve`, real worktrees, sandboxed evaluations, the sealed gate), and two
baselines run the same evaluator in-process: random search and Optuna's TPE with its
defaults, each spending the same number of dev experiments (a configuration evaluated on the
same `repeats` seeds) and choosing its final configuration by dev mean among the
configurations that meet the constraints on dev (the unchanged repository if none does).
Every method is scored the same way, on fresh test seeds that no method has seen (not even
Grove's gate, which used seeds 0..2): the held-out mean of its final configuration over
`SCORE_SEEDS`, and its held-out gain over the unchanged repository on the same seeds.

    python benchmarks/research/run.py [--seeds 5] [--null-seeds 10] [--experiments 24] [--jobs 2]
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import optuna  # noqa: E402
from sqlmodel import select  # noqa: E402
from studies import STUDIES  # noqa: E402
from studies import Study as BenchStudy  # noqa: E402

from agents.policies import configfiles, optuna_bridge  # noqa: E402
from agents.policies.space import Space  # noqa: E402
from agents.spec import parse_spec  # noqa: E402
from backend.core import db  # noqa: E402
from backend.core.config import Settings  # noqa: E402
from backend.core.models import Job, Node, Study  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)
REPEATS = 3
DB_LOCK = threading.Lock()
SCORE_SEEDS = range(1000, 1010)


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

    def config(self, a: dict[str, Any]) -> dict[str, Any]:
        text = configfiles.set_keys(
            "config.toml", self.config_text, {k.split(":", 1)[1]: v for k, v in a.items()}
        )
        return tomllib.loads(text)

    def runs(self, a: dict[str, Any], split: str, seeds: range) -> list[dict[str, float]]:
        cfg = self.config(a)
        return [self.measure(cfg, split, seed) for seed in seeds]

    def feasible(self, runs: list[dict[str, float]]) -> bool:
        for c in self.spec.constraints:
            for r in runs:
                v = r.get(c.metric)
                if v is None or (c.max is not None and v > c.max) or (c.min is not None and v < c.min):
                    return False
        return True

    def held_out(self, a: dict[str, Any]) -> float:
        return statistics.fmean(r[self.study.metric] for r in self.runs(a, "test", SCORE_SEEDS))


def baseline(ev: Evaluator, sampler: optuna.samplers.BaseSampler, experiments: int) -> dict[str, Any]:
    """Run plain Optuna with `sampler` on dev; return the final choice's held-out score."""
    metric, sign = ev.study.metric, 1.0 if ev.study.maximize else -1.0
    dists = optuna_bridge.distributions(ev.space)
    study = optuna.create_study(direction="maximize" if ev.study.maximize else "minimize", sampler=sampler)
    base = ev.space.full({})
    best = (sign * statistics.fmean(r[metric] for r in ev.runs(base, "dev", range(REPEATS))), base)
    for _ in range(experiments):
        trial = study.ask(dists)
        a = {k: ev.space.clean(k, v) for k, v in trial.params.items()}
        runs = ev.runs(a, "dev", range(REPEATS))
        dev = statistics.fmean(r[metric] for r in runs)
        study.tell(trial, dev)
        if ev.feasible(runs) and sign * dev > best[0]:
            best = (sign * dev, a)
    return {"held_out": ev.held_out(best[1]), "base": ev.held_out(base), "merges": None, "config": best[1]}


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
        return {
            "held_out": ev.held_out(final),
            "base": ev.held_out(ev.space.full({})),
            "config": final,
            "merges": merges,
            "jobs": jobs,
            "seconds": time.monotonic() - started,
        }


def gain(study: BenchStudy, r: dict[str, Any]) -> float:
    return (r["held_out"] - r["base"]) * (1.0 if study.maximize else -1.0)


def main() -> None:
    """Run the suite and print one table per study."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--studies", nargs="+", default=list(STUDIES))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--null-seeds", type=int, default=10)
    ap.add_argument("--experiments", type=int, default=24)
    # One experiment at a time, like the baselines: at equal budget every method sees the same number
    # of results before each choice.
    ap.add_argument("--parallel", type=int, default=1, help="experiments at once inside one Grove study")
    ap.add_argument("--jobs", type=int, default=2, help="Grove studies at once")
    ap.add_argument("--max-repeats", type=int, help="Grove's evaluate.max_repeats (default: 3 x repeats)")
    ap.add_argument(
        "--sampler", default="auto", choices=["auto", "gp", "tpe", "random"], help="Grove's policy.sampler"
    )
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    args = ap.parse_args()
    started = time.monotonic()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="grove-research-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = []
        for name in args.studies:
            study = STUDIES[name]
            results[name] = {"grove": [], "tpe": [], "random": []}
            for seed in range(args.null_seeds if study.null else args.seeds):
                repo = study.make_repo(
                    Path(tmp) / f"{name}-{seed}",
                    seed,
                    args.experiments,
                    args.parallel,
                    args.max_repeats,
                    args.sampler,
                )
                ev = Evaluator(study, repo)
                results[name]["tpe"].append(
                    baseline(ev, optuna.samplers.TPESampler(seed=seed), args.experiments)
                )
                results[name]["random"].append(
                    baseline(ev, optuna.samplers.RandomSampler(seed=seed), args.experiments)
                )
                futures.append((name, seed, pool.submit(grove, ev, repo, Path(tmp) / f"data-{name}-{seed}")))
        for name, seed, fut in futures:
            try:
                r = fut.result()
            except Exception as exc:  # one broken run is reported, the suite goes on
                print(f"{name} seed {seed}: grove run failed: {exc}", flush=True)
                continue
            results[name]["grove"].append(r)
            print(
                f"{name} seed {seed}: grove held-out gain {gain(STUDIES[name], r):+.4f} "
                f"(merges {r['merges']}, jobs {r['jobs']}, {r['seconds']:.0f} s)",
                flush=True,
            )
    print()
    for name, by in results.items():
        study = STUDIES[name]
        print(f"## {name} — {study.about} ({'maximize' if study.maximize else 'minimize'} {study.metric})")
        print("| method | final held-out mean ± sd | held-out gain mean ± sd | merges |")
        print("|---|---|---|---|")
        for method, rs in by.items():
            finals = [r["held_out"] for r in rs]
            gains = [gain(study, r) for r in rs]
            merged = "" if method != "grove" else f"{sum(1 for r in rs if r['merges'])} of {len(rs)} seeds"
            print(
                f"| {method} | {statistics.fmean(finals):.4f} ± {statistics.pstdev(finals):.4f} "
                f"| {statistics.fmean(gains):+.4f} ± {statistics.pstdev(gains):.4f} | {merged} |"
            )
        g, t, r = (statistics.fmean(gain(study, x) for x in by[m]) for m in ("grove", "tpe", "random"))
        if study.null:
            print(
                f"\nnull study: {sum(1 for x in by['grove'] if x['merges'])} of {len(by['grove'])} seeds merged anything\n"
            )
        else:
            ratio = lambda a, b: f"{a / b:.3f}" if b > 0 else ("inf" if a > 0 else "n/a")  # noqa: E731
            print(f"\nGrove / TPE held-out gain: {ratio(g, t)} · Grove / random: {ratio(g, r)}\n")
    print(f"suite wall time: {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                results,
                indent=1,
                default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o),
            )
        )


if __name__ == "__main__":
    main()
