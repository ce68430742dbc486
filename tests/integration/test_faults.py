"""Faults: a worker killed mid-experiment, the coordinator killed, Redis restarted mid-study or away."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from sqlmodel import select

from backend.api.main import create_app
from backend.core import db, gitops
from backend.core.config import Settings
from backend.core.models import Event, Job, Node, Study
from backend.core.security import create_token
from backend.services.studies import create_study
from backend.worker.celery_app import make_app
from tests.support.repos import make_repo, tiny_files
from tests.support.services import Service
from tests.support.waiting import free_port, wait_for


class RedisServer:
    def __init__(self, port: int, workdir: Path) -> None:
        self.port, self.workdir = port, workdir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis(port=self.port)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_for(up, timeout=20)

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def faulty(tmp_path: Path) -> Iterator[tuple[Service, RedisServer]]:
    """A private stack with short leases, so that lost work is found within seconds."""
    server = RedisServer(free_port(), tmp_path)
    server.start()
    url = f"redis://127.0.0.1:{server.port}/0"
    settings = Settings(data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt", redis_url=url)
    settings.ensure_dirs()
    env = {
        **os.environ,
        "GROVE_DATA_DIR": str(settings.data_dir),
        "GROVE_WORKTREES_DIR": str(settings.worktrees_dir),
        "GROVE_REDIS_URL": url,
        "GROVE_LEASE_SECONDS": "4",
        "GROVE_RECONCILE_SECONDS": "2",
    }
    svc = Service(settings, env)
    svc.start_worker("coord", "coordinator", 2, beat=True)
    svc.start_worker("cpu", "cpu,sealed", 2)
    yield svc, server
    svc.stop()
    if server.proc and server.proc.poll() is None:
        server.stop()


def start_study(svc: Service, tmp_path: Path, name: str, **kw: object) -> int:
    repo = make_repo(tmp_path / name, tiny_files(name=name, **kw))
    with db.session(svc.settings.db_url) as s:
        study = create_study(s, svc.settings, (repo / "grove.toml").read_text(), str(repo))
    make_app(svc.settings).send_task("coordinator.advance", args=[study.id])
    return study.id or 0


def rows(settings: Settings, model: type, *where: object) -> list:  # type: ignore[type-arg]
    with db.session(settings.db_url) as s:
        return list(s.exec(select(model).where(*where)))  # type: ignore[call-overload]


def finished(settings: Settings, sid: int) -> bool:
    return rows(settings, Study, Study.id == sid)[0].status == "finished"


def assert_clean_end(settings: Settings, sid: int) -> None:
    jobs = rows(settings, Job, Job.study_id == sid)
    assert len({(j.node_id, j.attempt) for j in jobs}) == len(jobs), "a dispatch was duplicated"
    assert all(j.status in ("done", "failed") for j in jobs)
    nodes = rows(settings, Node, Node.study_id == sid)
    assert not [n for n in nodes if n.status in ("queued", "running")]
    study = rows(settings, Study, Study.id == sid)[0]
    assert gitops.Repo(Path(study.repo_path)).worktrees() == [], "an orphan worktree remains"
    left = settings.worktrees_dir / study.name
    assert not left.exists() or not any(left.iterdir())


def test_worker_killed_mid_experiment_is_redelivered(
    faulty: tuple[Service, RedisServer], tmp_path: Path
) -> None:
    svc, _ = faulty
    sid = start_study(svc, tmp_path, "kill-cpu", experiments=3, sleep=3.0)
    wait_for(lambda: rows(svc.settings, Node, Node.study_id == sid, Node.status == "running"), timeout=120)
    victim = rows(svc.settings, Node, Node.study_id == sid, Node.status == "running")[0]
    svc.stop_worker("cpu", sig=9)
    svc.start_worker("cpu", "cpu,sealed", 2)
    wait_for(lambda: finished(svc.settings, sid), timeout=240)
    node = rows(svc.settings, Node, Node.id == victim.id)[0]
    assert node.status in ("evaluated", "merged", "rejected") and node.dev_n == 2
    starts = rows(svc.settings, Event, Event.node_id == victim.id, Event.type == "job.started")
    assert len(starts) >= 2 and len({e.payload["pid"] for e in starts}) >= 2, "the job was not run again"
    assert len({e.payload["job_id"] for e in starts}) == 1  # the same job, not a new attempt
    assert_clean_end(svc.settings, sid)


def test_coordinator_killed_between_steps_continues_after_restart(
    faulty: tuple[Service, RedisServer], tmp_path: Path
) -> None:
    svc, _ = faulty
    sid = start_study(svc, tmp_path, "kill-coord", experiments=4, sleep=2.0)
    # Kill it once a dispatched job is on a worker: that job must finish without a coordinator.
    experiment = Job.kind == "experiment"
    wait_for(
        lambda: rows(svc.settings, Job, Job.study_id == sid, experiment, Job.status == "running"), timeout=120
    )
    svc.stop_worker("coord", sig=9)
    wait_for(
        lambda: len(rows(svc.settings, Job, Job.study_id == sid, experiment, Job.status == "done")) >= 1,
        timeout=120,
    )
    svc.start_worker("coord", "coordinator", 2, beat=True)
    wait_for(lambda: finished(svc.settings, sid), timeout=240)
    assert len(rows(svc.settings, Job, Job.study_id == sid, Job.kind == "experiment")) == 4
    assert_clean_end(svc.settings, sid)


def test_redis_restart_mid_study_loses_nothing(faulty: tuple[Service, RedisServer], tmp_path: Path) -> None:
    svc, server = faulty
    sid = start_study(svc, tmp_path, "redis-restart", experiments=4, sleep=2.0)
    wait_for(lambda: rows(svc.settings, Node, Node.study_id == sid, Node.status == "running"), timeout=120)
    server.stop()
    server.start()  # empty: every queued message and lease is gone
    # Celery's Redis transport can crash a worker's main process on a dropped connection (a known
    # kombu race); a deployment's supervisor (`grove up`, Compose's restart policy) restarts it.
    wait_for(lambda: svc.revive() is not None and finished(svc.settings, sid), timeout=240)
    assert len(rows(svc.settings, Job, Job.study_id == sid, Job.kind == "experiment")) == 4
    assert_clean_end(svc.settings, sid)


def test_a_study_created_while_the_broker_is_away_starts_once_it_is_back_and_a_learning_job_fails_at_once(
    faulty: tuple[Service, RedisServer], tmp_path: Path
) -> None:
    svc, server = faulty
    repo = make_repo(tmp_path / "away", tiny_files(name="broker-away", experiments=2))
    headers = {"Authorization": f"Bearer {create_token(svc.settings, ['operator'], 'op')}"}
    server.stop()
    with TestClient(create_app(svc.settings)) as client:
        resp = client.post(
            "/api/v1/studies",
            json={"spec": (repo / "grove.toml").read_text(), "repository": str(repo)},
            headers=headers,
        )
        # A learning job would never be sent again: it fails at once, with the reason.
        learn = client.post(
            "/api/v1/learning/jobs", headers=headers, json={"kind": "sparse_eval", "params": {"docs": 8}}
        )
        assert learn.status_code == 503, learn.text
        [job] = client.get("/api/v1/learning/jobs", headers=headers).json()["data"]
        assert job["status"] == "failed" and "the task queue was unreachable" in job["error"]
    # The study is kept and said to be created: its first advance could not be queued, not lost.
    assert resp.status_code == 201, resp.text
    sid = int(resp.json()["id"])
    assert rows(svc.settings, Study, Study.id == sid)[0].status == "created"
    server.start()
    # Nothing sends that advance again but the reconciler, which starts a created study it finds.
    wait_for(lambda: svc.revive() is not None and finished(svc.settings, sid), timeout=240)
    assert len(rows(svc.settings, Job, Job.study_id == sid, Job.kind == "experiment")) == 2
    assert_clean_end(svc.settings, sid)
