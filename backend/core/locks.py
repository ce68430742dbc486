"""Redis locks with a lease that is renewed while the holder works."""

from __future__ import annotations

import threading
from collections.abc import Iterator
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
