"""Job tokens are kept hashed: a copy of the database holds no token a worker could present."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_lib
from alembic import command
from sqlalchemy import create_engine, text

from backend.api.main import create_app
from backend.core import db
from backend.core.config import Settings
from backend.core.migrate import alembic_config
from backend.core.models import Job, LearningJob, Node, Study
from backend.core.security import create_token
from backend.engine import jobstore, learning
from backend.services import lifecycle
from backend.services.studies import create_study
from backend.worker.celery_app import make_app
from backend.worker.dispatch import CeleryDispatcher
from tests.support.repos import make_repo, tiny_files
from tests.support.services import serve
from tests.support.waiting import free_port


@dataclass
class Stack:
    settings: Settings
    url: str
    worker: dict[str, str]
    operator: dict[str, str]
    study: Study
    broker: redis_lib.Redis


@pytest.fixture
def stack(tmp_path: Path, redis_url: str) -> Iterator[Stack]:
    broker_url = redis_url.rsplit("/", 1)[0] + "/3"
    settings = Settings(data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt", redis_url=broker_url)
    settings.ensure_dirs()
    repo = make_repo(tmp_path / "repo", tiny_files(name="tokens"))
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
        study.status = "running"  # as its coordinator has it by the time it sends experiments
        s.add(study)
        s.flush()
        s.refresh(study)
        s.expunge(study)
    port = free_port()
    server, thread = serve(create_app(settings), port)
    broker = redis_lib.Redis.from_url(broker_url)
    yield Stack(
        settings, f"http://127.0.0.1:{port}/api/v1",
        {"Authorization": f"Bearer {create_token(settings, ['worker'], 'fleet')}"},
        {"Authorization": f"Bearer {create_token(settings, ['operator'], 'op')}"}, study, broker,
    )  # fmt: skip
    server.should_exit = True
    thread.join(timeout=10)
    broker.flushdb()


def sent(broker: redis_lib.Redis, task: str) -> list[tuple[str, list[Any]]]:
    """Return (task id, args) of every queued message of task `task`, read from the broker's lists."""
    out = []
    for key in broker.keys("*"):
        if broker.type(key) != b"list":
            continue
        for raw in broker.lrange(key, 0, -1):
            msg = json.loads(raw)
            headers = msg.get("headers", {})
            if headers.get("task") == task:
                args = json.loads(base64.b64decode(msg["body"]))[0]
                out.append((headers["id"], args))
    return out


def database_bytes(settings: Settings) -> bytes:
    data = settings.data_dir
    return b"".join((data / n).read_bytes() for n in ("grove.db", "grove.db-wal") if (data / n).exists())


def test_an_experiments_token_travels_with_its_task_and_the_database_keeps_its_hash(stack: Stack) -> None:
    settings = stack.settings
    with db.session(settings.db_url) as s:
        node = Node(study_id=stack.study.id or 0, parent_id=stack.study.trunk_node_id, depth=1, title="x",
                    status="queued", base_commit=stack.study.trunk_commit, branch=f"grove/{stack.study.name}/n9")  # fmt: skip
        s.add(node)
        s.flush()
        job = Job(study_id=stack.study.id or 0, node_id=node.id or 0, attempt=1)
        s.add(job)
        s.flush()
        job_id = job.id or 0
    dispatcher = CeleryDispatcher(settings, make_app(settings))
    dispatcher.submit(job_id)
    [(task_id, (sent_id, token, _))] = sent(stack.broker, "cpu.experiment")
    with db.session(settings.db_url) as s:
        row = s.get(Job, job_id)
        assert row is not None
    assert sent_id == job_id and task_id.startswith(f"job-{job_id}-a1-") and token not in task_id
    assert row.task_id == task_id and row.token == hashlib.sha256(token.encode()).hexdigest()
    assert token.encode() not in database_bytes(settings)  # nowhere in the rows, the file or its log
    # Sent again (the reconciler does, for a task it thinks lost): the copy already queued stays good.
    dispatcher.submit(job_id)
    assert sent(stack.broker, "cpu.experiment") == [(task_id, [job_id, token, stack.study.id])] * 2
    # A stop revokes the queued task by its id, which the database still knows.
    with db.session(settings.db_url) as s:
        assert lifecycle.stop(s, stack.study.id or 0, by="op") == [task_id]
        s.rollback()  # the study goes on: the claim below is what is tested next

    def claim(token: str) -> int:
        body = {"token": token, "host": "w", "pid": 1}
        return httpx.post(
            f"{stack.url}/worker/jobs/{job_id}/claim", json=body, headers=stack.worker
        ).status_code

    # The hash and the task id, which a copy of the database or a worker's log shows, are no token.
    assert claim(row.token) in (409, 422) and claim(task_id) in (409, 422)
    assert claim(token) == 200


