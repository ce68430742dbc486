"""Studies run by real Celery workers over a real Redis broker."""

from __future__ import annotations

import itertools
import re
import sqlite3
from pathlib import Path

from sqlmodel import col, select

from backend.core import db
from backend.core.models import Event, Job, Node, ReceiptRow, Study, now
from backend.services import lifecycle
from backend.services.studies import create_study
from backend.worker.celery_app import make_app
from tests.support.repos import make_repo, tiny_files
from tests.support.services import Service, sqlite_service
from tests.support.waiting import wait_for


def study_status(svc: Service, study_id: int) -> str:
    with db.session(svc.settings.db_url) as s:
        st = s.get(Study, study_id)
        assert st is not None
        return st.status


def test_study_runs_to_the_end_on_workers_with_parallel_executors(service: Service, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(name="celery-auto", experiments=4, sleep=1.0))
    with db.session(service.settings.db_url) as s:
        study = create_study(s, service.settings, (repo / "grove.toml").read_text(), str(repo))
    make_app(service.settings).send_task("coordinator.advance", args=[study.id])
    wait_for(lambda: study_status(service, study.id or 0) == "finished", timeout=180)
    with db.session(service.settings.db_url) as s:
        st = s.get(Study, study.id)
        jobs = list(s.exec(select(Job).where(Job.study_id == study.id).order_by(col(Job.id))))
        merged = list(
            s.exec(
                select(Node).where(
                    Node.study_id == study.id, Node.status == "merged", col(Node.parent_id).is_not(None)
                )
            )
        )
    assert st is not None and st.stop_reason.startswith("experiment budget spent")
    sealed = [j for j in jobs if j.kind != "experiment"]
    jobs = [j for j in jobs if j.kind == "experiment"]
    # Each attempt's task id names it (no secret); the row keeps only its token's hash.
    assert len(jobs) == 4 and all(
        j.status == "done" and re.fullmatch(rf"job-{j.id}-a1-[0-9a-f]{{16}}", j.task_id) for j in jobs
    )
    assert all(re.fullmatch("[0-9a-f]{64}", j.token) for j in jobs)
    # The baseline and every gate ran as jobs on the cpu queue, not inside the coordinator.
    assert [j.kind for j in sealed if j.kind != "gate"] == ["baseline", "heldout"]
    gated = [j.node_id for j in sealed if j.kind == "gate"]
    assert merged and {n.id for n in merged} <= set(gated)
    assert all(
        j.status == "done" and re.fullmatch(rf"job-{j.id}-a{j.attempt}-[0-9a-f]{{16}}", j.task_id)
        for j in sealed
    )
    assert {j.attempt for j in sealed} == {0, -1}
    cpu_log = (service.logs / "cpu.log").read_text()
    coord_log = (service.logs / "coord.log").read_text()
    assert all(f"cpu.sealed[{j.task_id}]" in cpu_log for j in sealed)
    assert "sealed[" not in coord_log
    assert merged and st.trunk_commit == merged[-1].gate_commit
    spans = sorted((j.started_at, j.finished_at) for j in jobs if j.started_at and j.finished_at)
    overlaps = any(a[1] > b[0] for a, b in itertools.pairwise(spans))
    assert overlaps, "two executors never ran at once"


def run_until(svc: Service, repo: Path, status: str) -> int:
    """Create the repository's study, start it on the workers, and return its id once it is `status`."""
    with db.session(svc.settings.db_url) as s:
        study = create_study(s, svc.settings, (repo / "grove.toml").read_text(), str(repo))
    make_app(svc.settings).send_task("coordinator.advance", args=[study.id])
    wait_for(lambda: study_status(svc, study.id or 0) == status, timeout=180)
    return study.id or 0


def test_a_gpu_studys_sealed_runs_go_to_the_gpu_queue(redis_url: str, tmp_path: Path) -> None:
    svc = sqlite_service(tmp_path / "svc", redis_url, db_number=15)
    # No cpu worker at all: everything this study runs must reach the gpu worker (a CPU machine here).
    svc.start_worker("gpu-coord", "coordinator", 1)
    svc.start_worker("gpu", "gpu,gpu-sealed", 1)
    try:
        files = tiny_files(name="gpu-sealed", experiments=2)
        files["grove.toml"] += "\n[resources]\ngpu = true\n"
        sid = run_until(svc, make_repo(tmp_path / "r", files), "finished")
        with db.session(svc.settings.db_url) as s:
            sealed = list(s.exec(select(Job).where(Job.study_id == sid, Job.kind != "experiment")))
        assert {j.kind for j in sealed} == {"baseline", "heldout", "gate"} and all(
            j.status == "done" for j in sealed
        )
        log = (svc.logs / "gpu.log").read_text()
        assert all(f"gpu.sealed[{j.task_id}]" in log for j in sealed)
    finally:
        svc.stop()


