"""Run untrusted commands in a box: Linux namespaces through bubblewrap, limits, capped output.

Every evaluation and every command an executor runs goes through `run`. In the box a command
sees its tree at `/grove/tree` (read-write, `.git` masked), an exchange folder at `/grove/out`,
the system and Python installs read-only, a private size-capped `/tmp`, a fresh `/proc` of its
own PID namespace, no network unless asked for, and nothing else: not Grove's data, clones,
other trees, home directory or processes. When Grove runs as root the box runs as an
unprivileged uid leased for the run, so that the process limit holds. See docs/security.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import glob
import os
import random
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal

from backend.engine import seccomp

SAFE_ENV = (
    "PATH", "LANG", "LANGUAGE", "TERM", "TZ", "VIRTUAL_ENV", "PYTHONHASHSEED",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE",
    "OPENBLAS_L2_SIZE", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "LD_LIBRARY_PATH",
)  # fmt: skip
SECRET = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH)", re.IGNORECASE)
TREE, OUT = "/grove/tree", "/grove/out"
# What a box sees of /etc: enough for the dynamic linker, locales, TLS roots and user names.
ETC = (
    "alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "ssl", "ca-certificates",
    "passwd", "group", "nsswitch.conf", "hosts", "mime.types", "fonts", "timezone", "os-release",
)  # fmt: skip
# Runs as pid 2 of the box: the command gets /dev/null as stdin; fd 0 is Grove's status pipe.
# Counting /proc after the command tells how many processes it left behind (pid 1 and 2 are ours).
WRAPPER = (
    '("$@" </dev/null); rc=$?; n=0; for p in /proc/[0-9]*; do n=$((n+1)); done; '
    'echo "grove-exit $rc $n" >&0; exit $rc'
)
FIX = (
    "install bubblewrap (apt install bubblewrap) and allow unprivileged user namespaces "
    "(sysctl kernel.unprivileged_userns_clone=1, and on Ubuntu "
    "kernel.apparmor_restrict_unprivileged_userns=0; in Docker run with --security-opt "
    "seccomp=unconfined or a profile that allows clone/unshare), or, for trusted code on your own "
    "machine only, set GROVE_SANDBOX=none"
)


class SandboxUnavailable(RuntimeError):
    """This machine cannot create the namespaces the sandbox needs."""


@dataclass(frozen=True)
class Limits:
    timeout: float = 600.0
    cpu_seconds: int | None = None
    memory_mb: int | None = 4096
    file_size_mb: int | None = 1024
    processes: int | None = 512
    disk_mb: int | None = 2048  # bytes the command may add to its tree and exchange folder
    tmp_mb: int = 512  # size of the private /tmp
    network: bool = False


@dataclass(frozen=True)
class Isolation:
    """How commands are boxed on this machine (from Grove's settings, never from a spec)."""

    mode: Literal["bwrap", "none"] = "bwrap"
    bwrap: str = "bwrap"
    binds: tuple[str, ...] = ()  # extra read-only paths (a toolchain outside /usr)
    passthrough: tuple[str, ...] = ()  # extra variable names a box gets (never secret-looking ones)
    network: bool = True  # whether a run whose limits ask for the network may have it
    uid_base: int = 200_000
    uid_slots: int = 1000

    @property
    def boxed(self) -> bool:
        """Return whether commands run in namespaces."""
        return self.mode != "none"


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
    strays: int | None = None  # processes still running when the command ended (all were killed)
    disk_exceeded: bool = False
    exchange: dict[str, bytes] = field(default_factory=dict)  # files collected from /grove/out

    @property
    def ok(self) -> bool:
        """Return whether the command exited 0 within its time and limits."""
        return self.exit_code == 0 and not self.timed_out and not self.disk_exceeded


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

        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
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


# uids and ownership --------------------------------------------------------------------------


@contextlib.contextmanager
def _lease_uid(iso: Isolation) -> Iterator[int | None]:
    """Hold an unprivileged uid no other box on this machine uses now (None unless root)."""
    if os.geteuid() != 0 or not iso.boxed:
        yield None
        return
    locks = Path(tempfile.gettempdir()) / "grove-sandbox-uids"
    locks.mkdir(mode=0o700, exist_ok=True)
    start = random.randrange(iso.uid_slots)
    for i in range(iso.uid_slots):
        slot = (start + i) % iso.uid_slots
        fh = open(locks / str(slot), "a")  # noqa: SIM115 - held for the whole run
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            continue
        try:
            yield iso.uid_base + slot
        finally:
            fh.close()
        return
    raise SandboxUnavailable(f"all {iso.uid_slots} sandbox uids are in use")


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    """Give a tree (its top `.git` excepted) to a uid, never following links; walks by descriptor."""
    with contextlib.suppress(OSError):
        os.lchown(root, uid, gid)
    for top, dirs, files, dfd in os.fwalk(root, follow_symlinks=False):
        at_top = top == str(root)
        for name in (*dirs, *files):
            if at_top and name == ".git":
                continue
            with contextlib.suppress(OSError):
                os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
        if at_top and ".git" in dirs:
            dirs.remove(".git")


def _scrub(root: Path) -> list[str]:
    """Remove what a box may leave for Grove's own tools to trip on; return what went.

    Nested `.git` entries (a repository whose config would make Grove's git run a program),
    FIFOs, sockets and device nodes (git cannot track them; reading one blocks).
    """
    removed: list[str] = []
    for top, dirs, files, dfd in os.fwalk(root, follow_symlinks=False):
        gone: set[str] = set()
        for name in (*dirs, *files):
            if top == str(root) and name == ".git":
                gone.add(name)  # Grove's own: not walked, not removed
                continue
            try:
                mode = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode
            except OSError:
                continue
            special = stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            if name != ".git" and not special:
                continue
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(mode):
                    shutil.rmtree(name, dir_fd=dfd)
                else:
                    os.unlink(name, dir_fd=dfd)
                removed.append(os.path.relpath(os.path.join(top, name), root))
            gone.add(name)
        dirs[:] = [d for d in dirs if d not in gone]
    return removed


def usage(*roots: Path) -> int:
    """Return the bytes (allocated blocks) under some folders, links not followed."""
    total = 0
    stack = [str(r) for r in roots]
    while stack:
        with contextlib.suppress(OSError), os.scandir(stack.pop()) as it:
            for e in it:
                with contextlib.suppress(OSError):
                    st = e.stat(follow_symlinks=False)
                    total += st.st_blocks * 512
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
    return total


def _read_regular(path: Path, cap: int = 1_000_000) -> bytes | None:
    """Read a file the box wrote, refusing links and special files (they could point at Grove's)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return fh.read(cap)


# the box ------------------------------------------------------------------------------------


def _dirs(path: str) -> list[str]:
    """Return bwrap arguments creating a path's ancestors traversable (bwrap copies 0700 otherwise)."""
    args: list[str] = []
    for parent in reversed(Path(path).parents):
        if str(parent) != "/":
            args += ["--perms", "0755", "--dir", str(parent)]
    return args


def _system_binds(iso: Isolation) -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += _dirs("/etc/passwd")
    for name in ETC:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, *iso.binds}
    for p in sorted(str(Path(x).resolve()) for x in prefixes if x):
        if not p.startswith("/usr/") and os.path.exists(p):
            args += [*_dirs(p), "--ro-bind", p, p]
    for dev in sorted(glob.glob("/dev/nvidia*")):
        args += ["--dev-bind-try", dev, dev]
    return args


