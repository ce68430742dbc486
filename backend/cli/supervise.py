"""Keep a worker process running: restart it with backoff when it dies, stop it when told to.

A Celery worker can exit for good on a broker error it does not recover from (a Redis restart
under it, seen as `Unrecoverable error: AttributeError(...)` inside kombu). `grove worker` runs it
under `supervise`, so the capacity comes back by itself, on a bare machine as under systemd or
Kubernetes: a non-zero exit is logged and the worker is started again after 1, 2, 4 ... seconds
(at most `MAX_BACKOFF`; back to 1 after a run of `STEADY` seconds). SIGTERM and SIGINT go to the
worker, which finishes its running tasks (Celery's warm shutdown), and then the supervisor ends
with the worker's exit status; so does a worker that exits 0 by itself.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType

MAX_BACKOFF = 10.0  # seconds between restarts at most
STEADY = 60.0  # a run this long resets the backoff


def supervise(cmd: Sequence[str], name: str, say: Callable[[str], None] | None = None) -> int:
    """Run `cmd` until it exits 0 or a stop signal comes; restart it with backoff otherwise."""
    tell = say or (lambda text: print(f"grove worker: {text}", file=sys.stderr, flush=True))
    stopping: list[int] = []
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, frame: FrameType | None) -> None:
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    backoff = 1.0
    while True:
        started = time.monotonic()
        child = subprocess.Popen(list(cmd))
        tell(f"{name} started (pid {child.pid})")
        code = child.wait()
        if stopping or code == 0:
            return code
        ran = time.monotonic() - started
        if ran >= STEADY:
            backoff = 1.0
        tell(f"{name} exited with status {code} after {ran:.0f} s; starting it again in {backoff:g} s")
        deadline = time.monotonic() + backoff
        while not stopping and time.monotonic() < deadline:
            time.sleep(0.1)
        if stopping:
            return code
        backoff = min(backoff * 2, MAX_BACKOFF)
