"""A worker's disk: room made before each job once the data folder's file system passes a high-water mark.

First the copies of studies that ended go (on a remote worker, the API says which), then
environment builds nobody is using, least recently used first, until the disk is below the mark.
`grove janitor` also removes the builds nobody has used for `GROVE_ENV_IDLE_DAYS` days.
A build in use (a shared lock, see `environment`) is never removed; a later job that needs a
removed build builds it again.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from backend.core.config import Settings
from backend.engine import environment

log = logging.getLogger(__name__)


def used(path: Path) -> float:
    """Return the share (0..1) of the file system holding `path` that is in use."""
    path.mkdir(parents=True, exist_ok=True)
    du = shutil.disk_usage(path)
    return du.used / du.total if du.total else 0.0


def builds(settings: Settings) -> list[Path]:
    """Return every environment build on this machine, least recently used first."""
    envs = settings.data_dir / "envs"
    found = (
        [b for study in envs.iterdir() if study.is_dir() for b in study.iterdir() if b.is_dir()]
        if envs.is_dir()
        else []
    )

    return sorted(found, key=last_use)


def last_use(build: Path) -> float:
    """Return when a build was last used (its `ready` stamp, else its lock or folder)."""
    for stamp in (build / "ready", build / "lock", build):
        try:
            return stamp.stat().st_mtime
        except FileNotFoundError:
            continue
    return 0.0


def _evict(build: Path) -> bool:
    """Remove a build nobody uses, and its repository's folder once it holds no build."""
    if not environment.evict(build):
        return False
    group = build.parent
    if group.is_dir() and not any(group.iterdir()):
        group.rmdir()
    return True


def prune_idle(settings: Settings, days: float) -> list[Path]:
    """Remove the builds nobody has used for `days` days (and nobody uses now); return them."""
    cutoff = time.time() - days * 86400
    return [b for b in builds(settings) if last_use(b) < cutoff and _evict(b)]


def make_room(settings: Settings, forget_ended: Callable[[], list[Path]] | None = None) -> list[Path]:
    """Free disk while the data folder's file system is above `disk_high_water`; return what was removed."""
    mark = settings.disk_high_water
    if used(settings.data_dir) <= mark:
        return []
    removed: list[Path] = []
    if forget_ended is not None:
        try:
            removed += forget_ended()
        except Exception as exc:  # the API is away: builds can still go
            log.warning("could not ask which studies ended: %s", exc)
    for build in builds(settings):
        if used(settings.data_dir) <= mark:
            break
        if _evict(build):
            removed.append(build)
    share = used(settings.data_dir)
    if removed:
        log.info(
            "disk above %.0f%%: removed %d folders, now %.0f%% used", mark * 100, len(removed), share * 100
        )
    if share > mark:
        log.warning(
            "the disk of %s is %.0f%% full (GROVE_DISK_HIGH_WATER %.0f%%) and nothing more can go: "
            "every environment build left is in use",
            settings.data_dir, share * 100, mark * 100,
        )  # fmt: skip
    return removed
