"""The uids boxes run as: one leased per run from a range no account uses, held by a file lock."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from backend.engine.sandbox.limits import (
    Isolation,
    SandboxUnavailable,
)


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
