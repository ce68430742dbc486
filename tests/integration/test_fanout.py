from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import redis

from backend.core import db, fanout
from backend.core.config import PROJECT_ROOT, Settings
from backend.services.records import add_event
from backend.services.studies import create_study
from tests.support.repos import tiny_files


def _ping(pubsub: redis.client.PubSub, timeout: float = 10.0) -> dict[str, object] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
        if message is not None:
            return message  # type: ignore[no-any-return]
    return None


def _commit_event(url: str, study_id: int) -> None:
    with db.session(url) as s:
        add_event(s, study_id, "study.note", None, text="committed")


def _commit_event_and_flush(url: str, study_id: int) -> None:
    _commit_event(url, study_id)
    assert fanout.flush(10)


def test_a_commit_that_adds_events_pings_its_study_from_the_process_and_from_a_forked_child(
    redis_url: str, settings: Settings, tiny_repo: Path
) -> None:
    with db.session(settings.db_url) as s:
        sid = create_study(s, settings, tiny_files(name="fanout")["grove.toml"], str(tiny_repo)).id
    assert sid is not None
    pubsub = redis.Redis.from_url(redis_url).pubsub()  # type: ignore[no-untyped-call]
    pubsub.subscribe(fanout.channel(sid))
    fanout.enable(redis_url)
    try:
        assert _ping(pubsub, 0.5) is None  # nothing was committed yet
        _commit_event(settings.db_url, sid)
        got = _ping(pubsub)
        assert got is not None and got["channel"] == fanout.channel(sid).encode()
        # A process forked after this one's sender started sends with a thread of its own.
        child = multiprocessing.get_context("fork").Process(
            target=_commit_event_and_flush, args=(settings.db_url, sid)
        )
        child.start()
        child.join(30)
        assert child.exitcode == 0
        assert _ping(pubsub) is not None
        # A process that ends right after its commit still sends before it exits.
        script = (
            "import sys; from backend.core import fanout; from tests.integration.test_fanout import _commit_event; "
            f"fanout.enable({redis_url!r}); _commit_event({settings.db_url!r}, {sid})"
        )
        subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, check=True, timeout=60)
        assert _ping(pubsub) is not None
        with db.session(settings.db_url):
            pass  # a commit that added no event pings nobody
        assert _ping(pubsub, 0.5) is None
    finally:
        fanout.enable("")
        pubsub.close()
