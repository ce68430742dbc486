"""Coalesced steps over a real Redis: callers that find a study busy leave one request, not a retry loop."""

from __future__ import annotations

import threading
import uuid

import redis

from backend.core.locks import coalesced


def test_busy_callers_cost_the_holder_one_more_step_and_nothing_is_requeued(redis_url: str) -> None:
    name = f"grove:test:{uuid.uuid4().hex}"
    inside, release = threading.Event(), threading.Event()
    steps: list[int] = []
    requeued: list[str] = []

    def holder_step() -> bool:
        steps.append(len(steps))
        if len(steps) == 1:  # the first step is slow; callers arrive meanwhile
            inside.set()
            assert release.wait(30)
        return False

    results: list[bool] = []
    holder = threading.Thread(
        target=lambda: results.append(
            coalesced(redis_url, name, 10, holder_step, lambda: requeued.append("h"))
        )
    )
    holder.start()
    assert inside.wait(30)
    busy = [coalesced(redis_url, name, 10, lambda: True, lambda: requeued.append("c")) for _ in range(5)]
    assert busy == [False] * 5
    release.set()
    holder.join(30)
    assert results == [True]
    assert steps == [0, 1]  # five requests, one more step
    assert requeued == []  # no caller re-sent itself, and nothing was left over
    assert not redis.Redis.from_url(redis_url).exists(f"{name}:again")
