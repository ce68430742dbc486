"""The SQL ledger of LLM calls: budget checked before each call, every call recorded with its prompt."""

from __future__ import annotations

from typing import Any

from sqlmodel import Session, func, select

from agents.policies.llm.model import BudgetExhausted, Turn
from backend.core import db
from backend.core.config import Settings
from backend.core.models import LlmCall, Node, Study
from backend.services.records import add_event, spec_of


def spent(settings: Settings, study_id: int) -> float:
    """Return the USD a study's LLM calls have cost."""
    with db.session(settings.db_url) as s:
        return float(
            s.exec(
                select(func.coalesce(func.sum(LlmCall.usd), 0.0)).where(LlmCall.study_id == study_id)
            ).one()
        )


class SqlLedger:
    """Charges calls to a study (and a node, for executor calls)."""

    def __init__(self, settings: Settings, study_id: int, node_id: int | None = None) -> None:
        self.settings, self.study_id, self.node_id = settings, study_id, node_id
        self._last: dict[str, tuple[int, list[dict[str, Any]]]] = {}  # role -> its last call and prompt
        with db.session(settings.db_url) as s:
            st = s.get(Study, study_id)
            assert st is not None
            self.budget = spec_of(st).budget.usd

    def check(self) -> None:
        """Refuse the call when the study's USD budget is spent."""
        used = spent(self.settings, self.study_id)
        if used >= self.budget:
            raise BudgetExhausted(f"LLM budget spent: ${used:.4g} of ${self.budget:.4g}")

    def record(self, role: str, model: str, messages: list[dict[str, Any]], turn: Turn) -> None:
        """Store the call with its prompt and charge it to the node and the study.

        A conversation re-sends its history every turn; only the messages that the role's previous
        call did not already store are written, so storage grows with the conversation, not its square.
        """
        base_id, base = self._last.get(role, (None, []))
        shared = len(base) if base and messages[: len(base)] == base else 0
        with db.session(self.settings.db_url) as s:
            call = LlmCall(
                study_id=self.study_id, node_id=self.node_id, role=role, model=model,
                base_id=base_id if shared else None, base_len=shared, messages=messages[shared:],
                response=turn.message(), tokens_in=turn.tokens_in, tokens_out=turn.tokens_out, usd=turn.usd,
            )  # fmt: skip
            s.add(call)
            s.flush()
            assert call.id is not None
            self._last[role] = (call.id, list(messages))
            if self.node_id is not None:
                node = s.get(Node, self.node_id)
                if node is not None:
                    cost = dict(node.cost)
                    cost["tokens"] = int(cost.get("tokens", 0)) + turn.tokens_in + turn.tokens_out
                    cost["usd"] = float(cost.get("usd", 0.0)) + turn.usd
                    cost["calls"] = int(cost.get("calls", 0)) + 1
                    node.cost = cost
                    s.add(node)
            add_event(
                s, self.study_id, "llm.call", self.node_id, role=role, model=model,
                tokens=turn.tokens_in + turn.tokens_out, usd=turn.usd,
            )  # fmt: skip


def prompt_of(s: Session, call: LlmCall) -> list[dict[str, Any]]:
    """Return the whole prompt a call sent, rebuilt from the calls it extends."""
    parts: list[tuple[int, list[dict[str, Any]]]] = []
    at: LlmCall | None = call
    while at is not None:
        parts.append((at.base_len, list(at.messages)))
        at = s.get(LlmCall, at.base_id) if at.base_id is not None else None
    prompt: list[dict[str, Any]] = []
    for keep, messages in reversed(parts):
        prompt = prompt[:keep] + messages
    return prompt
