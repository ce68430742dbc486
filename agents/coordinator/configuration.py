"""Coordinator knobs that are not part of the study spec, and the graph's run context."""

from __future__ import annotations

from dataclasses import dataclass, field

from agents.coordinator.ports import Dispatcher, SealedTests, Storage, Trunk
from agents.policies.base import Policy


@dataclass(frozen=True)
class CoordinatorConfig:
    exploration: float = 0.02
    per_parent: int = 2
    max_attempts: int = 2
    # More attempts for a node whose last one failed for a format or infrastructure reason (`blameless`).
    blameless_attempts: int = 2
    prune_window: int = 3


@dataclass(frozen=True, kw_only=True)
class CoordinatorContext:
    """What every node reaches through `runtime.context`: the ports, the policy and the knobs.

    LangGraph does not checkpoint the context, so every `invoke`, resumes included, passes it.
    """

    storage: Storage
    dispatcher: Dispatcher
    sealed: SealedTests  # the held-out baseline and gates
    trunk: Trunk  # approvals, merges, rejections and the study's end
    policy: Policy
    config: CoordinatorConfig = field(default_factory=CoordinatorConfig)
