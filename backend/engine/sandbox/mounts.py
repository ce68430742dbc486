"""What a box sees: its mounts (the tree, the exchange folder, read-only system paths) and the wrapper around its command."""

from __future__ import annotations

import glob
import os
import stat
import sys
from functools import lru_cache
from pathlib import Path

from backend.engine.sandbox.disk import (
    _walk,
)
from backend.engine.sandbox.limits import ENV, OUT, SCRATCH, TREE, Isolation, Limits

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
