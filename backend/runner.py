"""Drive a study's coordinator graph in this process, with the local pool as dispatcher."""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from typing import Any

from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.types import Command

from agents.coordinator.graph import build_graph
from agents.policies.base import Policy
from agents.policies.registry import make_policy
from backend import db
from backend.core.config import Settings
from backend.gatekeeper import LocalGatekeeper
from backend.localpool import LocalPool
from backend.models import Study
from backend.storage import SqlStorage, spec_of

os.environ.setdefault("LANGGRAPH_STRICT_MSGPACK", "true")

Approver = Callable[[int, int], dict[str, Any]]


def thread_config(study_id: int) -> dict[str, Any]:
    """Return the LangGraph config of a study's coordinator thread."""
    return {"configurable": {"thread_id": f"study-{study_id}"}, "recursion_limit": 100_000}


def _status(settings: Settings, study_id: int) -> str:
    with db.session(settings.db_url) as s:
        study = s.get(Study, study_id)
        assert study is not None
        return study.status


def _wait_while_paused(settings: Settings, study_id: int, tick: Callable[[], None] | None) -> None:
    while _status(settings, study_id) == "paused":
        if tick:
            tick()
        time.sleep(1.0)


def run_study(
    settings: Settings,
    study_id: int,
    *,
    approver: Approver,
    tick: Callable[[], None] | None = None,
    policy: Policy | None = None,
) -> str:
    """Run (or resume) a study until it finishes; return its final status."""
    with db.session(settings.db_url) as s:
        study = s.get(Study, study_id)
        assert study is not None
        spec = spec_of(study)
    storage = SqlStorage(settings.db_url)
    pool = LocalPool(settings)
    graph_def = build_graph(storage, pool, LocalGatekeeper(settings), policy or make_policy(spec))
    settings.checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(settings.checkpoint_path, check_same_thread=False)) as conn:
        conn.execute("PRAGMA busy_timeout=30000")
        saver = SqliteSaver(conn)
        saver.setup()
        graph = graph_def.compile(checkpointer=saver)
        config = thread_config(study_id)
        snapshot = graph.get_state(config)
        inp: Any = {"study_id": study_id} if not snapshot.values else None
        try:
            pool.reconcile(study_id)
            while True:
                out = graph.invoke(inp, config, durability="sync", version="v2")
                interrupts = list(out.interrupts)
                if not interrupts:
                    break
                intr = interrupts[0]
                kind = intr.value.get("kind")
                if kind == "await_jobs":
                    done = pool.wait_any(
                        list(intr.value["jobs"]),
                        tick=tick,
                        interrupted=lambda: _status(settings, study_id) == "stopping",
                    )
                    inp = Command(resume={intr.id: done})
                elif kind == "approve":
                    inp = Command(resume={intr.id: approver(study_id, int(intr.value["node_id"]))})
                elif kind == "paused":
                    _wait_while_paused(settings, study_id, tick)
                    inp = Command(resume={intr.id: {}})
                else:
                    raise RuntimeError(f"unknown interrupt {intr.value!r}")
        finally:
            pool.shutdown()
    with db.session(settings.db_url) as s:
        study = s.get(Study, study_id)
        assert study is not None
        return study.status
