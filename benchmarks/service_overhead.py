"""Service overheads, measured side by side in one run on this machine.

(a) N trivial experiments through the service (Redis, Celery workers, coordinator graph,
    gate, database) vs a bare shell loop doing the same worktree + edit + commit + eval: once
    one at a time (`parallel = 1`), once on the stack's 4 slots (`parallel = 4`); both after a
    warm-up study, so they measure the running service, not its first start;
(b) wall time of a study of 4 sleep-bound experiments on 4 worker slots vs a study of 1 (both
    from submission to the end; the experiment jobs' own span is printed beside it: a study's
    first round runs beside its baseline job, which takes one of the 4 slots while it runs);
(c) p95 latency of GET /tree on a study with 5,000 nodes (vs GET /health): read again unchanged,
    and with one node changed before each read.

    python benchmarks/service_overhead.py [--n 20] [--sleep 2.0] [--repeat 3]

(a) is measured `--repeat` times, the bare loop and both studies side by side in each round (a
bare loop of 20 takes about a second, and one run of it swings by a fifth on a busy machine);
the medians are compared. Each round also prints what the `parallel = 1` study ran: its nodes
and its evaluations (the nodes' dev runs; trunk's dev runs: the baseline's and extra seeds; the
held-out runs of the baseline and the gates). The budget of 20 counts each node once and each
extra dev seed, a node's or trunk's, once more (with `repeats = 1` a node's gain is unclear after
one seed, so most nodes get a second).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import UTC
from pathlib import Path

from fastapi.testclient import TestClient
from sqlmodel import select

from backend.api.main import create_app
from backend.cli.up import Stack, free_port
from backend.core import db
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.models import Job, Node, ReceiptRow, Study
from backend.core.security import create_token
from backend.services.studies import create_study

EVAL = """\
import json, os, sys, time, tomllib
cfg = tomllib.load(open("config.toml", "rb"))
time.sleep(float(cfg["knob"].get("sleep", 0)))
print(json.dumps({"score": %s}))
"""


def spec(name: str, n: int, parallel: int, score: str) -> str:
    return textwrap.dedent(f"""\
        [study]
        name = "{name}"
        goal = "benchmark"
        [objective]
        metric = "score"
        direction = "maximize"
        [evaluate]
        dev = "python eval.py"
        test = "python eval.py"
        repeats = 1
        [files]
        editable = ["config.toml"]
        [search]
        "config.toml:knob.x" = {{ low = 0.0, high = 100.0 }}
        [budget]
        experiments = {n}
        parallel = {parallel}
        [gate]
        mode = "auto"
        test_repeats = 1
        [plateau]
        warn = 1000
        change = 1000
        stop = 1000
        [policy]
        kind = "search"
        children = {parallel}
        """)


def make_repo(path: Path, name: str, n: int, parallel: int, score: str, sleep: float) -> Path:
    path.mkdir(parents=True)
    (path / "eval.py").write_text(EVAL % score)
    (path / "config.toml").write_text(f"[knob]\nx = 0.0\nsleep = {sleep}\n")
    (path / "grove.toml").write_text(spec(name, n, parallel, score))
    for cmd in (
        ["git", "init", "-q", "-b", "main"],
        ["git", "add", "-A"],
        ["git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "init"],
    ):
        subprocess.run(cmd, cwd=path, check=True)
    return path


def bare_loop(repo: Path, n: int, work: Path) -> float:
    """What a shell script would do per experiment: worktree, edit, commit, evaluate, clean up."""
    started = time.monotonic()
    for i in range(n):
        wt = work / f"wt{i}"
        subprocess.run(
            ["git", "worktree", "add", "-q", "--no-track", "-b", f"bare/{i}", str(wt), "main"],
            cwd=repo,
            check=True,
        )
        (wt / "config.toml").write_text(f"[knob]\nx = {i + 1}.0\nsleep = 0.0\n")
        subprocess.run(
            ["git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qam", f"e{i}"],
            cwd=wt,
            check=True,
        )
        subprocess.run([sys.executable, "eval.py"], cwd=wt, check=True, capture_output=True)
        subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=repo, check=True)
    return time.monotonic() - started


def run_study(settings: Settings, repo: Path, app: object) -> tuple[float, float, dict[str, int]]:
    """Submit a study to the running stack; return its wall time, its experiments' and what it ran.

    The experiments' wall time runs from the first experiment job's start to the last one's end
    (the sealed jobs, the baseline's and the gates', left out).
    """
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
    submitted = time.time()
    app.send_task("coordinator.advance", args=[study.id])  # type: ignore[attr-defined]
    while True:
        with db.session(settings.db_url) as s:
            st = s.get(Study, study.id)
            assert st is not None
            if st.status in ("finished", "failed") and st.finished_at is not None:
                jobs = list(s.exec(select(Job).where(Job.study_id == study.id, Job.kind == "experiment")))
                ended = st.finished_at
                break
        # The end is the study's own record of it (exact, like a bare loop's), not when this loop sees
        # it: the loop looks seldom, so as not to take the service's processor time.
        time.sleep(0.1)
    wall = ended.replace(tzinfo=ended.tzinfo or UTC).timestamp() - submitted
    runs = {"nodes": len(jobs)}  # and its evaluations by kind
    with db.session(settings.db_url) as s:
        st = s.get(Study, study.id)
        assert st is not None
        for r in s.exec(select(ReceiptRow).where(ReceiptRow.study_id == study.id)):
            kind = (
                "held-out"
                if r.kind == "test"
                else "trunk dev"
                if r.node_id == st.trunk_node_id
                else "node dev"
            )
            runs[kind] = runs.get(kind, 0) + 1
    first = min(j.started_at for j in jobs if j.started_at)
    last = max(j.finished_at for j in jobs if j.finished_at)
    return wall, (last - first).total_seconds(), runs


def tree_latency(
    settings: Settings, root: Path, nodes: int = 5000, calls: int = 40
) -> tuple[float, float, float]:
    repo = make_repo(root / "big", "big-tree", 1, 1, "1.0", 0.0)
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
    with db.session(settings.db_url) as s:
        parent = study.trunk_node_id
        for i in range(nodes - 1):
            s.add(Node(study_id=study.id or 0, parent_id=parent, depth=1 + i % 5, title=f"bulk {i}", status="evaluated",
                       dev_mean=0.5, dev_n=3, gain=0.01, gain_lcb=0.0))  # fmt: skip
    token = create_token(settings, ["viewer"], "bench")
    headers = {"Authorization": f"Bearer {token}"}
    with TestClient(create_app(settings)) as client:

        def p95(url: str) -> float:
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                r = client.get(url, headers=headers)
                times.append(time.perf_counter() - t)
                assert r.status_code == 200
            return statistics.quantiles(times, n=20)[-1]

        tree = p95(f"/api/v1/studies/{study.id}/tree")
        health = p95("/api/v1/health")
        # An active study: one node changes between two reads (a dashboard polling a running study).
        times = []
        for i in range(calls):
            with db.session(settings.db_url) as s:
                node = s.exec(select(Node).where(Node.study_id == study.id, Node.title == f"bulk {i}")).one()
                node.dev_n += 1
                s.add(node)
            t = time.perf_counter()
            assert client.get(f"/api/v1/studies/{study.id}/tree", headers=headers).status_code == 200
            times.append(time.perf_counter() - t)
        moving = statistics.quantiles(times, n=20)[-1]
    return tree, health, moving


def main() -> None:
    """Start a private stack and print the three measurements."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--sleep", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="grove-bench-") as tmp:
        root = Path(tmp)
        settings = Settings(data_dir=root / "data", worktrees_dir=root / "wt")
        stack = Stack(settings, port=free_port(), cpu_slots=4)
        env = stack.start(None)
        settings = Settings(
            data_dir=root / "data", worktrees_dir=root / "wt", redis_url=env["GROVE_REDIS_URL"]
        )
        from backend.worker.celery_app import make_app

        app = make_app(settings)
        try:
            score = "-abs(cfg['knob']['x'] - 50)"
            run_study(settings, make_repo(root / "warm", "warm-up", 4, 2, score, 0.0), app)
            bares: list[float] = []
            walls: dict[int, list[float]] = {1: [], 4: []}
            for r in range(args.repeat):
                repo = make_repo(root / f"bare{r}", f"bare-{r}", 1, 1, "1.0", 0.0)
                bares.append(bare_loop(repo, args.n, root / f"bare-wt{r}"))
                for parallel in (1, 4):
                    trivial = make_repo(
                        root / f"trivial{parallel}-{r}",
                        f"trivial-{parallel}-{r}",
                        args.n,
                        parallel,
                        score,
                        0.0,
                    )
                    wall, _, ran = run_study(settings, trivial, app)
                    walls[parallel].append(wall)
                    if parallel == 1:
                        runs = ", ".join(f"{v} {k}" for k, v in ran.items())
                print(f"    round {r + 1}: bare loop {bares[-1]:.2f} s, parallel = 1 {walls[1][-1]:.2f} s "
                      f"({runs} runs), parallel = 4 {walls[4][-1]:.2f} s")  # fmt: skip
            bare = statistics.median(bares)
            for parallel in (1, 4):
                wall = statistics.median(walls[parallel])
                print(f"(a) {args.n} trivial experiments, parallel = {parallel}: service {wall:.2f} s, bare loop "
                      f"{bare:.2f} s (medians of {args.repeat}) -> service/bare {wall / bare:.2f}x, per experiment "
                      f"{(wall - bare) / args.n * 1000:+.0f} ms")  # fmt: skip
            one_w, one_p, _ = run_study(
                settings, make_repo(root / "one", "sleep-one", 1, 1, "1.0", args.sleep), app
            )
            four_w, four_p, _ = run_study(
                settings, make_repo(root / "four", "sleep-four", 4, 4, "1.0", args.sleep), app
            )
            print(f"(b) sleep-bound ({args.sleep:g} s per run), whole studies: 1 experiment {one_w:.2f} s, 4 experiments "
                  f"on 4 slots {four_w:.2f} s -> ratio {four_w / one_w:.2f} (1.00 is perfect); the experiment jobs' span "
                  f"{one_p:.2f} s vs {four_p:.2f} s")  # fmt: skip
        finally:
            stack.stop()
        tree, health, moving = tree_latency(settings, root)
        print(f"(c) GET /tree with 5,000 nodes: p95 {tree * 1000:.1f} ms unchanged, {moving * 1000:.1f} ms with one "
              f"node changed before each read (GET /health p95 {health * 1000:.1f} ms, ratio {tree / health:.1f}x)")  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(PROJECT_ROOT))
    main()
