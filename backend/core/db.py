"""Database engine and sessions (SQLite with WAL and a busy timeout by default)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import Session, create_engine

from backend.core import fanout, migrate, models  # noqa: F401  (models registers the tables)

EVENT_STUDIES = "grove_event_studies"  # session.info key: studies whose events this transaction added


def _private_sqlite(path: Path) -> None:
    """Create a SQLite file readable by its owner alone (0600), in a folder made 0700 if it is made here.

    SQLite creates a missing file with the umask's mode and gives its -wal and -shm files the file's
    mode; one of ours with group or others' rights (an older Grove made it) has them taken off.
    """
    if not path.name or path.name == ":memory:":
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
    for f in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            st = f.stat()
        except FileNotFoundError:
            continue
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.chmod(f, st.st_mode & 0o700)


@lru_cache(maxsize=8)
def get_engine(url: str) -> Engine:
    """Return the engine for a database URL, migrated to the newest schema on first use."""
    if url.startswith("sqlite:///"):
        _private_sqlite(Path(url.removeprefix("sqlite:///").split("?", 1)[0]))
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(conn, _record):  # type: ignore[no-untyped-def]
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()
    else:
        engine = create_engine(url, pool_pre_ping=True)
    migrate.upgrade(engine)
    return engine


@contextmanager
def session(url: str) -> Iterator[Session]:
    """Open a session that commits on success and rolls back on error."""
    with Session(get_engine(url), expire_on_commit=False) as s:
        try:
            yield s
            s.commit()
        except BaseException:
            s.rollback()
            raise


@event.listens_for(Session, "after_commit")
def _ping_listeners(s: Session) -> None:
    """After each commit that added events, ping the fan-out of their studies."""
    fanout.notify(s.info.pop(EVENT_STUDIES, set()))


@event.listens_for(Session, "after_rollback")
def _forget_events(s: Session) -> None:
    s.info.pop(EVENT_STUDIES, None)
