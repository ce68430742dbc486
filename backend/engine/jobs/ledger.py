"""A job's model calls against the study's LLM budget: holds, releases, records."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from sqlmodel import col, func, select

from agents.failures import Blame
from backend.core import db
from backend.core.models import LlmCall, LlmHold, Node, Study, now
from backend.engine.jobs.base import StoreBase
from backend.engine.jobs.claims import (
    Refused,
)
from backend.services.records import add_event, spec_of

HOLD_LIFETIME = timedelta(hours=1)  # a hold older than this belongs to a call that died
LLM_FIELDS = frozenset({"node_id", "role", "model", "base_id", "base_len", "messages", "response",
                        "tokens_in", "tokens_out", "usd", "seconds"})  # fmt: skip


class LlmLedger(StoreBase):
    """A job's model calls against the study's LLM budget: holds, releases, records."""

    def llm_reserve(self, usd: float, tokens: int) -> dict[str, Any]:
        """Hold a call's worst case against the study's budgets: `{"hold": id}`, or `{"refused": why}`.

        Holds of one study are taken one at a time (the insert takes SQLite's write lock, the row
        lock on the study PostgreSQL's), so calls in flight together can never overspend.
        """
        if not all(isinstance(v, int | float) and v >= 0 for v in (usd, tokens)):
            raise Refused("a hold needs non-negative usd and tokens")
        with db.session(self.settings.db_url) as s:
            hold = LlmHold(study_id=self.study_id, usd=float(usd), tokens=int(tokens))
            s.add(hold)
            s.flush()
            study = s.exec(select(Study).where(Study.id == self.study_id).with_for_update()).one()
            budget = spec_of(study).budget
            spent_usd, spent_tokens = s.exec(
                select(
                    func.coalesce(func.sum(LlmCall.usd), 0.0),
                    func.coalesce(func.sum(LlmCall.tokens_in + LlmCall.tokens_out), 0),
                ).where(LlmCall.study_id == self.study_id)
            ).one()
            held_usd, held_tokens = s.exec(
                select(
                    func.coalesce(func.sum(LlmHold.usd), 0.0), func.coalesce(func.sum(LlmHold.tokens), 0)
                ).where(LlmHold.study_id == self.study_id, col(LlmHold.created_at) >= now() - HOLD_LIFETIME)
            ).one()
            why, spent = "", Blame.USD
            if budget.usd > 0 and float(spent_usd) + float(held_usd) > budget.usd:
                why = (
                    f"LLM budget spent: ${float(spent_usd):.4g} of ${budget.usd:.4g} charged, "
                    f"${float(held_usd) - usd:.4g} held by calls in flight, and this call may cost ${usd:.4g}"
                )
            elif budget.tokens and int(spent_tokens) + int(held_tokens) > budget.tokens:
                why, spent = (
                    (
                        f"LLM budget spent: {int(spent_tokens)} of {budget.tokens} tokens used, "
                        f"{int(held_tokens) - tokens} held by calls in flight, and this call may take {tokens}"
                    ),
                    Blame.TOKENS,
                )
            if why:
                s.delete(hold)
                return {"refused": why, "budget": spent}
            return {"hold": hold.id}

    def llm_release(self, hold: int) -> None:
        """Drop the hold of a call that failed (nothing to charge)."""
        with db.session(self.settings.db_url) as s:
            row = s.get(LlmHold, hold)
            if row is not None and row.study_id == self.study_id:
                s.delete(row)

    def llm_record(self, call: dict[str, Any], hold: int | None = None) -> int:
        """Store one LLM call (its new messages only), charge it to the node and the study, drop its hold."""
        bad = set(call) - LLM_FIELDS
        costs = [call.get(k, 0) for k in ("tokens_in", "tokens_out", "usd", "base_len", "seconds")]
        if bad or not all(isinstance(c, int | float) and math.isfinite(c) and c >= 0 for c in costs):
            raise Refused(f"an LLM call may not carry {sorted(bad)} or negative counts")
        with db.session(self.settings.db_url) as s:
            # The study's lock, as `llm_reserve` takes it: a hold becomes a charge in one step for it.
            s.exec(select(Study.id).where(Study.id == self.study_id).with_for_update()).one()
            held = s.get(LlmHold, hold) if hold is not None else None
            if held is not None and held.study_id == self.study_id:
                s.delete(held)
            node_id = call.get("node_id")
            if node_id is not None:
                self._node(s, node_id)
            base_id = call.get("base_id")
            base = s.get(LlmCall, base_id) if base_id is not None else None
            if base_id is not None and (base is None or base.study_id != self.study_id):
                raise Refused(f"LLM call {base_id} is not a call of study {self.study_id}")
            seconds = float(call.get("seconds", 0.0))  # how long the call took: in its event, not its row
            row = LlmCall.model_validate(
                {**{k: v for k, v in call.items() if k != "seconds"}, "study_id": self.study_id}
            )
            s.add(row)
            s.flush()
            assert row.id is not None
            if node_id is not None:
                node = s.get(Node, node_id)
                assert node is not None
                cost = dict(node.cost)
                cost["tokens"] = int(cost.get("tokens", 0)) + row.tokens_in + row.tokens_out
                cost["usd"] = float(cost.get("usd", 0.0)) + row.usd
                cost["calls"] = int(cost.get("calls", 0)) + 1
                node.cost = cost
                s.add(node)
            add_event(
                s, self.study_id, "llm.call", node_id, role=row.role, model=row.model,
                tokens=row.tokens_in + row.tokens_out, usd=row.usd, seconds=round(seconds, 3),
            )  # fmt: skip
            return row.id
