"""The coordinator's SQLite checkpointer: kept open between advances, opened again when its file goes."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

from backend.core.config import Settings
from backend.engine.driver import checkpointer


def saved_threads(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {row[0] for row in conn.execute("SELECT thread_id FROM checkpoints")}


def put(settings: Settings, thread: str) -> object:
    from langgraph.checkpoint.base import empty_checkpoint

    with checkpointer(settings) as saver:
        config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
        saver.put(config, empty_checkpoint(), {}, {})
        return saver


def test_a_removed_checkpoint_file_is_created_again_and_written(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt")
    first = put(settings, "study-1")
    assert put(settings, "study-2") is first  # kept open between advances
    assert saved_threads(settings.checkpoint_path) == {"study-1", "study-2"}
    shutil.rmtree(settings.data_dir)  # an operator wipes the data directory
    assert put(settings, "study-3") is not first
    # Written to a file that exists, not to the unlinked one the old connection still held.
    assert saved_threads(settings.checkpoint_path) == {"study-3"}
