"""The ledger of LLM calls: a hold on the budget before each call, every call recorded with its prompt."""

from __future__ import annotations

import copy
from typing import Any, Protocol

from sqlmodel import Session

from agents.failures import Blame
from agents.llm.model import BudgetExhausted, Turn
from backend.core.models import LlmCall


class JobStore(Protocol):
    """The calls of a job's store the ledger makes (the engine's `JobStore` has them)."""

    def llm_reserve(self, usd: float, tokens: int) -> dict[str, Any]: ...
    def llm_release(self, hold: int) -> None: ...
    def llm_record(self, call: dict[str, Any], hold: int | None = None) -> int: ...
    def event(self, kind: str, node_id: int | None, payload: dict[str, Any]) -> None: ...


class StoreLedger:
    """Charges calls to a study (and a node, for executor calls) through a job store."""

    def __init__(self, store: JobStore, node_id: int | None = None) -> None:
        self.store, self.node_id = store, node_id
        self._last: dict[str, tuple[int, list[dict[str, Any]]]] = {}  # role -> its last call and prompt

    def reserve(self, usd: float, tokens: int) -> int | None:
        """Hold a call's worst case against the study's budgets, or raise BudgetExhausted."""
        answer = self.store.llm_reserve(usd, tokens)
        if answer.get("refused"):
            raise BudgetExhausted(str(answer["refused"]), Blame(answer.get("budget") or Blame.USD))
        return int(answer["hold"])

    def release(self, hold: int | None) -> None:
        """Drop the hold of a call that failed."""
        if hold is not None:
            self.store.llm_release(hold)

    def record(
        self, role: str, model: str, messages: list[dict[str, Any]], turn: Turn, hold: int | None = None
    ) -> None:
        """Store the call with its prompt and charge it to the node and the study.

        A conversation re-sends its history every turn; only the messages that the role's previous
        call did not already store are written, so storage grows with the conversation, not its square.
        """
        base_id, base = self._last.get(role, (None, []))
        shared = len(base) if base and messages[: len(base)] == base else 0
        call_id = self.store.llm_record(
            {
                "node_id": self.node_id, "role": role, "model": model, "base_id": base_id if shared else None,
                "base_len": shared, "messages": messages[shared:], "response": turn.message(),
                "tokens_in": turn.tokens_in, "tokens_out": turn.tokens_out, "usd": turn.usd, "seconds": turn.seconds,
            },
            hold,
        )  # fmt: skip
        self._last[role] = (call_id, copy.deepcopy(messages))  # the loop may shorten old messages in place

    def refused(self, role: str, node_id: int | None, reason: str, answer: str, tries: str = "") -> None:
        """Record a model answer Grove could not use as an `llm.refused` event, on its node if it has one."""
        payload = {"role": role, "reason": reason[:1000], "answer": answer[:500]}
        self.store.event(
            "llm.refused",
            node_id if node_id is not None else self.node_id,
            payload | ({"try": tries} if tries else {}),
        )


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
