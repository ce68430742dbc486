"""The disk side of a box: walking and handing over its tree safely, reclaiming it, and counting what it wrote."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import random
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

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
