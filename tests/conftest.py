"""Shared fixtures: real git repositories, isolated Grove settings, deadline waits."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import uvicorn

from backend.core.config import PROJECT_ROOT, Settings

# The API accepts local repositories only under configured roots: the tests' own temporary folders.
os.environ.setdefault("GROVE_REPO_ROOTS", f"{tempfile.gettempdir()},{PROJECT_ROOT}")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # tests never fetch litellm's price list

TINY_EVAL = """\
import json, os, sys, time, tomllib
cfg = tomllib.load(open("config.toml", "rb"))
x = cfg["knob"]["x"]
seed = int(os.environ.get("GROVE_SEED", "0"))
time.sleep(float(cfg["knob"].get("sleep", 0)))
if sys.argv[1] == "dev":
    score = 10 - (x - 3) ** 2 + 0.01 * seed
else:
    offset = float(open("data/test/offset.txt").read())
    score = offset - (x - 3) ** 2 + 0.01 * seed
print("some log line")
print(json.dumps({"score": score, "size": x}))
"""

TINY_SPEC = """\
[study]
name = "{name}"
goal = "Push the score of the tiny knob up"

[objective]
metric = "score"
direction = "maximize"

[evaluate]
dev = "python eval.py dev"
test = "python eval.py test"
timeout = 60
repeats = 2

[files]
editable = ["config.toml"]
protected = ["eval.py"]
sealed = ["data/test/**"]

[[constraints]]
name = "small"
metric = "size"
max = {max_size}

[search]
"config.toml:knob.x" = {{ values = [0, 1, 2, 3, 4, 5] }}

[budget]
experiments = {experiments}
parallel = 2

[gate]
mode = "{mode}"
margin = {margin}
test_repeats = 2
max_test_runs = {max_test_runs}

[plateau]
warn = 3
change = 5
stop = {plateau_stop}

[policy]
kind = "search"
seed = 0
children = 2
"""


def git(*args: str, cwd: Path) -> str:
    """Run git in a test repository."""
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def make_repo(path: Path, files: dict[str, str]) -> Path:
    """Create a git repository with the given files committed on `main`."""
    path.mkdir(parents=True, exist_ok=True)
    git("init", "-q", "-b", "main", cwd=path)
    for rel, text in files.items():
        f = path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(text))
    git("add", "-A", cwd=path)
    git("commit", "-q", "-m", "init", cwd=path)
    return path


def tiny_files(name: str = "tiny", **kw: object) -> dict[str, str]:
    """Return the files of the tiny study repository."""
    params = {
        "name": name,
        "max_size": 4,
        "experiments": 6,
        "mode": "auto",
        "margin": 0.5,
        "max_test_runs": 10,
        "plateau_stop": 8,
    }
    params.update(kw)
    sleep = params.pop("sleep", 0)
    values = params.pop("values", None)  # the knob's values, else 0 to 5
    spec = TINY_SPEC.format(**params)
    if values is not None:
        spec = spec.replace("values = [0, 1, 2, 3, 4, 5]", f"values = {values}")
    return {
        "eval.py": TINY_EVAL,
        "config.toml": f"[knob]\nx = 0\nsleep = {sleep}\n",
        "data/test/offset.txt": "777.125\n",
        "grove.toml": spec,
    }


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


def wait_for(cond: Callable[[], object], timeout: float = 60.0, every: float = 0.1) -> object:
    """Poll `cond` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"condition not met within {timeout}s")


def free_port() -> int:
    """Return a free TCP port on loopback."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
