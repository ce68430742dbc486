"""Shared fixtures: isolated Grove settings, a real redis-server, databases and workers (helpers: tests/support)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.core.config import PROJECT_ROOT, Settings
from tests.support.repos import make_repo, tiny_files
from tests.support.services import Service, drop_postgres_database, postgres_database
from tests.support.waiting import free_port, wait_for

# The API accepts local repositories only under configured roots: the tests' own temporary folders.
os.environ.setdefault("GROVE_REPO_ROOTS", f"{tempfile.gettempdir()},{PROJECT_ROOT}")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # tests never fetch litellm's price list


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """Return settings that keep every Grove file under the test's temporary folder."""
    s = Settings(data_dir=tmp_path / "grove-data", worktrees_dir=tmp_path / "worktrees")
    s.ensure_dirs()
    return s


@pytest.fixture
def tiny_repo(tmp_path: Path) -> Path:
    """Return a git repository holding the tiny study."""
    return make_repo(tmp_path / "tiny", tiny_files())


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Start a real redis-server on a free loopback port for the session."""
    import redis

    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--maxmemory-policy", "noeviction"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(port=port)

    def up() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    wait_for(up, timeout=20)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def db_backend(request: pytest.FixtureRequest) -> str:
    """Run the tests that use it against SQLite and against PostgreSQL."""
    return str(request.param)


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory, redis_url: str, db_backend: str) -> Iterator[Service]:
    """Start a coordinator worker (with the reconciler's beat) and a cpu worker with two slots."""
    root = tmp_path_factory.mktemp(f"service-{db_backend}")
    dbname = f"grove_test_{os.getpid()}"
    database_url = postgres_database(dbname) if db_backend == "postgres" else None
    settings = Settings(
        data_dir=root / "data",
        worktrees_dir=root / "worktrees",
        redis_url=redis_url,
        database_url=database_url,
    )
    settings.ensure_dirs()
    import redis as redis_lib

    redis_lib.Redis.from_url(redis_url).flushdb()
    env = {
        **os.environ,
        "GROVE_DATA_DIR": str(settings.data_dir),
        "GROVE_WORKTREES_DIR": str(settings.worktrees_dir),
        "GROVE_REDIS_URL": redis_url,
    }
    if database_url:
        env["GROVE_DATABASE_URL"] = database_url
    svc = Service(settings, env)
    svc.start_worker("coord", "coordinator", 2, beat=True)
    svc.start_worker("cpu", "cpu,sealed", 2)
    yield svc
    svc.stop()
    if database_url:
        from backend.core.db import get_engine

        get_engine(settings.db_url).dispose()
        drop_postgres_database(dbname)