def test_a_baseline_that_fails_in_its_job_fails_the_study_with_the_reason(
    service: Service, tmp_path: Path
) -> None:
    files = tiny_files(name="celery-bad-baseline", experiments=2)
    files["eval.py"] = "import sys\nprint('cannot load the data', file=sys.stderr)\nsys.exit(3)\n"
    sid = run_until(service, make_repo(tmp_path / "r", files), "failed")
    with db.session(service.settings.db_url) as s:
        st = s.get(Study, sid)
        jobs = list(s.exec(select(Job).where(Job.study_id == sid).order_by(col(Job.id))))
    assert st is not None and "fails on the unchanged repository" in st.stop_reason
    assert "cannot load the data" in st.stop_reason
    # The search policy proposes without trunk's dev value, so the first round (parallel = 2) ran
    # beside the baseline; the failure ended those experiments with the study, and sent nothing more.
    assert [(j.kind, j.status) for j in jobs] == [("baseline", "failed"), *[("experiment", "failed")] * 2]


def test_the_held_out_baseline_runs_beside_the_first_experiments(service: Service, tmp_path: Path) -> None:
    files = tiny_files(name="celery-heldout-beside", experiments=2)
    # Trunk's dev runs take a second (the first round is sent before they end); its held-out, four.
    files["eval.py"] = files["eval.py"].replace(
        'if sys.argv[1] == "dev":',
        'if sys.argv[1] == "test":\n    time.sleep(4)\nif sys.argv[1] == "dev" and x == 0:\n    time.sleep(0.5)\n'
        'if sys.argv[1] == "dev":',
    )
    sid = run_until(service, make_repo(tmp_path / "r", files), "finished")
    with db.session(service.settings.db_url) as s:
        st = s.get(Study, sid)
        jobs: dict[str, Job] = {}
        experiments = list(s.exec(select(Job).where(Job.study_id == sid, Job.kind == "experiment")))
        for j in s.exec(select(Job).where(Job.study_id == sid).order_by(col(Job.id))):
            jobs.setdefault(j.kind, j)  # the first of each kind
        integrated = s.exec(
            select(Event).where(Event.study_id == sid, Event.node_id == jobs["experiment"].node_id,
                                Event.type == "node.integrated")
        ).one()  # fmt: skip
    assert st is not None and st.baseline_dev and st.baseline_heldout
    baseline, heldout, first = jobs["baseline"], jobs["heldout"], jobs["experiment"]
    assert baseline.finished_at and heldout.started_at and heldout.finished_at and first.started_at
    # The search policy proposes without trunk's value: the first experiment was sent with trunk's
    # dev job, not after it, and read only once that job had ended; experiments ran while the held-out ran.
    assert first.created_at < baseline.finished_at <= integrated.time
    assert any(
        e.started_at
        and e.finished_at
        and e.started_at < heldout.finished_at
        and e.finished_at > heldout.started_at
        for e in experiments
    )


SLOW_TRUNK_EVAL = """\
import json, os, sys, time, tomllib
x = tomllib.load(open("config.toml", "rb"))["knob"]["x"]
seed = int(os.environ.get("GROVE_SEED", "0"))
if x == 0 and seed < 2 and sys.argv[1] == "dev":
    time.sleep(2)  # trunk's dev job: slower than the first experiment's first look
# Any change is worth +0.1 on every seed; on seed 1 it reads +0.3. Two seeds cannot tell.
score = 10.0 + (0.1 + (0.2 if seed == 1 else 0.0) if x != 0 else 0.0)
print(json.dumps({"score": score if sys.argv[1] == "dev" else score + 700, "size": x}))
"""


