"""`grove worker` supervises its Celery worker: neither a dead worker nor a Redis restart under it
takes a remote machine's capacity away for good."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from backend.core import db
from backend.core.config import PROJECT_ROOT
from backend.core.models import Job, Study
from backend.services.studies import create_study
from backend.worker.celery_app import make_app
from tests.integration.test_remote_workers import FAST, Stack, rows
from tests.support.repos import make_repo, tiny_files
from tests.support.waiting import free_port, wait_for


class OwnRedis:
    """A redis-server of this test's own, which it may kill and start again on the same port."""

    def __init__(self, root: Path) -> None:
        self.port, self.root = free_port(), root
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.root)],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for(self.answers, timeout=20)

    def answers(self) -> bool:
        try:
            return bool(redis.Redis(port=self.port, socket_timeout=1).ping())
        except redis.ConnectionError:
            return False

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    r = OwnRedis(tmp_path)
    yield r
    if r.proc is not None and r.proc.poll() is None:
        r.proc.terminate()
        r.proc.wait(timeout=10)


def children(pid: int) -> list[int]:
    """Return a process's child pids."""
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(x) for x in text.split()]


def run_study(stack: Stack, tmp_path: Path, name: str) -> int:
    repo = make_repo(tmp_path / name, tiny_files(name=name, experiments=2))
    with db.session(stack.svc.settings.db_url) as s:
        study = create_study(s, stack.svc.settings, (repo / "grove.toml").read_text(), str(repo))
    make_app(stack.svc.settings).send_task("coordinator.advance", args=[study.id])
    return study.id or 0


def test_a_killed_worker_and_a_redis_restart_leave_grove_worker_taking_jobs(
    own_redis: OwnRedis, tmp_path: Path
) -> None:
    stack = Stack(tmp_path / "server", own_redis.url)
    worker: subprocess.Popen[bytes] | None = None
    try:
        data = tmp_path / "machine"
        data.mkdir()
        env = {
            "PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8",
            "GROVE_API_URL": stack.url, "GROVE_WORKER_TOKEN": stack.token,
            "GROVE_REDIS_URL": stack.svc.settings.redis_url, "GROVE_DATA_DIR": str(data), **FAST,
        }  # fmt: skip
        log = tmp_path / "worker.log"
        with open(log, "ab") as out:
            worker = subprocess.Popen(
                [sys.executable, "-m", "backend.cli.main", "worker", "--queues", "cpu", "--concurrency", "1"],
                env=env, stdout=out, stderr=out, cwd=PROJECT_ROOT, start_new_session=True,
            )  # fmt: skip
        wait_for(lambda: b"ready." in log.read_bytes(), timeout=60)
        first = run_study(stack, tmp_path, "before")
        wait_for(lambda: rows(stack, Study, Study.id == first)[0].status == "finished", timeout=180)

        # Its Celery worker dies outright: `grove worker` starts it again, which takes jobs.
        (celery,) = children(worker.pid)
        os.kill(celery, signal.SIGKILL)
        wait_for(lambda: log.read_bytes().count(b" ready.") == 2, timeout=60)
        assert b"exited with status -9" in log.read_bytes() and children(worker.pid) != [celery]

        # Redis goes away and comes back on the same port: the worker takes the next job within 30 s.
        own_redis.kill()
        own_redis.start()
        back = time.monotonic()
        second = run_study(stack, tmp_path, "after")

        def taken() -> list[Job]:
            stack.svc.revive()  # the server's own Celery workers, as their supervisor would
            return rows(stack, Job, Job.study_id == second, Job.kind == "experiment", Job.status != "queued")

        wait_for(taken, timeout=30)
        took = time.monotonic() - back
        wait_for(lambda: rows(stack, Study, Study.id == second)[0].status == "finished", timeout=180)
        experiments = rows(stack, Job, Job.study_id == second, Job.kind == "experiment")
        assert experiments and all(j.status == "done" for j in experiments), [
            (j.id, j.status) for j in experiments
        ]
        assert took < 30
        assert worker.poll() is None  # the supervisor itself never stopped
    finally:
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)
        stack.stop()
    assert worker.returncode == 0  # a stop signal ends it with the worker's own (clean) status
