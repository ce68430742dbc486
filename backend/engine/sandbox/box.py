"""One run in a box, as named steps over its plan; and the check that this machine can box at all."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import IO

from backend.engine.sandbox import seccomp
from backend.engine.sandbox.disk import (
    MAX_DEPTH,
    TOO_DEEP,
    UNSHARE_BYTES,
    _chown_tree,
    _read_regular,
    _reclaim,
    usage,
)
from backend.engine.sandbox.limits import (
    OUT,
    Isolation,
    Limits,
    Result,
    SandboxUnavailable,
    scrubbed_env,
)
from backend.engine.sandbox.mounts import WRAPPER_PROCESSES, _bwrap_argv
from backend.engine.sandbox.process import (
    _Capture,
    _end_box,
    _end_first_process,
    _kill_group,
    _limiter,
    _pidfd,
    _prlimit_argv,
    _running,
    _wait,
)
from backend.engine.sandbox.uids import _lease_uid

FIX = (
    "install bubblewrap (apt install bubblewrap) and allow unprivileged user namespaces "
    "(sysctl kernel.unprivileged_userns_clone=1, and on Ubuntu "
    "kernel.apparmor_restrict_unprivileged_userns=0; in Docker run with --security-opt "
    "seccomp=unconfined or a profile that allows clone/unshare), or, for trusted code on your own "
    "machine only, set GROVE_SANDBOX=none"
)


@lru_cache(maxsize=8)
def _probe(iso: Isolation) -> str:
    if not shutil.which(iso.bwrap):
        return f"bubblewrap ({iso.bwrap!r}) is not installed"
    with tempfile.TemporaryDirectory() as tmp:
        res = run(
            ["true"], cwd=Path(tmp), output_dir=Path(tmp) / "o", isolation=iso, limits=Limits(timeout=60)
        )
    if res.ok:
        return ""
    return f"bubblewrap cannot create namespaces here: {(res.stderr_tail or res.stdout_tail).strip()[-500:]}"


def warm(iso: Isolation) -> None:
    """Test now whether boxes can be created, keeping only a success (a failure is tested again)."""
    if iso.boxed and _probe(iso):
        _probe.cache_clear()


def check(iso: Isolation) -> None:
    """Raise SandboxUnavailable, saying how to fix it, unless boxes can be created here."""
    if not iso.boxed:
        return
    problem = _probe(iso)
    if problem:
        raise SandboxUnavailable(f"Grove cannot sandbox untrusted code: {problem}. To fix it, {FIX}.")


UNSANDBOXED_WARNING = (
    "WARNING: GROVE_SANDBOX=none: evaluations and executor commands run unsandboxed, as Grove's own "
    "user, with access to its data, keys and network. Use this only for code you trust."
)


def run(
    command: str | list[str],
    *,
    cwd: Path,
    output_dir: Path,
    name: str = "run",
    limits: Limits = Limits(),
    isolation: Isolation = Isolation(),
    env: Mapping[str, str] | None = None,
    passthrough: tuple[str, ...] = (),
    collect: tuple[str, ...] = (),
    readonly: tuple[str, ...] = (),
    disk_base: int | None = None,
    output_cap: int = 5_000_000,
    tail_bytes: int = 4_000,
) -> Result:
    """Run a command on the tree `cwd` in a box and return its captured result.

    `env` values may name `{out}`, the exchange folder as the command sees it; the files named
    in `collect` are read back from it (regular files only) into `Result.exchange`. The tree's
    files named in `readonly` (relative paths) cannot be changed by the command. `disk_mb` counts
    from `disk_base` bytes (the tree's size when a series of runs began) if given, else from now.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    exchange = Path(tempfile.mkdtemp(prefix="grove-out-"))
    try:
        with _lease_uid(isolation) as uid:
            plan = Plan(
                text=command if isinstance(command, str) else subprocess.list2cmdline(command),
                inner=["/bin/sh", "-c", command] if isinstance(command, str) else list(command),
                tree=cwd.resolve(), exchange=exchange, uid=uid,
                out_path=output_dir / f"{name}.stdout", err_path=output_dir / f"{name}.stderr",
                limits=limits, iso=isolation, env=dict(env or {}), passthrough=passthrough, collect=collect,
                readonly=readonly, disk_base=disk_base, output_cap=output_cap, tail_bytes=tail_bytes,
            )  # fmt: skip
            try:
                return _run(plan)
            finally:
                # The box is gone (its PID namespace with it): nothing races this walk.
                owner = (os.getuid(), os.getgid()) if uid is not None else None
                budget = limits.disk_mb * 1024 * 1024 if limits.disk_mb else UNSHARE_BYTES
                _reclaim(plan.tree, owner, budget)
                for folder in isolation.writable():
                    _reclaim(folder, owner, budget)
    finally:
        shutil.rmtree(exchange, ignore_errors=True)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What one run is: the command, the folders it sees, its limits and its environment."""

    text: str  # the command as a receipt records it
    inner: list[str]  # the argv run inside the box
    tree: Path
    exchange: Path  # the exchange folder (`{out}`), on this side
    uid: int | None  # the leased uid the box runs as (None: this process's own)
    out_path: Path
    err_path: Path
    limits: Limits
    iso: Isolation
    env: dict[str, str]
    passthrough: tuple[str, ...]
    collect: tuple[str, ...]
    readonly: tuple[str, ...]
    disk_base: int | None
    output_cap: int
    tail_bytes: int


@dataclass
class Running:
    """What a run holds while it runs and is ended: its process, captures and what stopped it."""

    ours: socket.socket  # this side of the box's lifeline, and the wrapper's way back
    info: IO[bytes]  # where bwrap writes the box's first process id
    proc: subprocess.Popen[bytes] | None = None
    caps: list[_Capture] = field(default_factory=list)
    pidfd: int | None = None
    started: float = 0.0
    watched: tuple[Path, ...] = ()
    baseline: int = 0
    timed_out: bool = False
    disk_exceeded: bool = False
    too_deep: bool = False
    status: list[str] = field(default_factory=list)  # the wrapper's report: grove-exit CODE PROCESSES


def _run(plan: Plan) -> Result:
    env = _environment(plan)
    _hand_over(plan)
    # The box's lifeline, and the way back for its wrapper's report: this process holds the only
    # copy of its end until the end of the run (its stdin is the box's end, in bwrap and the wrapper).
    ours, theirs = socket.socketpair()
    # bwrap writes the box's first process id here: a file in memory, not a pipe, so that the write
    # cannot fail (and leave the box's first process waiting for bwrap forever) once Grove's process
    # is gone, nor wait on a disk that other boxes fill.
    run = Running(ours=ours, info=os.fdopen(os.memfd_create("grove-info"), "w+b"))
    # One guarded block from before the box starts to its end: wherever an exception lands (a
    # worker's time limit raising from a signal handler), the box is ended and every descriptor closed.
    try:
        _start(plan, run, theirs, env)
        _watch(plan, run)
    finally:
        _end(plan, run)
    return _result(plan, run)


def _environment(plan: Plan) -> dict[str, str]:
    """Return the run's environment: scrubbed, with the exchange folder and the environment's own."""
    iso, boxed = plan.iso, plan.iso.boxed
    out_seen = OUT if boxed else str(plan.exchange)
    extra = {k: v.replace("{out}", out_seen) for k, v in plan.env.items()}
    if boxed:
        extra = {"HOME": "/tmp", "TMPDIR": "/tmp", **extra}
    if iso.env_dir:
        seen = iso.env_path()
        extra = {"GROVE_ENV": seen, "VIRTUAL_ENV": seen, **extra}
    full = scrubbed_env(extra, (*plan.passthrough, *iso.passthrough))
    if iso.env_dir:
        full["PATH"] = f"{iso.env_path()}/bin{os.pathsep}{full['PATH']}"
    return full


def _hand_over(plan: Plan) -> None:
    """Give the run's leased uid the tree, the exchange folder and the writable folders."""
    if plan.uid is None:
        return
    _chown_tree(plan.tree, plan.uid, plan.uid)
    os.chown(plan.exchange, plan.uid, plan.uid)
    for folder in plan.iso.writable():
        _chown_tree(folder, plan.uid, plan.uid)


def _start(plan: Plan, run: Running, theirs: socket.socket, env: dict[str, str]) -> None:
    """Start the box (or, unboxed, the command) and the captures of its output."""
    iso, limits, boxed = plan.iso, plan.limits, plan.iso.boxed
    info_fd = run.info.fileno()
    keep: list[int] = [info_fd] if boxed else []
    try:
        if boxed:
            program = seccomp.program()
            seccomp_fd = None
            if program is not None:
                seccomp_fd, filter_w = os.pipe()
                os.write(filter_w, program)
                os.close(filter_w)
                keep.append(seccomp_fd)
            argv = _bwrap_argv(iso, limits, plan.tree, plan.exchange, plan.inner, plan.uid, plan.readonly,
                               seccomp_fd, info_fd)  # fmt: skip
            stdin: int = theirs.fileno()
            if limits.processes:
                limits = replace(limits, processes=limits.processes + WRAPPER_PROCESSES)
            prlimit = _prlimit_argv(limits)
            argv = [*prlimit, *argv] if prlimit is not None else argv
        else:
            argv, stdin, prlimit = plan.inner, subprocess.DEVNULL, None
        # A writable environment folder (its setup step) and a scratch folder count like the tree.
        run.watched = (plan.tree, plan.exchange, *iso.writable())
        run.baseline = (
            usage(*run.watched) if plan.disk_base is None and limits.disk_mb else plan.disk_base or 0
        )
        run.started = time.monotonic()
        run.proc = subprocess.Popen(
            argv,
            cwd=plan.tree if not boxed else "/",
            env=env,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_limiter(limits, die_with_parent=not boxed) if prlimit is None else None,
            pass_fds=tuple(keep),
        )
    finally:
        theirs.close()
        for fd in keep:
            if fd != info_fd:  # read at the end
                os.close(fd)
    _running[run.proc.pid] = boxed
    run.caps = [
        _Capture(run.proc.stdout, plan.out_path, plan.output_cap, plan.tail_bytes),
        _Capture(run.proc.stderr, plan.err_path, plan.output_cap, plan.tail_bytes),
    ]
    for c in run.caps:
        c.start()


def _watch(plan: Plan, run: Running) -> None:
    """Wait for the run to end, stopping it at its time limit or once it writes past its disk limit."""
    assert run.proc is not None
    limits = plan.limits
    deadline = run.started + limits.timeout
    run.pidfd = _pidfd(run.proc.pid)
    while True:
        try:
            _wait(run.proc, max(0.0, min(0.5, deadline - time.monotonic())), run.pidfd)
            return
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                run.timed_out = True
                return
            if limits.disk_mb and (used := usage(*run.watched)) - run.baseline > limits.disk_mb * 1024 * 1024:
                run.disk_exceeded, run.too_deep = True, used >= TOO_DEEP
                return


def _end(plan: Plan, run: Running) -> None:
    """End everything of the run and close every descriptor; read the wrapper's report if it came."""
    # Nothing outlives the run. A box ends from inside: shutting its lifeline has its watcher kill
    # every process of it, then its pid 1 and bwrap exit. Unboxed, the process group is killed.
    proc, ours = run.proc, run.ours
    with contextlib.suppress(OSError):
        ours.shutdown(socket.SHUT_WR)
    if proc is not None:
        if plan.iso.boxed:
            _end_box(proc, run.pidfd, run.info)
        else:
            _kill_group(proc.pid)
            proc.wait()
        _running.pop(proc.pid, None)
    if run.pidfd is not None:
        os.close(run.pidfd)
    with run.info:
        # Left after bwrap exited only when the command killed its wrapper and watcher both.
        _end_first_process(run.info, 10.0)
    for c in run.caps:
        if c.ident is not None:
            c.join(timeout=10)
    reading = [c.stream for c in run.caps if c.is_alive()]
    for stream in (proc.stdout, proc.stderr) if proc is not None else ():
        if stream is not None and all(stream is not r for r in reading):
            stream.close()
    ours.setblocking(False)  # a process stuck in the kernel may still hold the box's end
    try:
        raw = ours.recv(200)  # the wrapper's one short write, if it made it
    except (BlockingIOError, ConnectionError):
        raw = b""
    finally:
        ours.close()
    run.status = raw.decode("ascii", "replace").split()


def _notes(plan: Plan, run: Running, strays: int | None, reported: bool) -> list[str]:
    """Return what the sandbox tells of a run beside its own output (strays killed, a limit that stopped it)."""
    notes = []
    if strays:
        notes.append(
            f"{strays} process(es) were still running when the command ended; the sandbox killed them"
        )
    elif plan.iso.boxed and not reported and not run.timed_out and not run.disk_exceeded:
        notes.append("the sandbox's wrapper was killed, so stray processes were not counted; all were killed")
    if run.too_deep:
        notes.append(
            f"the command made folders Grove cannot count (nested more than {MAX_DEPTH} levels deep, "
            "or closed to their owner); it was stopped"
        )
    elif run.disk_exceeded:
        notes.append(f"the command wrote more than {plan.limits.disk_mb} MB; it was stopped")
    return notes


def _result(plan: Plan, run: Running) -> Result:
    """Return the run's result: its exit, output tails, the sandbox's notes and the collected files."""
    assert run.proc is not None
    status, caps = run.status, run.caps
    reported = len(status) == 3 and status[0] == "grove-exit"
    strays = int(status[2]) - 2 if reported else None
    code = run.proc.returncode
    if reported and 128 < code <= 128 + 64:
        code = 128 - code  # the box's shell reports a signal as 128+n; report it as -n like Popen
    stderr_tail = caps[1].tail.decode("utf-8", "replace")
    notes = _notes(plan, run, strays, reported)
    if notes:
        note = "".join(f"\n[grove: {n}]" for n in notes) + "\n"
        with open(plan.err_path, "a") as fh:
            fh.write(note)
        stderr_tail = (stderr_tail + note)[-plan.tail_bytes :]
    got = {}
    for fname in plan.collect:
        data = _read_regular(plan.exchange / fname)
        if data is not None:
            got[fname] = data
    return Result(
        command=plan.text,
        exit_code=None if run.timed_out else code,
        duration=time.monotonic() - run.started,
        timed_out=run.timed_out,
        stdout_path=plan.out_path,
        stderr_path=plan.err_path,
        stdout_tail=caps[0].tail.decode("utf-8", "replace"),
        stderr_tail=stderr_tail,
        truncated=any(c.total > plan.output_cap for c in caps),
        signal=-code if code is not None and code < 0 else None,
        stdout_bytes=caps[0].total,
        strays=strays,
        disk_exceeded=run.disk_exceeded,
        exchange=got,
    )
