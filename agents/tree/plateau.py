"""Plateau detection over the sequence of completed experiments."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum


class PlateauLevel(IntEnum):
    NONE = 0
    WARN = 1
    CHANGE = 2
    STOP = 3


@dataclass(frozen=True)
class PlateauConfig:
    warn: int = 3
    change: int = 5
    stop: int = 8


def non_improving_streak(improved: Sequence[bool]) -> int:
    """Return how many experiments at the end of the sequence did not improve."""
    streak = 0
    for flag in reversed(improved):
        if flag:
            break
        streak += 1
    return streak


def plateau_level(improved: Sequence[bool], config: PlateauConfig) -> PlateauLevel:
    """Return the plateau level after the experiments so far (in completion order)."""
    streak = non_improving_streak(improved)
    if streak >= config.stop:
        return PlateauLevel.STOP
    if streak >= config.change:
        return PlateauLevel.CHANGE
    if streak >= config.warn:
        return PlateauLevel.WARN
    return PlateauLevel.NONE
