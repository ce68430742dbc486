"""Advance a study's coordinator graph as far as the database allows.

The graph waits in interrupts (`await_jobs`, `approve`, `paused`); whether each can be resumed
is read from the database (job rows, approval rows, the study's status), so any process may
advance a study at any time: the CLI loop after a local job ends, a Celery task after a worker's
job ends or an approval arrives. Callers hold the study's lock: one writer per thread.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.types import Command, Interrupt
from sqlmodel import col, select

from agents.coordinator.configuration import CoordinatorContext
from agents.coordinator.graph import build_graph
from agents.coordinator.ports import Dispatcher, Gatekeeper
from agents.coordinator.state import Wait
from agents.policies.base import Policy
from agents.policies.registry import make_policy
from agents.tree.status import StopRule, StudyStatus
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Job, Study
from backend.core.states import JOB_ENDED
from backend.engine.gatekeeper import BaselineError, LocalGatekeeper
from backend.engine.jobstore import DbStore
from backend.services import lifecycle
from backend.services.approvals import answer_of
from backend.services.ledger import StoreLedger
from backend.services.records import spec_of
from backend.services.storage import SqlStorage

os.environ.setdefault("LANGGRAPH_STRICT_MSGPACK", "true")


def thread_id(study_id: int) -> str:
    """Return the id of a study's coordinator thread in the checkpointer."""
    return f"study-{study_id}"


def thread_config(study_id: int) -> dict[str, Any]:
    """Return the LangGraph config of a study's coordinator thread."""
    return {"configurable": {"thread_id": thread_id(study_id)}, "recursion_limit": 100_000}


@contextmanager
def checkpointer(settings: Settings) -> Iterator[Any]:
    """Yield the coordinator's checkpointer: PostgresSaver with PostgreSQL, else SqliteSaver in the data dir."""
    if settings.is_postgres:
        import psycopg
        from langgraph.checkpoint.postgres import PostgresSaver
        from psycopg.rows import dict_row

        url = settings.db_url.replace("postgresql+psycopg://", "postgresql://", 1)
        with psycopg.connect(url, autocommit=True, prepare_threshold=0, row_factory=dict_row) as conn:
            pg = PostgresSaver(conn)
            pg.setup()
            yield pg
        return
    yield _sqlite_saver(settings.checkpoint_path)


# One SQLite checkpointer per process and file, kept open: closing the last connection to a
# write-ahead-logged database folds the log back into it (a synced write on every advance).
# Keyed by the process id too: a forked child opens its own and keeps its parent's referenced
# (closing a connection inherited across a fork could disturb the parent's log). A file that was
# removed or replaced is opened again; a saver dropped from the cache closes once nothing uses it.
_SAVERS: dict[tuple[int, Path], tuple[SqliteSaver, tuple[int, int] | None]] = {}
_INHERITED: list[SqliteSaver] = []
_KEEP = 4
_LOCK = threading.Lock()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _sqlite_saver(path: Path) -> SqliteSaver:
    key = (os.getpid(), path)
    with _LOCK:
        held = _SAVERS.get(key)
        if held is not None and held[1] is not None and held[1] == _identity(path):
            return held[0]
        for other in [k for k in _SAVERS if k[0] != key[0]]:
            _INHERITED.append(_SAVERS.pop(other)[0])
        _SAVERS.pop(key, None)
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, check_same_thread=False, timeout=30)
        conn.execute("PRAGMA busy_timeout=30000")
        # Like Grove's database: a write-ahead log, synced at checkpoints (a step writes several).
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        saver = SqliteSaver(conn)
        saver.setup()
        while len(_SAVERS) >= _KEEP:  # a process that served other data directories (tests do)
            _SAVERS.pop(next(iter(_SAVERS)))
        _SAVERS[key] = (saver, _identity(path))
        return saver


@cache
def compiled() -> Any:
    """Return the coordinator graph compiled once per process; each advance binds its checkpointer."""
    return build_graph().compile()


@dataclass(frozen=True)
class Waiting:
    """What a study's graph is waiting for after an advance."""

    finished: bool
    jobs: list[int]
    approval_node: int | None
    paused: bool


def study_status(settings: Settings, study_id: int) -> str:
    """Return a study's status."""
    with db.session(settings.db_url) as s:
        study = s.get(Study, study_id)
        assert study is not None
        return study.status


