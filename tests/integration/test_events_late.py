"""An event whose transaction commits after later ones is still streamed (PostgreSQL ids are given at insert)."""

from __future__ import annotations

from pathlib import Path

from backend.api.routes.events import _poll
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Study
from backend.services.records import add_event
from tests.support.services import drop_postgres_database, postgres_database


def test_an_event_committed_after_a_later_one_is_sent_when_it_appears(tmp_path: Path) -> None:
    name = "grove_test_late_events"
    settings = Settings(
        data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt", database_url=postgres_database(name)
    )
    try:
        with db.session(settings.db_url) as s:
            study = Study(name="late", goal="g", spec_toml="", source="s")
            s.add(study)
            s.flush()
            sid = study.id or 0
            add_event(s, sid, "study.created")
        start = _poll(settings, sid, 0, 0, set())
        floor = start[-1].id
        with db.session(settings.db_url) as slow:
            add_event(slow, sid, "node.proposed")
            slow.flush()  # its id is taken now; it commits last
            with db.session(settings.db_url) as s:
                add_event(s, sid, "node.queued")
            first = _poll(settings, sid, floor, floor, set())
            assert [e.type for e in first] == ["node.queued"]  # the slow one is not visible yet
        cursor = first[0].id
        second = _poll(settings, sid, cursor, floor, {cursor})
        assert [e.type for e in second] == ["node.proposed"] and second[0].id < cursor
        assert _poll(settings, sid, cursor, floor, {cursor, second[0].id}) == []  # sent once
    finally:
        db.get_engine(settings.db_url).dispose()
        drop_postgres_database(name)
