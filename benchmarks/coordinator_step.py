"""Coordinator step time as the tree grows: a study with 100 nodes vs the same study with 5,000.

A step is what the coordinator does when an experiment ends: integrate the result, back-propagate,
prune, ask the policy for the next proposals and dispatch them. The trees are built by inserting
evaluated nodes in bulk; the measured steps then run the real graph (SQLite, the `search`
policy, real experiments run inline between steps, outside the timing).

Some steps also queue a gate job or merge a passed candidate, and the two studies do not do so
equally often (their samplers see different histories): the headline ratio compares the steps
that did neither (like with like); the ratio over all steps is printed beside it.

    python benchmarks/coordinator_step.py [--small 100] [--large 5000] [--steps 20]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

from sqlmodel import col, func, select

from backend.core import db
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.models import Event, Job, Node, now
from backend.engine import sealed
from backend.engine.driver import Driver
from backend.engine.experiment import run_experiment
from backend.engine.jobstore import token_hash
from backend.engine.sealed import SealedJobs
from backend.engine.site import LocalSite
from backend.services.studies import create_study

sys.path.insert(0, str(PROJECT_ROOT / "benchmarks"))
from service_overhead import make_repo

FANOUT = 8


class Inline:
    """A dispatcher that hands out tokens and leaves running the jobs to the benchmark."""

    def __init__(self, settings: Settings) -> None:
        self.settings, self.pending = settings, []  # type: ignore[var-annotated]

    def submit(self, job_id: int) -> None:
        """Queue the job with a fresh token."""
        with db.session(self.settings.db_url) as s:
            job = s.get(Job, job_id)
            if job is None or job.status in ("done", "failed"):
                return
            token = uuid.uuid4().hex
            job.token, job.status = token_hash(token), "queued"  # the row keeps its hash only
            s.add(job)
            self.pending.append((job_id, token, job.kind))

    def run(self) -> None:
        """Run every pending job here, as a worker would."""
        while self.pending:
            job_id, token, kind = self.pending.pop(0)
            if kind == "experiment":
                run_experiment(LocalSite(self.settings), job_id, token)
            else:
                sealed.run(LocalSite(self.settings), job_id, token)


def grow(settings: Settings, study_id: int, root_id: int, commit: str, n: int) -> None:
    """Add `n` evaluated nodes under trunk, as a long study would have left them.

    The tree has the shape ideation gives it: each node that did not fail has up to
    `FANOUT` children, breadth first (5,000 nodes reach depth 5).
    """
    rng = random.Random(0)
    long_ago = now() - timedelta(days=1)  # written earlier in a long study, not in this step
    parents: list[tuple[int, int]] = [(root_id, 0)]  # (node, depth) that may take children, oldest first
    with db.session(settings.db_url) as s:
        for i in range(n):
            parent, depth = parents[i // FANOUT]
            x = rng.uniform(0, 100)
            dev = [-abs(x - 50) - 60 + rng.gauss(0, 1) for _ in range(2)]
            status = rng.choice(["evaluated", "evaluated", "rejected", "failed", "pruned"])
            node = Node(
                study_id=study_id, parent_id=parent, depth=depth + 1, title=f"config.toml:knob.x 0 → {x:.3f}",
                status=status, origin="policy", edits={"config.toml:knob.x": x}, hypothesis={"mechanism": "search"},
                dev_values=dev if status != "failed" else [], dev_mean=sum(dev) / 2 if status != "failed" else None,
                dev_n=2 if status != "failed" else 0, branch=f"bulk/{i}", base_commit=commit, round_no=-1,
                commit=commit if status != "failed" else "", created_at=long_ago, updated_at=long_ago,
            )  # fmt: skip
            s.add(node)
            s.flush()
            if status != "failed":
                parents.append((node.id or 0, depth + 1))


class Study:
    """A study of `nodes` nodes whose coordinator steps can be timed one at a time."""

    def __init__(self, root: Path, nodes: int) -> None:
        settings = Settings(data_dir=root / "data", worktrees_dir=root / "wt")
        settings.ensure_dirs()
        repo = make_repo(root / "repo", f"step{nodes}", 10 * nodes, 1, "-abs(cfg['knob']['x'] - 50)", 0.0)
        text = (repo / "grove.toml").read_text().replace("repeats = 1", "repeats = 2")
        text = text.replace('kind = "search"', 'kind = "search"\nsampler = "tpe"')
        with db.session(settings.db_url) as s:
            study = create_study(s, settings, text, str(repo))
            sid, root_id, base = study.id or 0, study.trunk_node_id or 0, study.trunk_commit
        grow(settings, sid, root_id, base, nodes - 1)
        self.inline = Inline(settings)
        # As under Celery, the baseline and the gates are jobs: the coordinator only decides.
        self.driver = Driver(settings, sid, self.inline, gatekeeper=SealedJobs(settings, self.inline.submit))
        self.driver.advance()  # the baseline job
        self.inline.run()
        self.driver.advance()  # the first proposal
        self.settings, self.study_id = settings, sid
        self.times: list[float] = []
        self.plain: list[float] = []  # steps that neither queued a gate job nor merged

    def step(self) -> None:
        """Run what the last step dispatched (untimed), then time the coordinator's next step."""
        self.inline.run()
        before = self._last_event()
        started = time.perf_counter()
        self.driver.advance()
        self.times.append(time.perf_counter() - started)
        with db.session(self.settings.db_url) as s:
            gated = s.exec(
                select(func.count()).where(
                    Event.study_id == self.study_id,
                    col(Event.id) > before,
                    col(Event.type).in_(["gate.queued", "node.merged"]),
                )
            ).one()
        if not gated:
            self.plain.append(self.times[-1])

    def _last_event(self) -> int:
        with db.session(self.settings.db_url) as s:
            return s.exec(select(func.max(Event.id))).one() or 0


def main() -> None:
    """Build both studies, time their steps alternately (so both see the same machine), print the ratio."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", type=int, default=100)
    ap.add_argument("--large", type=int, default=5000)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="grove-step-") as tmp:
        small, large = Study(Path(tmp) / "small", args.small), Study(Path(tmp) / "large", args.large)
        for _ in range(args.steps):
            small.step()
            large.step()
    plain, every = {}, {}
    for n, study in ((args.small, small), (args.large, large)):
        times = study.times
        plain[n], every[n] = statistics.median(study.plain or times), statistics.median(times)
        print(f"{n:>6} nodes: step median {plain[n] * 1000:.0f} ms over {len(study.plain)} steps without a gate "
              f"or merge; {every[n] * 1000:.0f} ms over all {len(times)} (min {min(times) * 1000:.0f}, "
              f"max {max(times) * 1000:.0f})")  # fmt: skip
    print(f"step time {args.large} / {args.small} nodes: {plain[args.large] / plain[args.small]:.2f}x "
          f"(all steps: {every[args.large] / every[args.small]:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