def _resume_value(settings: Settings, study_id: int, intr: Interrupt) -> Any | None:
    """Return the value that resumes this interrupt now, or None if it must keep waiting."""
    kind = intr.value.get("kind")
    if kind == Wait.JOBS:
        jobs = list(intr.value["jobs"])
        approval = intr.value.get("approval")
        with db.session(settings.db_url) as s:
            rows = s.exec(select(Job).where(col(Job.id).in_(jobs), col(Job.status).in_(JOB_ENDED)))
            done = sorted(j.id for j in rows if j.id is not None)
            decided = approval is not None and answer_of(s, approval) is not None
        if done or decided or study_status(settings, study_id) == StudyStatus.STOPPING:
            return done
        return None
    if kind == Wait.APPROVAL:
        with db.session(settings.db_url) as s:
            answer = answer_of(s, intr.value["node_id"])
        if answer is None and study_status(settings, study_id) == StudyStatus.STOPPING:
            return {"withdrawn": True, "reason": "the study was stopped before a decision"}
        return answer
    if kind == Wait.RESUME:
        return {} if study_status(settings, study_id) != StudyStatus.PAUSED else None
    raise RuntimeError(f"unknown interrupt {intr.value!r}")


class _Forgetting:
    """A gatekeeper whose every call makes the storage read the study and its nodes again (it writes both)."""

    def __init__(self, inner: Gatekeeper, storage: SqlStorage) -> None:
        self._inner, self._storage = inner, storage

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)
        if not callable(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            finally:
                self._storage.forget()

        return call


class Driver:
    """Runs one study's graph with the given dispatcher (the local pool or Celery)."""

    def __init__(
        self,
        settings: Settings,
        study_id: int,
        dispatcher: Dispatcher,
        policy: Policy | None = None,
        gatekeeper: Gatekeeper | None = None,
    ):
        self.settings, self.study_id = settings, study_id
        with db.session(settings.db_url) as s:
            study = s.get(Study, study_id)
            assert study is not None
            spec = spec_of(study)
        self.storage = SqlStorage(settings.db_url)
        gate = _Forgetting(gatekeeper or LocalGatekeeper(settings), self.storage)
        self.context = CoordinatorContext(
            storage=self.storage,
            dispatcher=dispatcher,
            sealed=gate,
            trunk=gate,
            policy=policy or make_policy(spec, ledger=StoreLedger(DbStore(settings, study_id, None))),
        )

    @contextmanager
    def _graph(self) -> Iterator[Any]:
        with checkpointer(self.settings) as saver:
            yield compiled().copy({"checkpointer": saver})

    def advance(self) -> Waiting:
        """Run the graph until every pending interrupt must keep waiting (or it ends)."""
        cfg = thread_config(self.study_id)
        with self._graph() as graph:
            while True:
                snap = graph.get_state(cfg)
                if not snap.values:
                    inp: Any = {"study_id": self.study_id}
                elif not snap.next and not snap.tasks:
                    return Waiting(True, [], None, False)
                elif not snap.interrupts:
                    # A step was cut short by a crash: either a node did not finish (run it again), or
                    # every node's writes were saved but the step's checkpoint was not (next is empty
                    # then, yet the graph is not at its end): invoking applies them and goes on.
                    inp = None
                else:
                    ready = {}
                    for intr in snap.interrupts:
                        value = _resume_value(self.settings, self.study_id, intr)
                        if value is not None:
                            ready[intr.id] = value
                    if not ready:
                        return self._waiting(snap.interrupts)
                    inp = Command(resume=ready)
                self.storage.forget()  # a run of the graph starts from what the database holds now
                try:
                    graph.invoke(inp, cfg, context=self.context, durability="sync", version="v2")
                except BaselineError as exc:
                    self._fail(str(exc), exc.step)
                    return Waiting(True, [], None, False)

    def _fail(self, reason: str, step: StopRule | None = None) -> None:
        # Experiments may run beside the baseline's held-out job: nothing of a failed study goes on.
        self.storage.cancel_active(self.study_id, reason="the study failed")
        with db.session(self.settings.db_url) as s:
            lifecycle.fail(s, self.study_id, reason, step)

    @staticmethod
    def _waiting(interrupts: tuple[Interrupt, ...]) -> Waiting:
        jobs: list[int] = []
        approval, paused = None, False
        for intr in interrupts:
            kind = intr.value.get("kind")
            if kind == Wait.JOBS:
                jobs += list(intr.value["jobs"])
                if intr.value.get("approval") is not None:
                    approval = int(intr.value["approval"])
            elif kind == Wait.APPROVAL:
                approval = int(intr.value["node_id"])
            elif kind == Wait.RESUME:
                paused = True
        return Waiting(False, jobs, approval, paused)
