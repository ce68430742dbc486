"""Run a study to the end in this process, with the local process pool as dispatcher."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agents.policies.base import Policy
from agents.tree.status import StudyStatus
from backend.cli.localpool import LocalPool
from backend.core import db
from backend.core.config import Settings
from backend.engine.driver import Driver, study_status
from backend.services.approvals import decide_approval

Approver = Callable[[int, int], dict[str, Any]]


def run_study(
    settings: Settings,
    study_id: int,
    *,
    approver: Approver,
    tick: Callable[[], None] | None = None,
    policy: Policy | None = None,
) -> str:
    """Run (or resume) a study until it finishes; return its final status."""
    pool = LocalPool(settings)
    driver = Driver(settings, study_id, pool, policy)
    try:
        pool.reconcile(study_id)
        while True:
            waiting = driver.advance()
            if waiting.finished:
                break
            if waiting.approval_node is not None:
                answer = approver(study_id, waiting.approval_node)
                with db.session(settings.db_url) as s:
                    decided = decide_approval(
                        s,
                        waiting.approval_node,
                        approved=bool(answer.get("approved")),
                        by=str(answer.get("by") or "terminal"),
                        reason=str(answer.get("reason") or ""),
                    )
                if decided:
                    continue
            if waiting.jobs:
                pool.wait_any(
                    waiting.jobs,
                    tick=tick,
                    interrupted=lambda: study_status(settings, study_id) == StudyStatus.STOPPING,
                )
            elif waiting.paused or waiting.approval_node is not None:
                if tick:
                    tick()
                time.sleep(1.0)
    finally:
        pool.shutdown()
    return study_status(settings, study_id)
