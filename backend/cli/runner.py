"""Run a study to the end in this process, with the local process pool as dispatcher."""

from __future__ import annotations

import threading
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


class Question:
    """The approver asked about one node on a thread of its own, so the study goes on meanwhile."""

    def __init__(self, approver: Approver, study_id: int, node_id: int) -> None:
        self.node_id = node_id
        self.answered = threading.Event()
        self._answer: dict[str, Any] = {}
        self._error: BaseException | None = None
        # A daemon: a study that ends while the question is open does not wait for its answer.
        threading.Thread(target=self._ask, args=(approver, study_id), daemon=True, name="approver").start()

    def _ask(self, approver: Approver, study_id: int) -> None:
        try:
            self._answer = approver(study_id, self.node_id)
        except BaseException as exc:  # re-raised where the answer is read
            self._error = exc
        finally:
            self.answered.set()

    def answer(self) -> dict[str, Any]:
        """Return the approver's answer (raise what the approver raised)."""
        if self._error is not None:
            raise self._error
        return self._answer


def run_study(
    settings: Settings,
    study_id: int,
    *,
    approver: Approver,
    tick: Callable[[], None] | None = None,
    policy: Policy | None = None,
) -> str:
    """Run (or resume) a study until it finishes; return its final status.

    A node awaiting approval is asked about while the study keeps exploring on the current trunk.
    """
    pool = LocalPool(settings)
    driver = Driver(settings, study_id, pool, policy)
    question: Question | None = None

    def answered() -> bool:
        return question is not None and question.answered.is_set()

    try:
        pool.reconcile(study_id)
        while True:
            waiting = driver.advance()
            if waiting.finished:
                break
            if question is not None and answered():
                answer, node_id, question = question.answer(), question.node_id, None
                with db.session(settings.db_url) as s:
                    decide_approval(
                        s,
                        node_id,
                        approved=bool(answer.get("approved")),
                        by=str(answer.get("by") or "terminal"),
                        reason=str(answer.get("reason") or ""),
                    )
                continue
            # One question at a time: the terminal has one reader. A question whose node was decided
            # elsewhere meanwhile is answered first; its answer then changes nothing.
            if waiting.approval_node is not None and question is None:
                question = Question(approver, study_id, waiting.approval_node)
            if waiting.jobs:
                pool.wait_any(
                    waiting.jobs,
                    tick=tick,
                    interrupted=lambda: (
                        answered() or study_status(settings, study_id) == StudyStatus.STOPPING
                    ),
                )
            elif question is not None:
                if tick:
                    tick()
                question.answered.wait(timeout=1.0)
            elif waiting.paused:
                if tick:
                    tick()
                time.sleep(1.0)
        if question is not None and answered():
            question.answer()  # an approver that failed fails the run, even once the study ended
    finally:
        pool.shutdown()
    return study_status(settings, study_id)
