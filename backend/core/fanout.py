"""Low-latency event fan-out: after a commit that added events, ping the study's Redis channel.

The events table stays the record; the ping only wakes SSE streams in other processes early.
Processes that have Redis (API, workers) turn it on with `enable(redis_url)`; elsewhere it is off.
Pings are sent by a thread of the process, so that a commit never waits for Redis: a coordinator
step commits a dozen times, and on a busy machine each round trip costs a scheduling delay.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading

from backend.core.locks import client

_url: str | None = None
_pending: set[int] = set()
_wake = threading.Condition()
_sender: int | None = None  # the id of the process whose thread sends (threads do not survive a fork)
_busy = False  # the thread is sending


def enable(redis_url: str) -> None:
    """Publish a ping per study after each commit that added events."""
    global _url
    _url = redis_url


def channel(study_id: int) -> str:
    """Return the channel name of a study's event pings."""
    return f"grove:events:{study_id}"


def notify(study_ids: set[int]) -> None:
    """Have the channels of these studies pinged soon (best effort: readers poll as a fallback)."""
    global _sender
    if not _url or not study_ids:
        return
    with _wake:
        _pending.update(study_ids)
        if _sender != os.getpid():
            try:
                threading.Thread(target=_send, name="grove-fanout", daemon=True).start()
            except RuntimeError:  # no thread to be had (the process is ending): the pings wait
                return
            _sender = os.getpid()
        _wake.notify_all()


def flush(timeout: float = 1.0) -> bool:
    """Wait until every ping asked for was sent (at most `timeout` seconds); say whether they were."""
    with _wake:
        return _wake.wait_for(lambda: not _pending and not _busy, timeout)


def _send() -> None:
    global _busy
    while True:
        with _wake:
            _wake.wait_for(lambda: bool(_pending))
            ids = sorted(_pending)
            _pending.clear()
            url, _busy = _url, True
        try:
            if url is not None:
                with contextlib.suppress(Exception):
                    r = client(url)
                    for sid in ids:
                        r.publish(channel(sid), "1")
        finally:
            with _wake:
                _busy = False
                _wake.notify_all()


def _forked() -> None:
    """In a forked child: a fresh lock and queue (the parent's thread, and any lock it held, stay behind)."""
    global _wake, _sender, _busy
    _wake, _sender, _busy = threading.Condition(), None, False
    _pending.clear()


os.register_at_fork(after_in_child=_forked)
atexit.register(flush)  # an interpreter that ends right after a commit still sends its pings
