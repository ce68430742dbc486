"""Compare the `search` policy with random search at equal budget on the digits example.

Each run is a whole study (real worktrees, real evaluations, the real sealed gate in `auto`
mode) with plateau stopping disabled, so both policies spend the same number of
experiments. Prints the held-out gain of the final trunk over the baseline per seed.

    python benchmarks/search_vs_random.py [--seeds 0 1 2] [--experiments 16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import tomlkit

from agents.policies.search import SearchPolicy
from backend.cli.runner import run_study
from backend.core import db
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.models import Job, Study
from backend.services.studies import create_study

EXAMPLE = PROJECT_ROOT / "examples" / "digits"


def one(policy_name: str, seed: int, experiments: int, root: Path) -> tuple[float, float, int, float, float]:
    """Run one study; return (held-out gain, dev gain, experiments used, seconds, final held-out)."""
    doc = tomlkit.parse((EXAMPLE / "grove.toml").read_text())
    doc["study"]["name"] = f"digits-{policy_name}-{seed}"  # type: ignore[index]
    doc["policy"]["seed"] = seed  # type: ignore[index]
    doc["budget"]["experiments"] = experiments  # type: ignore[index]
    doc["gate"]["mode"] = "auto"  # type: ignore[index]
    doc["gate"]["max_test_runs"] = experiments  # type: ignore[index]
    doc["plateau"] = {"warn": 1000, "change": 1000, "stop": 1000}
    settings = Settings(data_dir=root / f"{policy_name}-{seed}", worktrees_dir=root / "wt")
    settings.ensure_dirs()
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, tomlkit.dumps(doc), str(EXAMPLE))
    policy = SearchPolicy() if policy_name == "search" else SearchPolicy("random")
    started = time.monotonic()
    run_study(settings, study.id or 0, approver=lambda s, n: {"approved": True}, policy=policy)
    with db.session(settings.db_url) as s:
        st = s.get(Study, study.id)
        assert st is not None
        used = len(list(s.exec(db_select_jobs(study.id or 0))))
    held = statistics.fmean(st.trunk_heldout) - statistics.fmean(st.baseline_heldout)
    dev = statistics.fmean(st.trunk_dev) - statistics.fmean(st.baseline_dev)
    return held, dev, used, time.monotonic() - started, statistics.fmean(st.trunk_heldout)


def db_select_jobs(study_id: int):  # type: ignore[no-untyped-def]
    from sqlmodel import select

    return select(Job.id).where(Job.study_id == study_id)


def main() -> None:
    """Run both policies over the seeds and print a table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--experiments", type=int, default=16)
    args = ap.parse_args()
    results: dict[str, list[tuple[float, float, int, float, float]]] = {"search": [], "random": []}
    with tempfile.TemporaryDirectory(prefix="grove-bench-") as tmp:
        for seed in args.seeds:
            for name in results:
                results[name].append(one(name, seed, args.experiments, Path(tmp)))
                h, d, used, secs, final = results[name][-1]
                print(
                    f"seed {seed} {name:7s} held-out gain {h:+.4f} (final {final:.4f})  dev gain {d:+.4f}  "
                    f"experiments {used}  {secs:.0f}s",
                    flush=True,
                )
    print()
    print("| policy | held-out gain per seed | mean held-out gain | mean final held-out | mean experiments |")
    print("|---|---|---|---|---|")
    for name, rs in results.items():
        per = ", ".join(f"{r[0]:+.4f}" for r in rs)
        print(
            f"| {name} | {per} | {statistics.fmean(r[0] for r in rs):+.4f} | "
            f"{statistics.fmean(r[4] for r in rs):.4f} | {statistics.fmean(r[2] for r in rs):.1f} |"
        )
    s, r = (statistics.fmean(x[0] for x in results[k]) for k in ("search", "random"))
    print(f"\nsearch / random mean held-out gain: {s / r:.3f}" if r else "")


if __name__ == "__main__":
    main()