def test_a_learning_jobs_token_is_kept_hashed(stack: Stack, tmp_path: Path) -> None:
    resp = httpx.post(f"{stack.url}/learning/jobs", headers=stack.operator, timeout=30,
                      json={"kind": "sparse_eval", "params": {"docs": 8}})  # fmt: skip
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["id"]
    [(_, (sent_id, token))] = sent(stack.broker, "gpu.learn")
    with db.session(stack.settings.db_url) as s:
        row = s.get(LearningJob, job_id)
        assert row is not None
    assert sent_id == job_id and row.token == jobstore.token_hash(token) != token
    assert token.encode() not in database_bytes(stack.settings)
    claim = {"token": token, "host": "gpu-1", "pid": 1}
    assert httpx.post(f"{stack.url}/worker/learning/{job_id}/claim", json={**claim, "token": row.token},
                      headers=stack.worker).status_code in (409, 422)  # fmt: skip
    assert (
        httpx.post(
            f"{stack.url}/worker/learning/{job_id}/claim", json=claim, headers=stack.worker
        ).status_code
        == 200
    )


def test_the_upgrade_hashes_the_tokens_of_jobs_in_flight(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt")
    path = settings.data_dir / "grove.db"
    path.parent.mkdir(parents=True)
    engine = create_engine(f"sqlite:///{path}")
    old = "job-1-a0-" + "ab" * 16  # a task id, which was its token
    with engine.begin() as conn:
        cfg = alembic_config(f"sqlite:///{path}")
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0015")
        conn.execute(text(
            "INSERT INTO job (id, study_id, node_id, attempt, kind, status, token, extra_runs, outcome, created_at) "
            "VALUES (1, 1, 1, 0, 'gate', 'running', :t, 0, '{}', '2026-12-01 00:00:00')"
        ), {"t": old})  # fmt: skip
        conn.execute(text(
            "INSERT INTO learning_job (id, kind, params, status, token, host, progress, device, artifact, result, "
            "error, created_at) VALUES (1, 'sparse_eval', '{}', 'running', 'learn-token', 'h', 0, '', '', '{}', '', "
            "'2026-12-01 00:00:00')"
        ))  # fmt: skip
    engine.dispose()
    with db.session(settings.db_url) as s:  # migrates to the newest schema
        job, ljob = s.get(Job, 1), s.get(LearningJob, 1)
        assert job is not None and ljob is not None
        assert (job.token, job.task_id) == (hashlib.sha256(old.encode()).hexdigest(), "")
        assert ljob.token == hashlib.sha256(b"learn-token").hexdigest()
    with db.get_engine(settings.db_url).connect() as conn:  # as SQLite does by itself every 1,000 pages
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    assert old.encode() not in database_bytes(settings) and b"learn-token" not in database_bytes(settings)
    # A worker that held the job across the upgrade goes on with the token it was sent.
    assert jobstore.job_of(settings, 1, old) is not None and jobstore.job_of(settings, 1, job.token) is None
    assert learning.held(settings, 1, "learn-token") is not None
