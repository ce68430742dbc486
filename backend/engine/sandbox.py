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
import errno
import fcntl
import glob
import itertools
import json
import os
import random
import re
import resource
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import IO

from agents.failures import NoEvidence
from backend.engine import seccomp

SAFE_ENV = (
    "PATH", "LANG", "LANGUAGE", "TERM", "TZ", "VIRTUAL_ENV", "PYTHONHASHSEED",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE",
    "OPENBLAS_L2_SIZE", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "LD_LIBRARY_PATH",
)  # fmt: skip
SECRET = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH)", re.IGNORECASE)
TREE, OUT, ENV, SCRATCH = "/grove/tree", "/grove/out", "/grove/env", "/grove/scratch"
# What a box sees of /etc: enough for the dynamic linker, locales, TLS roots and user names.
ETC = (
    "alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "ssl", "ca-certificates",
    "passwd", "group", "nsswitch.conf", "hosts", "mime.types", "fonts", "timezone", "os-release",
)  # fmt: skip


LIFELINE = 3  # where the wrapper keeps the lifeline: dash names only 0 to 9 in a redirection
# Runs as pid 2 of the box around the command (its arguments). Its fd 0 is the lifeline: one end
# of a socket pair whose other end only the Grove process that started the box holds. It moves it
# to fd 3 and gives the command /dev/null, so the command holds no copy of it (and a socket, unlike
# a pipe, cannot be opened again through /proc/<pid>/fd by a process that wants to keep it open).
# A watcher reads it: it ends when Grove's end is shut or its process dies, however it dies and
# however early, and the watcher then kills every process of the box (bwrap's pid 1 then exits,
# its last child gone). Once the command ends the watcher is killed and reaped, counting /proc
# tells how many processes the command left behind (pid 1 and 2 are ours), the count goes back to
# Grove on the same socket, and they are killed.
# The wrapper, its watcher and the shell that runs a command line count against the box's process
# limit too: it is raised by them, so that `processes` is what the command itself may run at once.
WRAPPER_PROCESSES = 3
WRAPPER = (
    f"exec {LIFELINE}<&0 </dev/null; (read _ <&{LIFELINE}; kill -KILL -1) & w=$!; "
    f'("$@" {LIFELINE}<&-); rc=$?; kill -KILL $w 2>/dev/null; wait $w 2>/dev/null; '
    f'n=0; for p in /proc/[0-9]*; do n=$((n+1)); done; echo "grove-exit $rc $n" >&{LIFELINE}; '
    "kill -KILL -1 2>/dev/null; exit $rc"
)
FIX = (
    "install bubblewrap (apt install bubblewrap) and allow unprivileged user namespaces "
    "(sysctl kernel.unprivileged_userns_clone=1, and on Ubuntu "
    "kernel.apparmor_restrict_unprivileged_userns=0; in Docker run with --security-opt "
    "seccomp=unconfined or a profile that allows clone/unshare), or, for trusted code on your own "
    "machine only, set GROVE_SANDBOX=none"
)


class SandboxUnavailable(RuntimeError, NoEvidence):
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


class Boxing(StrEnum):
    """Whether commands run in bubblewrap's namespaces or, on a machine without them, unboxed."""

    BWRAP = "bwrap"
    NONE = "none"


@dataclass(frozen=True)
class Isolation:
    """How commands are boxed on this machine (from Grove's settings, never from a spec)."""

    mode: Boxing = Boxing.BWRAP
    bwrap: str = "bwrap"
    binds: tuple[str, ...] = ()  # extra read-only paths (a toolchain outside /usr)
    passthrough: tuple[str, ...] = ()  # extra variable names a box gets (never secret-looking ones)
    network: bool = True  # whether a run whose limits ask for the network may have it
    uid_base: int = 200_000
    uid_slots: int = 1000
    # A study's evaluation environment (`environment.py`): mounted at /grove/env with its `bin/`
    # first on PATH; writable only while its setup builds it.
    env_dir: str = ""
    env_writable: bool = False
    # A writable scratch folder mounted at /grove/scratch (an environment setup's TMPDIR and HOME).
    scratch_dir: str = ""

    def env_path(self) -> str:
        """Return where a command sees the environment: /grove/env in a box, else its real folder."""
        return ENV if self.boxed else self.env_dir

    def scratch_path(self) -> str:
        """Return where a command sees the scratch folder: /grove/scratch in a box, else its real folder."""
        return SCRATCH if self.boxed else self.scratch_dir

    def writable(self) -> list[Path]:
        """Return the folders besides the tree a command may write: the env while it builds, the scratch."""
        return [Path(p) for p in (self.env_dir if self.env_writable else "", self.scratch_dir) if p]

    @property
    def boxed(self) -> bool:
        """Return whether commands run in namespaces."""
        return self.mode != Boxing.NONE


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