def test_a_first_experiment_that_looks_before_trunks_dev_job_ends_waits_for_its_values(
    service: Service, tmp_path: Path
) -> None:
    files = tiny_files(name="celery-wait-trunk", experiments=5, margin=0.0, max_size=5)
    files["eval.py"] = SLOW_TRUNK_EVAL
    files["grove.toml"] = (
        files["grove.toml"]
        .replace("repeats = 2\n", "repeats = 2\nmax_repeats = 6\n", 1)
        .replace("parallel = 2\n", "parallel = 1\n")
    )
    sid = run_until(service, make_repo(tmp_path / "r", files), "finished")
    with db.session(service.settings.db_url) as s:
        jobs = list(s.exec(select(Job).where(Job.study_id == sid).order_by(col(Job.id))))
        baseline = next(j for j in jobs if j.kind == "baseline")
        first = s.get(Node, next(j for j in jobs if j.kind == "experiment").node_id)
        assert first is not None
        looked = sorted(
            r.created_at
            for r in s.exec(
                select(ReceiptRow).where(
                    ReceiptRow.node_id == first.id, ReceiptRow.kind == "dev", ReceiptRow.seed < 2
                )
            )
        )
    # Its first look (seeds 0 and 1) was in before trunk's: it waited for trunk's values and went on
    # to 4 and 6 paired seeds, where two seeds cannot tell the gain (not cut at the first look).
    assert baseline.finished_at is not None and len(looked) == 2 and looked[-1] < baseline.finished_at
    assert first.dev_n == 6


def test_a_held_out_baseline_that_fails_ends_the_study_and_what_runs_beside_it(
    service: Service, tmp_path: Path
) -> None:
    files = tiny_files(name="celery-bad-heldout", experiments=4, sleep=2.0)
    # One experiment at a time on two worker slots: the held-out job runs beside the first, whose
    # runs sleep (trunk's, x = 0, do not: its held-out job fails while the experiment runs).
    files["grove.toml"] = files["grove.toml"].replace("parallel = 2", "parallel = 1")
    files["eval.py"] = (
        files["eval.py"]
        .replace(
            'if sys.argv[1] == "dev":',
            'if sys.argv[1] == "test":\n    print("no labels here", file=sys.stderr)\n    sys.exit(3)\nif sys.argv[1] == "dev":',
        )
        .replace(
            'time.sleep(float(cfg["knob"].get("sleep", 0)))',
            'time.sleep(float(cfg["knob"].get("sleep", 0)) if x else 0)',
        )
    )
    sid = run_until(service, make_repo(tmp_path / "r", files), "failed")
    with db.session(service.settings.db_url) as s:
        st = s.get(Study, sid)
        jobs = list(s.exec(select(Job).where(Job.study_id == sid).order_by(col(Job.id))))
        nodes = list(s.exec(select(Node).where(Node.study_id == sid)))
    assert st is not None and "sealed test evaluation fails on the unchanged repository" in st.stop_reason
    kinds = [(j.kind, j.status) for j in jobs]
    assert kinds[0] == ("baseline", "done") and ("heldout", "failed") in kinds
    assert all(j.status in ("done", "failed") for j in jobs)  # nothing of a failed study runs on
    assert not [n for n in nodes if n.status in ("queued", "running", "proposed")]
    # The first experiment (its runs sleep) was running beside the held-out job: it was cancelled.
    first = next(j for j in jobs if j.kind == "experiment")
    assert first.outcome.get("reason") == "cancelled"
    assert any(n.status == "cancelled" and n.status_reason == "the study failed" for n in nodes)


def test_a_study_stopped_while_its_baseline_job_runs_finishes(service: Service, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(name="celery-stop-baseline", experiments=2, sleep=3.0))
    with db.session(service.settings.db_url) as s:
        study = create_study(s, service.settings, (repo / "grove.toml").read_text(), str(repo))
    sid = study.id or 0
    app = make_app(service.settings)
    app.send_task("coordinator.advance", args=[sid])

    def baseline_running() -> bool:  # and the first round sent beside it
        with db.session(service.settings.db_url) as s:
            job = s.exec(select(Job).where(Job.study_id == sid, Job.kind == "baseline")).first()
            sent = s.exec(select(Job).where(Job.study_id == sid, Job.kind == "experiment")).all()
            return job is not None and job.status == "running" and len(sent) == 2

    wait_for(baseline_running, timeout=60)
    with db.session(service.settings.db_url) as s:
        lifecycle.stop(s, sid, by="test")
        stopped = now()
    app.send_task("coordinator.advance", args=[sid])
    wait_for(lambda: study_status(service, sid) == "finished", timeout=120)
    with db.session(service.settings.db_url) as s:
        st = s.get(Study, sid)
        jobs = list(s.exec(select(Job).where(Job.study_id == sid).order_by(col(Job.id))))
    assert st is not None and st.stop_reason == "stopped by user"
    # The baseline and the first round (sent with it: the search policy proposes without trunk's
    # value); nothing was dispatched after the stop, and nothing runs on.
    assert [j.kind for j in jobs] == ["baseline", "experiment", "experiment"]
    assert all(j.created_at < stopped and j.status in ("done", "failed") for j in jobs)