def _bwrap_argv(
    iso: Isolation,
    limits: Limits,
    tree: Path,
    out: Path,
    argv: list[str],
    uid: int | None,
    readonly: tuple[str, ...] = (),
    seccomp_fd: int | None = None,
) -> list[str]:
    # As root, bwrap sets the box up with root's rights and `setpriv` then drops to the leased uid;
    # otherwise a user namespace maps Grove's own uid into the box.
    args = [
        iso.bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--die-with-parent", "--new-session", "--hostname", "grove-sandbox",
    ]  # fmt: skip
    if uid is None:
        args.append("--unshare-user")
    networked = limits.network and iso.network
    if not networked:
        args.append("--unshare-net")
    # The private /tmp comes first: read-only binds of paths under the host's /tmp (a venv there)
    # are then made inside it rather than hidden by it.
    size = str(limits.tmp_mb * 1024 * 1024)
    args += ["--proc", "/proc", "--dev", "/dev"]
    for tmp in ("/tmp", "/dev/shm"):
        args += ["--perms", "1777", "--size", size, "--tmpfs", tmp]
    args += _system_binds(iso)
    if networked:
        args += ["--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf"]
    args += [*_dirs(TREE), "--bind", str(tree), TREE, "--bind", str(out), OUT]
    # A sealed file is protected with the whole top-level entry that holds it: binding only the file
    # would let the command rename its folder away and put another file in its place.
    for top in sorted({rel.split("/", 1)[0] for rel in readonly}):
        path = tree / top
        # Never a link: it could point anywhere on the host.
        if (path.is_file() or path.is_dir()) and not path.is_symlink():
            args += ["--ro-bind", str(path), f"{TREE}/{top}"]
    dotgit = tree / ".git"
    if dotgit.is_dir() and not dotgit.is_symlink():
        args += ["--tmpfs", f"{TREE}/.git", "--remount-ro", f"{TREE}/.git"]
    elif dotgit.exists() or dotgit.is_symlink():
        args += ["--ro-bind", "/dev/null", f"{TREE}/.git"]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    args += ["--remount-ro", "/", "--chdir", TREE, "--"]
    if uid is not None:
        args += [
            "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--",
        ]  # fmt: skip
    return [*args, "/bin/sh", "-c", WRAPPER, "grove-sandbox", *argv]


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
    out_path, err_path = output_dir / f"{name}.stdout", output_dir / f"{name}.stderr"
    text = command if isinstance(command, str) else subprocess.list2cmdline(command)
    inner = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
    tree = cwd.resolve()
    exchange = Path(tempfile.mkdtemp(prefix="grove-out-"))
    try:
        with _lease_uid(isolation) as uid:
            try:
                return _run(
                    text, inner, tree, exchange, uid, out_path, err_path, limits, isolation, env,
                    passthrough, collect, readonly, disk_base, output_cap, tail_bytes,
                )  # fmt: skip
            finally:
                # The box is gone (its PID namespace with it): nothing races these walks.
                _scrub(tree)
                if uid is not None:
                    _chown_tree(tree, os.getuid(), os.getgid())
    finally:
        shutil.rmtree(exchange, ignore_errors=True)


