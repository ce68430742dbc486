"""Grove's data folder is its user's alone (0700), and so is the database in it (0600)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backend.api.main import create_app
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.security import create_token
from tests.support.services import serve
from tests.support.waiting import free_port, wait_for


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def assert_private(data: Path) -> None:
    assert mode(data) == 0o700, oct(mode(data))
    files = [data / n for n in ("grove.db", "grove.db-wal", "grove.db-shm") if (data / n).exists()]
    assert data / "grove.db" in files
    for f in files:
        assert mode(f) == 0o600, (f.name, oct(mode(f)))


@pytest.fixture
def umask() -> Iterator[None]:
    """The usual umask (group and others may read), so that the modes are Grove's doing."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def grove(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GROVE_DATA_DIR": str(data)}
    env.pop("GROVE_DATABASE_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "backend.cli.main", *args], cwd=PROJECT_ROOT, env=env, capture_output=True,
        text=True, timeout=120, umask=0o022,
    )  # fmt: skip


def test_grove_migrate_makes_a_private_data_folder_and_database(tmp_path: Path) -> None:
    data = tmp_path / "fresh" / "data"
    done = grove(data, "migrate")
    assert done.returncode == 0, done.stderr
    assert_private(data)


def test_an_older_data_folder_and_database_are_made_private(tmp_path: Path, redis_url: str) -> None:
    data = tmp_path / "data"
    assert grove(data, "migrate").returncode == 0
    os.chmod(data, 0o755)
    os.chmod(data / "grove.db", 0o644)
    done = grove(data, "migrate")  # the database is taken back wherever it is opened
    assert done.returncode == 0, done.stderr
    assert mode(data / "grove.db") == 0o600 and mode(data) == 0o755
    create_app(Settings(data_dir=data, worktrees_dir=tmp_path / "wt", redis_url=redis_url))  # and the folder
    assert_private(data)


def test_the_api_makes_a_private_data_folder_and_database(
    tmp_path: Path, redis_url: str, umask: None
) -> None:
    settings = Settings(data_dir=tmp_path / "api-data", worktrees_dir=tmp_path / "wt", redis_url=redis_url)
    port = free_port()
    server, thread = serve(create_app(settings), port)
    try:
        headers = {"Authorization": f"Bearer {create_token(settings, ['viewer'], 'v')}"}
        resp = httpx.get(f"http://127.0.0.1:{port}/api/v1/studies", headers=headers, timeout=30)
        assert resp.status_code == 200
        assert_private(settings.data_dir)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_worker_makes_a_private_data_folder_and_database(tmp_path: Path, redis_url: str) -> None:
    data = tmp_path / "worker-data"
    env = {**os.environ, "GROVE_DATA_DIR": str(data), "GROVE_WORKTREES_DIR": str(tmp_path / "wt"),
           "GROVE_REDIS_URL": redis_url.rsplit("/", 1)[0] + "/4"}  # fmt: skip
    env.pop("GROVE_DATABASE_URL", None)
    log = (tmp_path / "worker.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend.cli.main", "worker", "--queues", "cpu", "--concurrency", "1"],
        cwd=PROJECT_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, umask=0o022, start_new_session=True,
    )  # fmt: skip
    try:
        # Its pool process opens the database before its first task.
        wait_for(lambda: (data / "grove.db").exists() or proc.poll() is not None, timeout=120)
        assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
        assert_private(data)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
        log.close()
