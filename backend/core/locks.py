"""Redis locks with a lease that is renewed while the holder works."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from functools import lru_cache

import redis


class Busy(RuntimeError):
    """Another process holds the lock."""


@lru_cache(maxsize=4)
def client(url: str) -> redis.Redis:
    """Return a Redis client for a URL."""
    return redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=10)


@contextmanager
def lease(url: str, name: str, ttl: float = 30.0) -> Iterator[None]:
    """Hold `name` while the block runs, renewing it every ttl/3 so a dead holder frees it within ttl."""
    lock = client(url).lock(name, timeout=ttl, blocking=False, thread_local=False)
    if not lock.acquire(blocking=False):
        raise Busy(name)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(ttl / 3):
            try:
                lock.reacquire()
            except Exception:
                return

    t = threading.Thread(target=renew, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=5)
        with suppress(Exception):
            lock.release()


def coalesced(
    url: str, name: str, ttl: float, step: Callable[[], bool], requeue: Callable[[float | None], None]
) -> bool:
    """Run `step` under the lock `name`, again while others asked for it; return False if it was busy.

    A caller that finds the lock held does not retry on a timer: it leaves one request
    (`<name>:again`) that the holder serves by running `step` once more before it lets go, so any
    number of callers cost the holder one more run. `step` returns True when there is nothing
    left to do. The holder checks for a request once more after letting go, and a caller that
    found the lock busy checks whether it is still held, so a request made in between is never
    lost: one of the two calls `requeue(None)`. Should the holder have died, its lease runs out
    unrenewed and nobody serves the request: so the first busy caller of each lease also calls
    `requeue(delay)` with the seconds the lease has left.
    """
    r = client(url)
    again = f"{name}:again"
    try:
        with lease(url, name, ttl):
            while True:
                r.delete(again)
                if step():
                    r.delete(again)
                    return True
                if not r.exists(again):
                    break
    except Busy:
        r.set(again, "1", ex=max(60, int(10 * ttl)))
        left = int(r.pttl(name))  # milliseconds; -2 once the lock is gone, -1 for a key without expiry
        if left == -2:
            requeue(None)
            return False
        wait = left if left > 0 else int(ttl * 1000)
        if r.set(f"{name}:later", "1", nx=True, px=wait):
            requeue(wait / 1000 + 0.5)
        return False
    if r.exists(again):
        requeue(None)
    return True
