"""Real services for the tests: Grove's API on a thread, Celery workers, databases."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import uvicorn

from backend.core.config import PROJECT_ROOT, Settings
from tests.support.waiting import wait_for


class ThreadServer(uvicorn.Server):
    def install_signal_handlers(self) -> None:
        """Leave signals to pytest."""


def serve(app: object, port: int) -> tuple[ThreadServer, threading.Thread]:
    """Serve an ASGI app on loopback in a thread; return once it accepts connections."""
    server = ThreadServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=30)
    return server, thread


class Service:
    """Celery workers over a shared data directory, for service-level tests."""

    def __init__(self, settings: Settings, env: dict[str, str]) -> None:
        self.settings, self.env = settings, env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.args: dict[str, tuple[str, int, bool]] = {}
        self.logs = settings.data_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def start_worker(self, name: str, queues: str, concurrency: int, beat: bool = False) -> None:
        self.args[name] = (queues, concurrency, beat)
        cmd = [sys.executable, "-m", "celery", "-A", "backend.worker.celery_app", "worker", "-Q", queues,
               "-c", str(concurrency), "-n", f"{name}@%h", "--without-gossip", "--without-mingle",
               "--loglevel", "INFO", "--pool", "prefork"]  # fmt: skip
        if beat:
            cmd += ["-B", "--schedule", str(self.settings.data_dir / "beat-schedule")]
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115
        start = (self.logs / f"{name}.log").stat().st_size if (self.logs / f"{name}.log").exists() else 0
        self.procs[name] = subprocess.Popen(
            cmd, env=self.env, stdout=log, stderr=log, cwd=PROJECT_ROOT, start_new_session=True
        )
        wait_for(lambda: b"ready." in (self.logs / f"{name}.log").read_bytes()[start:], timeout=60)

    def stop_worker(self, name: str, sig: int = 15) -> None:
        """Stop a worker; with SIGKILL its whole process group dies at once, pool children included."""
        proc = self.procs.pop(name)
        if sig == 9:
            os.killpg(proc.pid, 9)
        else:
            proc.send_signal(sig)
        proc.wait(timeout=60)

    def revive(self) -> list[str]:
        """Restart workers that exited by themselves, as a deployment's supervisor would; return them."""
        dead = [name for name, proc in self.procs.items() if proc.poll() is not None]
        for name in dead:
            self.procs.pop(name)
            self.start_worker(name, *self.args[name])
        return dead

    def stop(self) -> None:
        for name in list(self.procs):
            self.stop_worker(name)


def spawn_up(
    tmp: Path, port: int, board: int, extra_env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start `grove up` over a data folder of its own (its own Redis); return it and its log once it is up."""
    env = {**os.environ, "GROVE_DATA_DIR": str(tmp / "data"), "GROVE_WORKTREES_DIR": str(tmp / "wt")}
    env.update(extra_env or {})
    env.pop("GROVE_REDIS_URL", None)
    env.pop("GROVE_DATABASE_URL", None)
    out = tmp / "up.log"
    with open(out, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "backend.cli.main", "up", "--port", str(port), "--dashboard-port", str(board)],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=PROJECT_ROOT,
        )  # fmt: skip
    wait_for(lambda: b"Press Ctrl-C" in out.read_bytes() or proc.poll() is not None, timeout=120)
    if b"Press Ctrl-C" not in out.read_bytes():
        proc.kill()
        raise AssertionError(f"grove up did not come up:\n{out.read_text()}")
    return proc, out


def sqlite_service(root: Path, redis_url: str, db_number: int) -> Service:
    """Return a Service over a fresh SQLite data folder and a Redis database of its own.

    Its own Redis database keeps other tests' workers from taking its tasks.
    """
    broker = redis_url.rsplit("/", 1)[0] + f"/{db_number}"
    settings = Settings(data_dir=root / "data", worktrees_dir=root / "worktrees", redis_url=broker)
    settings.ensure_dirs()
    env = {
        **os.environ,
        "GROVE_DATA_DIR": str(settings.data_dir),
        "GROVE_WORKTREES_DIR": str(settings.worktrees_dir),
        "GROVE_REDIS_URL": broker,
    }
    env.pop("GROVE_DATABASE_URL", None)
    return Service(settings, env)


PG_ADMIN = os.environ.get("GROVE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")


def postgres_database(name: str) -> str:
    """Create an empty PostgreSQL database and return its SQLAlchemy URL."""
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    return f"{base}/{name}"


def drop_postgres_database(name: str) -> None:
    """Drop a test database."""
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
