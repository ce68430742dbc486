"""Coordinator knobs that are not part of the study spec."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CoordinatorConfig:
    exploration: float = 0.02
    per_parent: int = 2
    max_attempts: int = 2
    prune_window: int = 3
