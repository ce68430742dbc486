"""The process side of a box: resource limits, output captures, waiting on it and ending every process of it."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import threading
from functools import lru_cache
from pathlib import Path
from typing import IO

from backend.engine.sandbox.limits import (
    Limits,
)


def _rlimits(limits: Limits) -> list[tuple[int, str, int]]:
    """Return the resource limits of a run as (resource, prlimit name, value), within the hard ones."""
    mib = 1024 * 1024
    wanted = [
        (resource.RLIMIT_CPU, "cpu", limits.cpu_seconds),
        (resource.RLIMIT_AS, "as", limits.memory_mb and limits.memory_mb * mib),
        (resource.RLIMIT_FSIZE, "fsize", limits.file_size_mb and limits.file_size_mb * mib),
        (resource.RLIMIT_NPROC, "nproc", limits.processes),
    ]
    out = [(kind, name, value) for kind, name, value in wanted if value] + [(resource.RLIMIT_CORE, "core", 0)]
    hard = {kind: resource.getrlimit(kind)[1] for kind, _, _ in out}
    return [(k, name, v if hard[k] == resource.RLIM_INFINITY else min(v, hard[k])) for k, name, v in out]


def _limiter(limits: Limits, die_with_parent: bool = True):  # type: ignore[no-untyped-def]
    caps = _rlimits(limits)

    def apply() -> None:
        if die_with_parent:
            with contextlib.suppress(OSError):
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        for kind, _, value in caps:
            resource.setrlimit(kind, (value, value))

    return apply


@lru_cache(maxsize=8)
def _which(program: str) -> str | None:
    return shutil.which(program)


def _prlimit_argv(limits: Limits) -> list[str] | None:
    """Return the command that execs bwrap with the run's limits; None where util-linux lacks it.

    So the child starts without running Python code after the fork (no `preexec_fn`), and a large
    worker process spawns it cheaply. Nothing kills bwrap when Grove's process dies: bwrap killed
    between making the box's first process and letting it go on leaves that process waiting
    forever. The lifeline ends the box instead, and bwrap exits after it.
    """
    prlimit = _which("prlimit")
    if prlimit is None:
        return None
    caps = (f"--{name}={value}:{value}" for _, name, value in _rlimits(limits))
    return [prlimit, *caps, "--"]


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
                    out.flush()  # on disk as it comes: the node page follows a run's output live
                self.total += len(chunk)
                self.tail = (self.tail + chunk)[-self.tail_size :]
            if self.total > self.cap:
                out.write(f"\n[grove: output truncated, {self.total} bytes in all]\n".encode())


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


_running: dict[int, bool] = {}  # process group -> whether it is a box (bwrap)


def kill_all() -> None:
    """End every command this process started, before it exits: unboxed process groups are killed.

    A box is left to end itself: this process's exit closes its lifeline. Killing bwrap while it
    may still be setting the box up would leave the box's first process waiting forever.
    """
    for pgid, boxed in list(_running.items()):
        if not boxed:
            _kill_group(pgid)


def _pidfd(pid: int) -> int | None:
    """Return a descriptor that becomes readable when process `pid` ends; None where there is none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _ended(fd: int, timeout: float) -> bool:
    """Wait up to `timeout` seconds for the process behind pidfd `fd` to end; say whether it did."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, int(timeout * 1000) + 1)))


def _wait(proc: subprocess.Popen[bytes], timeout: float, fd: int | None) -> None:
    """Reap `proc` within `timeout` seconds, woken the moment it exits; raise TimeoutExpired if not."""
    if fd is not None and not _ended(fd, timeout):
        raise subprocess.TimeoutExpired(proc.args, timeout)
    proc.wait(timeout=timeout)


def _end_box(proc: subprocess.Popen[bytes], fd: int | None, info: IO[bytes], grace: float = 2.0) -> None:
    """Reap bubblewrap once the box's lifeline is shut: its watcher ends the box, then bubblewrap exits.

    bubblewrap is not killed while it may be setting the box up: killed then, it would leave the
    box's first process waiting for it forever. A box that outlives its lifeline (its watcher was
    killed from inside) has its first process killed after `grace` seconds, and with it the rest.
    No `--die-with-parent`: bwrap arms that signal before it lets the box's first process go on, so
    a death of Grove's process in between would leave that process waiting forever.
    """
    try:
        _wait(proc, grace, fd)
    except subprocess.TimeoutExpired:
        pass
    finally:  # also when an exception (a worker's time limit) lands in the wait
        if proc.poll() is None:
            _end_first_process(info, grace)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:  # still setting the box up after all this time
                _kill_group(proc.pid)
                proc.wait()


def _end_first_process(info: IO[bytes], timeout: float) -> None:
    """Kill the box's pid 1 (bwrap wrote its id to `info`) if it is still there; wait up to `timeout` for its end.

    Killing it ends every process of its PID namespace, and it ends only after the last of them.
    """
    info.seek(0)
    raw = info.read(4096)
    try:
        pid = int(json.loads(raw or b"{}").get("child-pid", 0))
    except (ValueError, AttributeError):
        return
    try:
        fd = os.pidfd_open(pid) if pid else None
    except OSError:
        return  # gone already
    if fd is None:
        return
    try:
        # The id could only have been reused by now if the box's pid 1 was already gone (ids come
        # round only after the whole range); a reused one would hardly be a namespace's pid 1.
        status = Path(f"/proc/{pid}/status").read_text()
        nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
        if len(nspid) >= 2 and nspid[-1] == "1":
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        _ended(fd, timeout)  # readable once it, and so its whole namespace, is gone
    except OSError:
        pass
    finally:
        os.close(fd)