def _run(
    text: str,
    inner: list[str],
    tree: Path,
    exchange: Path,
    uid: int | None,
    out_path: Path,
    err_path: Path,
    limits: Limits,
    iso: Isolation,
    env: Mapping[str, str] | None,
    passthrough: tuple[str, ...],
    collect: tuple[str, ...],
    readonly: tuple[str, ...],
    disk_base: int | None,
    output_cap: int,
    tail_bytes: int,
) -> Result:
    boxed = iso.boxed
    out_seen = OUT if boxed else str(exchange)
    extra = {k: v.replace("{out}", out_seen) for k, v in (env or {}).items()}
    if boxed:
        extra = {"HOME": "/tmp", "TMPDIR": "/tmp", **extra}
    full_env = scrubbed_env(extra, (*passthrough, *iso.passthrough))
    if uid is not None:
        _chown_tree(tree, uid, uid)
        os.chown(exchange, uid, uid)
    status_r, status_w = os.pipe()
    keep: list[int] = []
    if boxed:
        program = seccomp.program()
        if program is not None:
            filter_r, filter_w = os.pipe()
            os.write(filter_w, program)
            os.close(filter_w)
            keep.append(filter_r)
        argv = _bwrap_argv(iso, limits, tree, exchange, inner, uid, readonly, keep[0] if keep else None)
        stdin: int = status_w
    else:
        argv, stdin = inner, subprocess.DEVNULL
    baseline = usage(tree, exchange) if disk_base is None and limits.disk_mb else disk_base or 0
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            cwd=tree if not boxed else "/",
            env=full_env,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_limiter(limits),
            pass_fds=tuple(keep),
        )
    finally:
        os.close(status_w)
        for fd in keep:
            os.close(fd)
    _running.add(proc.pid)
    caps = [
        _Capture(proc.stdout, out_path, output_cap, tail_bytes),
        _Capture(proc.stderr, err_path, output_cap, tail_bytes),
    ]
    for c in caps:
        c.start()
    timed_out = disk_exceeded = False
    deadline = started + limits.timeout
    try:
        while True:
            try:
                proc.wait(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    timed_out = True
                    break
                if limits.disk_mb and usage(tree, exchange) - baseline > limits.disk_mb * 1024 * 1024:
                    disk_exceeded = True
                    break
    finally:
        # The whole group goes (and, boxed, the PID namespace with it), so nothing outlives the run.
        _kill_group(proc.pid)
        proc.wait()
        _running.discard(proc.pid)
    for c in caps:
        c.join(timeout=10)
    with os.fdopen(status_r, "rb") as fh:
        status = fh.read(200).decode("ascii", "replace").split()
    reported = len(status) == 3 and status[0] == "grove-exit"
    strays = int(status[2]) - 2 if reported else None
    code = proc.returncode
    if reported and 128 < code <= 128 + 64:
        code = 128 - code  # the box's shell reports a signal as 128+n; report it as -n like Popen
    stderr_tail = caps[1].tail.decode("utf-8", "replace")
    notes = []
    if strays:
        notes.append(
            f"{strays} process(es) were still running when the command ended; the sandbox killed them"
        )
    if disk_exceeded:
        notes.append(f"the command wrote more than {limits.disk_mb} MB; it was stopped")
    if notes:
        note = "".join(f"\n[grove: {n}]" for n in notes) + "\n"
        with open(err_path, "a") as fh:
            fh.write(note)
        stderr_tail = (stderr_tail + note)[-tail_bytes:]
    got = {}
    for fname in collect:
        data = _read_regular(exchange / fname)
        if data is not None:
            got[fname] = data
    return Result(
        command=text,
        exit_code=None if timed_out else code,
        duration=time.monotonic() - started,
        timed_out=timed_out,
        stdout_path=out_path,
        stderr_path=err_path,
        stdout_tail=caps[0].tail.decode("utf-8", "replace"),
        stderr_tail=stderr_tail,
        truncated=any(c.total > output_cap for c in caps),
        signal=-code if code is not None and code < 0 else None,
        stdout_bytes=caps[0].total,
        strays=strays,
        disk_exceeded=disk_exceeded,
        exchange=got,
    )
