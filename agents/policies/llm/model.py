"""The model seam: one chat call with optional tools, through litellm, with a cost ledger.

Exceptions::

    ModelError            a call failed after retries (timeout, rate limit, bad response)
    BudgetExhausted       the study's USD budget is spent; no call was made
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


class ModelError(RuntimeError):
    """A model call failed after its retries."""


class BudgetExhausted(RuntimeError):
    """The study's LLM budget is spent."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # raw JSON text as the model wrote it


@dataclass(frozen=True)
class Turn:
    content: str
    tool_calls: list[ToolCall]
    tokens_in: int
    tokens_out: int
    usd: float
    raw: dict[str, Any] = field(default_factory=dict)

    def message(self) -> dict[str, Any]:
        """Return the assistant message to append to the conversation."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        return msg


class Ledger(Protocol):
    """Where calls are charged: checks the budget before a call and records it after."""

    def check(self) -> None: ...

    def record(self, role: str, model: str, messages: list[dict[str, Any]], turn: Turn) -> None: ...


class Model(Protocol):
    """Anything that answers a conversation, optionally with tool calls."""

    name: str

    def complete(
        self, role: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> Turn: ...


@dataclass
class ModelConfig:
    model: str
    api_base: str | None = None
    api_key: str | None = None
    timeout: float = 120.0
    retries: int = 3
    backoff: float = 1.0
    temperature: float | None = None
    prices: dict[str, float] | None = None  # input_cost_per_token, output_cost_per_token


class LitellmModel:
    """Calls any provider litellm knows, hosted or an OpenAI-compatible local server."""

    def __init__(self, config: ModelConfig, ledger: Ledger) -> None:
        self.config, self.ledger = config, ledger
        self.name = config.model
        import litellm

        litellm.suppress_debug_info = True
        if config.prices:
            litellm.register_model(
                {
                    config.model: {
                        **config.prices,
                        "litellm_provider": config.model.split("/")[0],
                        "mode": "chat",
                    }
                }
            )
        self._litellm = litellm

    def complete(
        self, role: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> Turn:
        """Make one call (retried with backoff on transient errors) and charge it."""
        self.ledger.check()
        kwargs: dict[str, Any] = {
            "model": self.config.model,
            "messages": messages,
            "timeout": self.config.timeout,
        }
        if tools:
            kwargs["tools"] = tools
            kwargs["tool_choice"] = "auto"
        if self.config.api_base:
            kwargs["api_base"] = self.config.api_base
        if self.config.api_key:
            kwargs["api_key"] = self.config.api_key
        if self.config.temperature is not None:
            kwargs["temperature"] = self.config.temperature
        last: Exception | None = None
        for attempt in range(self.config.retries + 1):
            try:
                resp = self._litellm.completion(**kwargs)
                break
            except Exception as exc:
                last = exc
                if attempt < self.config.retries and _transient(exc):
                    time.sleep(self.config.backoff * 2**attempt)
                    continue
                raise ModelError(f"{type(exc).__name__}: {str(exc)[:500]}") from exc
        else:  # pragma: no cover - the loop always breaks or raises
            raise ModelError(str(last))
        turn = _turn(resp, self._cost(resp))
        self.ledger.record(role, self.config.model, messages, turn)
        return turn

    def _cost(self, resp: Any) -> float:
        try:
            return float(self._litellm.completion_cost(completion_response=resp))
        except Exception:
            return 0.0


def _transient(exc: Exception) -> bool:
    name = type(exc).__name__
    return name in {
        "RateLimitError",
        "Timeout",
        "APIConnectionError",
        "ServiceUnavailableError",
        "InternalServerError",
    }


def _turn(resp: Any, usd: float) -> Turn:
    choice = resp.choices[0]
    msg = choice.message
    calls = []
    for i, c in enumerate(getattr(msg, "tool_calls", None) or []):
        calls.append(ToolCall(c.id or f"call_{i}", c.function.name or "", c.function.arguments or ""))
    usage = getattr(resp, "usage", None)
    return Turn(
        content=msg.content or "",
        tool_calls=calls,
        tokens_in=int(getattr(usage, "prompt_tokens", 0) or 0),
        tokens_out=int(getattr(usage, "completion_tokens", 0) or 0),
        usd=usd,
        raw=json.loads(resp.model_dump_json()) if hasattr(resp, "model_dump_json") else {},
    )
