"""Low-latency event fan-out: after a commit that added events, ping the study's Redis channel.

The events table stays the record; the ping only wakes SSE streams in other processes early.
Processes that have Redis (API, workers) turn it on with `enable(redis_url)`; elsewhere it is off.
"""

from __future__ import annotations

import contextlib

from backend.core.locks import client

_url: str | None = None


def enable(redis_url: str) -> None:
    """Publish a ping per study after each commit that added events."""
    global _url
    _url = redis_url


def channel(study_id: int) -> str:
    """Return the channel name of a study's event pings."""
    return f"grove:events:{study_id}"


def notify(study_ids: set[int]) -> None:
    """Ping the channels of these studies (best effort: readers poll as a fallback)."""
    if not _url or not study_ids:
        return
    with contextlib.suppress(Exception):
        r = client(_url)
        for sid in study_ids:
            r.publish(channel(sid), "1")