def test_a_gate_job_that_uses_the_last_sealed_query_still_merges(service: Service, tmp_path: Path) -> None:
    # One gate query allowed: the job spends it, and the coordinator must still act on the pass.
    files = tiny_files(name="celery-last-query", experiments=4, max_test_runs=1)
    sid = run_until(service, make_repo(tmp_path / "r", files), "finished")
    with db.session(service.settings.db_url) as s:
        st = s.get(Study, sid)
        gated = list(s.exec(select(Node).where(Node.study_id == sid, Node.gated == True)))  # noqa: E712
    assert st is not None and st.test_queries == 2  # the baseline and the one gate
    assert len(gated) == 1 and gated[0].gate_reason.startswith("passed")
    assert gated[0].status == "merged" and st.trunk_commit == gated[0].gate_commit


def test_pool_processes_open_the_database_before_their_first_task(redis_url: str, tmp_path: Path) -> None:
    svc = sqlite_service(tmp_path / "svc", redis_url, db_number=10)
    db_file = Path(svc.settings.db_url.removeprefix("sqlite:///"))
    assert not db_file.exists() and not svc.settings.checkpoint_path.exists()
    svc.start_worker("warm", "coordinator,cpu,sealed", 2)
    try:
        # No task was sent: the schema and the coordinator's checkpointer come from the pool's start.
        def migrated() -> bool:
            if not db_file.exists():
                return False
            with sqlite3.connect(db_file) as conn:
                tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            return {"alembic_version", "study", "job"} <= tables

        wait_for(migrated, timeout=60)
        wait_for(svc.settings.checkpoint_path.exists, timeout=60)
        assert b"Traceback" not in (svc.logs / "warm.log").read_bytes()
    finally:
        svc.stop()


def test_jobs_waiting_behind_busy_slots_are_never_sent_again(redis_url: str, tmp_path: Path) -> None:
    # Ten experiments at once on a worker with two slots: eight wait in the queue for well past the
    # lease age (4 s here) while the reconciler runs every 2 s. Waiting is not being lost: no task
    # is sent twice, and the queue never holds more messages than there are jobs.
    import json
    import time

    import redis

    svc = sqlite_service(tmp_path / "svc", redis_url, db_number=8)
    svc.env.update({"GROVE_LEASE_SECONDS": "4", "GROVE_RECONCILE_SECONDS": "2"})
    broker = redis.Redis.from_url(svc.settings.redis_url)
    broker.flushdb()
    svc.start_worker("coord", "coordinator", 2, beat=True)
    svc.start_worker("cpu", "cpu,sealed", 2)
    try:
        files = tiny_files(name="waiting", experiments=10, sleep=6.0, max_size=20, values=list(range(12)))
        files["grove.toml"] = files["grove.toml"].replace("parallel = 2\n", "parallel = 10\n")
        repo = make_repo(tmp_path / "r", files)
        with db.session(svc.settings.db_url) as s:
            study = create_study(s, svc.settings, (repo / "grove.toml").read_text(), str(repo))
        make_app(svc.settings).send_task("coordinator.advance", args=[study.id])

        def jobs() -> list[Job]:
            with db.session(svc.settings.db_url) as s:
                return list(s.exec(select(Job).where(Job.study_id == study.id, Job.kind == "experiment")))

        wait_for(lambda: broker.llen("cpu") >= 8, timeout=60)

        def reconciles() -> int:
            return (svc.logs / "coord.log").read_text().count("coordinator.reconcile[")

        before, since, sizes = reconciles(), time.monotonic(), []

        def watched_long_enough() -> bool:
            """Look at the queue; done once eight reconciles ran over four lease ages (16 s)."""
            ids = [json.loads(m)["headers"]["id"] for m in broker.lrange("cpu", 0, -1)]
            assert len(ids) == len(set(ids)), f"a waiting task was sent again: {ids}"
            sizes.append(len(ids))
            return reconciles() >= before + 8 and time.monotonic() - since >= 16

        wait_for(watched_long_enough, timeout=60, every=0.2)
        assert 8 <= max(sizes) <= len(jobs()) == 10
        assert all(j.status in ("queued", "running", "done") for j in jobs())
    finally:
        svc.stop()
