"""The choices a distillation takes (no torch here: the API checks a job's parameters without it)."""

from __future__ import annotations

from enum import StrEnum


class Method(StrEnum):
    SDPO = "sdpo"  # distil toward the model shown the feedback
    CANON = "canon"  # distil toward the model shown the group's consensus


class Teacher(StrEnum):
    EMA = "ema"  # an exponential moving average of the student
    TRUST_REGION = "trust_region"  # a mix of the current model and a frozen reference
    FROZEN = "frozen"  # a snapshot taken at the start


class Support(StrEnum):
    """Which tokens the divergence sums over."""

    FULL = "full"
    TOPK = "topk"
    SAMPLED = "sampled"
