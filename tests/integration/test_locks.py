"""Coalesced steps over a real Redis: callers that find a study busy leave one request, not a retry loop."""

from __future__ import annotations

import threading
import uuid

import redis

from backend.core.locks import coalesced


def test_busy_callers_cost_the_holder_one_more_step_and_leave_one_late_nudge(redis_url: str) -> None:
    name = f"grove:test:{uuid.uuid4().hex}"
    inside, release = threading.Event(), threading.Event()
    steps: list[int] = []
    requeued: list[tuple[str, float | None]] = []

    def holder_step() -> bool:
        steps.append(len(steps))
        if len(steps) == 1:  # the first step is slow; callers arrive meanwhile
            inside.set()
            assert release.wait(30)
        return False

    results: list[bool] = []
    holder = threading.Thread(
        target=lambda: results.append(
            coalesced(redis_url, name, 10, holder_step, lambda delay: requeued.append(("h", delay)))
        )
    )
    holder.start()
    assert inside.wait(30)
    busy = [
        coalesced(redis_url, name, 10, lambda: True, lambda delay: requeued.append(("c", delay)))
        for _ in range(5)
    ]
    assert busy == [False] * 5
    release.set()
    holder.join(30)
    assert results == [True]
    assert steps == [0, 1]  # five requests, one more step
    # No caller re-sent itself now, and the holder left nothing over: only the first busy caller
    # asked for one nudge once the holder's lease would have run out, should it have died.
    assert len(requeued) == 1 and requeued[0][0] == "c"
    assert requeued[0][1] is not None and 5 < requeued[0][1] <= 10.5
    assert not redis.Redis.from_url(redis_url).exists(f"{name}:again")


def test_a_request_left_with_a_dead_holder_is_sent_again_when_its_lease_runs_out(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    name = f"grove:test:{uuid.uuid4().hex}"
    r.set(name, "a holder that was killed", px=3000)  # its lease is never renewed again
    requeued: list[float | None] = []
    assert coalesced(redis_url, name, 10, lambda: True, requeued.append) is False
    assert coalesced(redis_url, name, 10, lambda: True, requeued.append) is False
    assert len(requeued) == 1 and requeued[0] is not None and 2 < requeued[0] <= 3.5
    assert r.exists(f"{name}:again")
    # Once the lease is gone, the next caller runs the step itself, which serves the request.
    r.delete(name)
    steps: list[int] = []
    assert coalesced(redis_url, name, 10, lambda: steps.append(1) is None, requeued.append) is True
    assert steps == [1] and not r.exists(f"{name}:again")