# uids and ownership --------------------------------------------------------------------------


def _lock_dir() -> Path:
    """Return the folder of uid lease locks: Grove's own, private, never a link."""
    base = Path("/run") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir())
    path = base / f"grove-sandbox-uids-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SandboxUnavailable(f"{path} is not a private folder of Grove's user; remove it")
    return path


@contextlib.contextmanager
def _lease_uid(iso: Isolation) -> Iterator[int | None]:
    """Hold an unprivileged uid no other box on this machine uses now (None unless root)."""
    if os.geteuid() != 0 or not iso.boxed:
        yield None
        return
    locks = _lock_dir()
    start = random.randrange(iso.uid_slots)
    for i in range(iso.uid_slots):
        slot = (start + i) % iso.uid_slots
        fd = os.open(locks / str(slot), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield iso.uid_base + slot
        finally:
            os.close(fd)
        return
    raise SandboxUnavailable(f"all {iso.uid_slots} sandbox uids are in use")


MAX_DEPTH = 200  # no real repository nests deeper; a deeper tree is a box's attack on Grove's walks
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _walk(
    root: Path,
    visit: Callable[[int, str, os.stat_result, str], bool],
    blind: Callable[[str], None] | None = None,
    open_up: bool = True,
) -> None:
    """Visit each entry under `root` (its top `.git` excepted) by directory descriptor, links unfollowed.

    Iterative and depth-first, holding one descriptor per level. `visit(dir_fd, name, st, rel)`
    gets the entry's path relative to `root` and returns whether to descend into a directory.
    A folder closed to its owner (a box's `chmod 000`, which stops Grove's own user) is opened up
    for its owner first, with `open_up`; one that still cannot be walked is passed to `blind`.
    """
    try:
        top = os.open(root, _DIR)
    except OSError:
        return
    stack: list[tuple[int, Iterator[str], str]] = [(top, iter(sorted(os.listdir(top))), "")]
    while stack:
        dfd, names, prefix = stack[-1]
        name = next(names, None)
        if name is None:
            os.close(dfd)
            stack.pop()
            continue
        if not prefix and name == ".git":
            continue
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            continue
        rel = f"{prefix}{name}"
        if visit(dfd, name, st, rel) and stat.S_ISDIR(st.st_mode):
            try:
                child = _open_dir(dfd, name, st, open_up)
                try:
                    entries = sorted(os.listdir(child))
                except OSError:
                    os.close(child)
                    raise
                stack.append((child, iter(entries), rel + "/"))
            except OSError as exc:
                # Gone or replaced meanwhile (the box may still run) is no folder hidden from the walk.
                if blind is not None and exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                    blind(rel)


def _open_dir(dfd: int, name: str, st: os.stat_result, open_up: bool) -> int:
    try:
        return os.open(name, _DIR, dir_fd=dfd)
    except PermissionError:
        if not open_up or st.st_uid != os.geteuid():
            raise
    # By a descriptor of the folder itself: a link put in its place meanwhile is not followed.
    pfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dfd)
    try:
        os.chmod(f"/proc/self/fd/{pfd}", stat.S_IMODE(st.st_mode) | 0o700)
    finally:
        os.close(pfd)
    return os.open(name, _DIR, dir_fd=dfd)


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    """Give a tree (its top `.git` excepted) to a uid, never following links."""
    with contextlib.suppress(OSError):
        os.lchown(root, uid, gid)

    def visit(dfd: int, name: str, st: os.stat_result, rel: str) -> bool:
        with contextlib.suppress(OSError):
            os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
        return True

    _walk(root, visit)


UNSHARE_BYTES = 1 << 30  # what copies of hard-linked files may take after a run without a disk limit


