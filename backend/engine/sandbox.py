"""Run commands in a sandbox: own process group, limits, scrubbed environment, capped output.

Every evaluation and every command an executor runs goes through `run`.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SAFE_ENV = (
    "PATH", "LANG", "LANGUAGE", "TERM", "TZ", "TMPDIR", "VIRTUAL_ENV", "PYTHONHASHSEED",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE",
    "OPENBLAS_L2_SIZE", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "LD_LIBRARY_PATH",
)  # fmt: skip
SECRET = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH)", re.IGNORECASE)


@dataclass(frozen=True)
class Limits:
    timeout: float = 600.0
    cpu_seconds: int | None = None
    memory_mb: int | None = 4096
    file_size_mb: int | None = 1024
    processes: int | None = 512


@dataclass
class Result:
    command: str
    exit_code: int | None
    duration: float
    timed_out: bool
    stdout_path: Path
    stderr_path: Path
    stdout_tail: str
    stderr_tail: str
    truncated: bool = False
    signal: int | None = None
    stdout_bytes: int = field(default=0)

    @property
    def ok(self) -> bool:
        """Return whether the command exited 0 within its time."""
        return self.exit_code == 0 and not self.timed_out


def scrubbed_env(extra: Mapping[str, str] | None = None, passthrough: tuple[str, ...] = ()) -> dict[str, str]:
    """Return an environment of safe variables only: no API keys, tokens or Grove secrets."""
    env = {k: os.environ[k] for k in (*SAFE_ENV, *passthrough) if k in os.environ}
    env.update({k: v for k, v in os.environ.items() if k.startswith("LC_")})
    env = {k: v for k, v in env.items() if not SECRET.search(k) and not k.startswith("GROVE_")}
    # `python` in an evaluation command means the interpreter Grove runs under, venv included.
    bindir = str(Path(sys.executable).parent)
    path = env.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(os.pathsep)
    env["PATH"] = os.pathsep.join([bindir, *(p for p in path if p != bindir)])
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra or {})
    return env


def _limiter(limits: Limits):  # type: ignore[no-untyped-def]
    def apply() -> None:
        def cap(kind: int, value: int) -> None:
            _, hard = resource.getrlimit(kind)
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            resource.setrlimit(kind, (value, value))

        if limits.cpu_seconds:
            cap(resource.RLIMIT_CPU, limits.cpu_seconds)
        if limits.memory_mb:
            cap(resource.RLIMIT_AS, limits.memory_mb * 1024 * 1024)
        if limits.file_size_mb:
            cap(resource.RLIMIT_FSIZE, limits.file_size_mb * 1024 * 1024)
        if limits.processes:
            cap(resource.RLIMIT_NPROC, limits.processes)
        cap(resource.RLIMIT_CORE, 0)

    return apply


class _Capture(threading.Thread):
    def __init__(self, stream, path: Path, cap: int, tail: int) -> None:  # type: ignore[no-untyped-def]
        super().__init__(daemon=True)
        self.stream, self.path, self.cap, self.tail_size = stream, path, cap, tail
        self.total = 0
        self.tail = b""

    def run(self) -> None:
        with open(self.path, "wb") as out:
            while chunk := self.stream.read1(65536):
                if self.total < self.cap:
                    out.write(chunk[: self.cap - self.total])
                self.total += len(chunk)
                self.tail = (self.tail + chunk)[-self.tail_size :]
            if self.total > self.cap:
                out.write(f"\n[grove: output truncated, {self.total} bytes in all]\n".encode())


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


_running: set[int] = set()


def kill_all() -> None:
    """Kill the process groups of every sandboxed command this process started."""
    for pgid in list(_running):
        _kill_group(pgid)


def run(
    command: str | list[str],
    *,
    cwd: Path,
    output_dir: Path,
    name: str = "run",
    limits: Limits = Limits(),
    env: Mapping[str, str] | None = None,
    passthrough: tuple[str, ...] = (),
    output_cap: int = 5_000_000,
    tail_bytes: int = 4_000,
) -> Result:
    """Run a shell command inside `cwd` under the sandbox and return its captured result."""
    output_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = output_dir / f"{name}.stdout", output_dir / f"{name}.stderr"
    text = command if isinstance(command, str) else subprocess.list2cmdline(command)
    argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
    started = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=scrubbed_env(env, passthrough),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_limiter(limits),
    )
    _running.add(proc.pid)
    caps = [
        _Capture(proc.stdout, out_path, output_cap, tail_bytes),
        _Capture(proc.stderr, err_path, output_cap, tail_bytes),
    ]
    for c in caps:
        c.start()
    timed_out = False
    try:
        proc.wait(timeout=limits.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        # The whole group goes, so grandchildren cannot outlive the command.
        _kill_group(proc.pid)
        proc.wait()
        _running.discard(proc.pid)
    for c in caps:
        c.join(timeout=10)
    code = proc.returncode
    return Result(
        command=text,
        exit_code=None if timed_out else code,
        duration=time.monotonic() - started,
        timed_out=timed_out,
        stdout_path=out_path,
        stderr_path=err_path,
        stdout_tail=caps[0].tail.decode("utf-8", "replace"),
        stderr_tail=caps[1].tail.decode("utf-8", "replace"),
        truncated=any(c.total > output_cap for c in caps),
        signal=-code if code is not None and code < 0 else None,
        stdout_bytes=caps[0].total,
    )
