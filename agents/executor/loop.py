"""The executor's ReAct loop (Thought → Action → Observation) over a model and a toolbox.

Exceptions::

    ExecutorError
     ├── LimitReached      turn, token or wall-clock limit hit before finish()
     └── (ModelError, BudgetExhausted come from the model seam)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from agents.executor.tools import TOOLS, Submitted, Toolbox
from agents.policies.llm.model import Model


class ExecutorError(RuntimeError):
    """The executor stopped without finishing."""


class LimitReached(ExecutorError):
    """A turn, token or time limit was reached."""


@dataclass(frozen=True)
class Limits:
    turns: int = 30
    tokens: int = 400_000
    seconds: float = 1800.0


@dataclass
class Transcript:
    messages: list[dict[str, Any]] = field(default_factory=list)
    feedback: list[str] = field(default_factory=list)  # errors and evaluation results the executor saw
    tokens: int = 0
    turns: int = 0


def run(
    model: Model,
    toolbox: Toolbox,
    system: str,
    task: str,
    limits: Limits = Limits(),
    tr: Transcript | None = None,
) -> str:
    """Run until the model calls finish(report) and return the report; `tr` records the conversation."""
    tr = tr if tr is not None else Transcript()
    tr.messages[:] = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    started = time.monotonic()
    while True:
        if tr.turns >= limits.turns:
            raise LimitReached(f"turn limit ({limits.turns}) reached before finish()")
        if tr.tokens >= limits.tokens:
            raise LimitReached(f"token limit ({limits.tokens}) reached before finish()")
        if time.monotonic() - started >= limits.seconds:
            raise LimitReached(f"time limit ({limits.seconds:g} s) reached before finish()")
        turn = model.complete("executor", tr.messages, TOOLS)
        tr.turns += 1
        tr.tokens += turn.tokens_in + turn.tokens_out
        tr.messages.append(turn.message())
        if not turn.tool_calls:
            tr.messages.append(
                {"role": "user", "content": "Act with a tool call; call finish(report) when done."}
            )
            continue
        for call in turn.tool_calls:
            try:
                args = json.loads(call.arguments or "{}")
                if not isinstance(args, dict):
                    raise ValueError("arguments must be a JSON object")
            except ValueError as exc:
                obs = (
                    f"error: malformed arguments for {call.name}: {exc}. Send the arguments as a JSON object."
                )
            else:
                try:
                    obs = toolbox.call(call.name, args)
                except Submitted as done:
                    tr.messages.append({"role": "tool", "tool_call_id": call.id, "content": "finished"})
                    return done.report
            if obs.startswith(("error:", "refused:")) or call.name in ("evaluate_dev", "run"):
                tr.feedback.append(f"{call.name}: {obs[:2000]}")
            tr.messages.append({"role": "tool", "tool_call_id": call.id, "content": obs})