def _reclaim(root: Path, owner: tuple[int, int] | None, budget: int = UNSHARE_BYTES) -> None:
    """After a box, in one walk: remove what Grove's own tools must not meet, give the rest to `owner`.

    Removed: nested `.git` entries (a repository whose config would make Grove's git run a program),
    FIFOs, sockets and device nodes (git cannot track them; reading one blocks), and folders nested
    past MAX_DEPTH (they would exhaust recursive walks); folders are moved out, then deleted.
    Hard-linked files get an inode of their own: a link made in one run would otherwise reach a
    file that a later run binds read-only. The copies take at most `budget` bytes; names past it
    are removed.
    """
    quarantine: list[tuple[Path, int]] = []  # made on the first folder to remove
    left = [budget]
    names = itertools.count()
    if owner is not None:
        with contextlib.suppress(OSError):
            os.lchown(root, *owner)

    def visit(dfd: int, name: str, st: os.stat_result, rel: str) -> bool:
        mode = st.st_mode
        special = stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        deep = stat.S_ISDIR(mode) and rel.count("/") + 1 >= MAX_DEPTH
        if name == ".git" or special or deep:
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(mode):
                    if not quarantine:
                        q = Path(tempfile.mkdtemp(prefix=".grove-scrub-", dir=root.parent))
                        quarantine.append((q, os.open(q, _DIR)))
                    os.rename(name, str(next(names)), src_dir_fd=dfd, dst_dir_fd=quarantine[0][1])
                else:
                    os.unlink(name, dir_fd=dfd)
            return False
        if stat.S_ISREG(mode) and st.st_nlink > 1:
            _unshare_inode(dfd, name, left)  # the copy is Grove's own already
        elif owner is not None:
            with contextlib.suppress(OSError):
                os.chown(name, *owner, dir_fd=dfd, follow_symlinks=False)
        return True

    try:
        _walk(root, visit)
    finally:
        for q, qfd in quarantine:
            os.close(qfd)
            # GNU rm walks without recursion or path-length limits.
            subprocess.run(["rm", "-rf", "--one-file-system", "--", str(q)], check=False)


def _unshare_inode(dfd: int, name: str, budget: list[int]) -> None:
    """Replace a hard-linked file by a private copy of its bytes (the same name, its own inode).

    Only the file's data is copied, its holes kept, and only while `budget[0]` bytes last: past
    them, or if it cannot be copied, the name is removed instead (its bytes stay under the file's
    other names). Otherwise a box could link one large sparse file a thousand times and have
    Grove fill the disk.
    """
    tmp = f".grove-copy-{os.getpid()}-{random.randrange(1 << 30)}"
    try:
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        try:
            st = os.fstat(src)
            if not stat.S_ISREG(st.st_mode):
                return
            dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
            try:
                budget[0] -= _copy_data(src, dst, st.st_size, budget[0])
                # An executable stays one (an environment's tools), without set-id bits.
                os.fchmod(dst, stat.S_IMODE(st.st_mode) & 0o755)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dfd)


def _copy_data(src: int, dst: int, size: int, budget: int) -> int:
    """Copy a file's data regions to the same offsets of another, leaving its holes holes; return the bytes written.

    Raise OSError (ENOSPC) rather than write more than `budget` bytes.
    """
    offset = written = 0
    while offset < size:
        try:
            start = os.lseek(src, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            break  # no data past `offset`
        end = os.lseek(src, start, os.SEEK_HOLE)
        while start < end:
            chunk = os.pread(src, min(1 << 20, end - start), start)
            if not chunk:
                break
            if written + len(chunk) > budget:
                raise OSError(errno.ENOSPC, "past the budget for copies of linked files")
            view = memoryview(chunk)
            while view:
                n = os.pwrite(dst, view, start)
                view, start, written = view[n:], start + n, written + n
        offset = end
    os.ftruncate(dst, size)
    return written


TOO_DEEP = 1 << 62  # what `usage` answers for a tree it cannot count whole: over any disk limit


def usage(*roots: Path) -> int:
    """Return the bytes (allocated blocks) under some folders, links not followed, by descriptor.

    A tree that cannot be counted whole answers TOO_DEEP: one nested past MAX_DEPTH (its walk
    would hold a descriptor per level and run out of them), or with a folder the walk cannot open.
    """
    total = 0

    def visit(dfd: int, name: str, st: os.stat_result, rel: str) -> bool:
        nonlocal total
        total += st.st_blocks * 512
        if stat.S_ISDIR(st.st_mode) and rel.count("/") + 1 >= MAX_DEPTH:
            total += TOO_DEEP
            return False
        return True

    def blind(rel: str) -> None:
        nonlocal total
        total += TOO_DEEP

    for root in roots:
        _walk(root, visit, blind, open_up=False)  # the box may still run: its folders stay as they are
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


def _readonly_mounts(tree: Path, readonly: tuple[str, ...]) -> list[str]:
    """Return bwrap arguments that keep the listed files (relative paths) from being changed.

    Each file is bound read-only with the highest folder above it that holds only listed files.
    Every folder above such a unit is bound onto itself: a mount point cannot be renamed, so
    no folder can be moved away and replaced by one holding other files. Links are never bound.
    """
    if not readonly:
        return []
    listed = set(readonly)
    under: dict[str, set[str]] = {}  # folder -> every non-folder entry below it

    def visit(dfd: int, name: str, st: os.stat_result, rel: str) -> bool:
        if stat.S_ISDIR(st.st_mode):
            return True
        parts = rel.split("/")
        for i in range(1, len(parts)):
            under.setdefault("/".join(parts[:i]), set()).add(rel)
        return False

    _walk(tree, visit)

    def plain(rel: str) -> bool:
        parts = rel.split("/")
        if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
            return False
        return not any((tree / "/".join(parts[: i + 1])).is_symlink() for i in range(len(parts)))

    units: set[str] = set()
    for rel in listed:
        if not plain(rel) or not (tree / rel).is_file():
            continue
        unit, parts = rel, rel.split("/")
        for i in range(len(parts) - 1, 0, -1):
            folder = "/".join(parts[:i])
            if not under.get(folder, set()) <= listed:
                break
            unit = folder
        units.add(unit)
    units = {u for u in units if not any(u.startswith(v + "/") for v in units)}
    guards = {"/".join(u.split("/")[:i]) for u in units for i in range(1, u.count("/") + 1)}
    args: list[str] = []
    for folder in sorted(guards, key=lambda g: g.count("/")):
        args += ["--bind", str(tree / folder), f"{TREE}/{folder}"]
    for unit in sorted(units):
        args += ["--ro-bind", str(tree / unit), f"{TREE}/{unit}"]
    return args


def _dirs(path: str) -> list[str]:
    """Return bwrap arguments creating a path's ancestors traversable (bwrap copies 0700 otherwise)."""
    args: list[str] = []
    for parent in reversed(Path(path).parents):
        if str(parent) != "/":
            args += ["--perms", "0755", "--dir", str(parent)]
    return args


def _system_binds(iso: Isolation) -> list[str]:
    # GPU device nodes are looked up on every run: some appear only once CUDA first starts.
    return [
        *_installed_binds(iso.binds),
        *(a for dev in sorted(glob.glob("/dev/nvidia*")) for a in ("--dev-bind-try", dev, dev)),
    ]


@lru_cache(maxsize=8)
def _installed_binds(extra: tuple[str, ...]) -> tuple[str, ...]:
    """Return the binds of the system and Python installs a box sees (read once per process)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += _dirs("/etc/passwd")
    for name in ETC:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, *extra}
    for p in sorted(str(Path(x).resolve()) for x in prefixes if x):
        if not p.startswith("/usr/") and os.path.exists(p):
            args += [*_dirs(p), "--ro-bind", p, p]
    return tuple(args)


def _bwrap_argv(
    iso: Isolation,
    limits: Limits,
    tree: Path,
    out: Path,
    argv: list[str],
    uid: int | None,
    readonly: tuple[str, ...] = (),
    seccomp_fd: int | None = None,
    info_fd: int | None = None,
) -> list[str]:
    # As root, bwrap sets the box up with root's rights and `setpriv` then drops to the leased uid;
    # otherwise a user namespace maps Grove's own uid into the box.
    args = [
        iso.bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--new-session", "--hostname", "grove-sandbox",
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
    if iso.env_dir:
        args += ["--bind" if iso.env_writable else "--ro-bind", iso.env_dir, ENV]
    if iso.scratch_dir:
        args += ["--bind", iso.scratch_dir, SCRATCH]
    # The tree's `.git` (a file naming Grove's clone) becomes an empty read-only mount point: the box
    # can neither read where the clone is nor remove or replace it with a repository of its own.
    dotgit = tree / ".git"
    if dotgit.is_dir() and not dotgit.is_symlink():
        args += ["--tmpfs", f"{TREE}/.git", "--remount-ro", f"{TREE}/.git"]
    elif dotgit.exists() or dotgit.is_symlink():
        args += ["--ro-bind", "/dev/null", f"{TREE}/.git"]
    args += _readonly_mounts(tree, readonly)
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    if info_fd is not None:
        args += ["--info-fd", str(info_fd)]
    args += ["--remount-ro", "/", "--chdir", TREE, "--"]
    if uid is not None:
        args += [
            "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--",
        ]  # fmt: skip
    return [*args, "/bin/sh", "-c", WRAPPER, "grove-sandbox", *argv]


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
