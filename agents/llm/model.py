"""The model seam: one chat call with optional tools, through litellm, charged to a ledger.

Exceptions::

    ModelError            a call failed after retries (timeout, rate limit, bad response)
     ├── ContextTooLong   the provider says the prompt does not fit its context window
     └── ToolsUnsupported the server refused native tool calling (use the text action format)
    BudgetExhausted       the study's budget cannot cover the call; no call was made
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import os
import random
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from agents.failures import Blame, NoEvidence
from agents.llm import decoding

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

# Statuses worth another try: timeouts, conflicts, rate limits and server-side failures.
TRANSIENT_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 520, 522, 524, 529})
_FORMS: dict[tuple[str, str, str | None], list[decoding.Decoding]] = {}  # by (setting, model, server)
DEFAULT_INPUT_LIMIT = 32_000  # tokens, for a model litellm does not describe


class ModelError(RuntimeError, NoEvidence):
    """A model call failed after its retries."""


class ContextTooLong(ModelError):
    """The provider refused the prompt as longer than the model's context window."""


class ToolsUnsupported(ModelError):
    """The server refused a request because it carried native tool definitions."""


class BudgetExhausted(RuntimeError, NoEvidence):
    """The study's LLM budget cannot cover another call: `blame` says which, dollars or tokens."""

    def __init__(self, message: str, spent: Blame = Blame.USD) -> None:
        super().__init__(message)
        self.blame = spent


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
    finish_reason: str = "stop"  # "length": the answer was cut off by the output limit
    seconds: float = 0.0  # how long the call took, its retries included

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
    """Where calls are charged: a call's worst case is held against the budget, then settled."""

    def reserve(self, usd: float, tokens: int) -> int | None: ...

    def release(self, hold: int | None) -> None: ...

    def record(
        self, role: str, model: str, messages: list[dict[str, Any]], turn: Turn, hold: int | None = None
    ) -> None: ...


class Unbilled:
    """A ledger for calls that belong to no study (drafting a spec): nothing is held or charged."""

    def reserve(self, usd: float, tokens: int) -> int | None:
        """Hold nothing."""
        return None

    def release(self, hold: int | None) -> None:
        """Release nothing."""

    def record(
        self, role: str, model: str, messages: list[dict[str, Any]], turn: Turn, hold: int | None = None
    ) -> None:
        """Keep nothing."""


class Model(Protocol):
    """Anything that answers a conversation, optionally with tool calls."""

    name: str

    def complete(
        self,
        role: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        schema: dict[str, Any] | None = None,
    ) -> Turn:
        """Answer; `schema`, a JSON schema the answer's text should follow, is a hint a model may ignore."""
        ...


ToolMode = Literal["auto", "native", "text"]


@dataclass
class ModelConfig:
    model: str
    api_base: str | None = None
    api_key: str | None = None
    timeout: float = 120.0
    retries: int = 5
    backoff: float = 1.0  # seconds before the first retry; doubles each time, with jitter
    max_backoff: float = 60.0  # no wait is longer, whatever `Retry-After` asks
    temperature: float | dict[str, float] | None = (
        None  # one for every role, or by role (others: the server's)
    )
    prices: dict[str, float] | None = None  # input_cost_per_token, output_cost_per_token
    tool_mode: ToolMode = "auto"  # native function calling, the text action format, or ask litellm
    system_role: bool = True  # false: the system prompt is sent as the head of the first user message
    extra: dict[str, Any] = field(default_factory=dict)  # provider options passed through (num_ctx, ...)
    max_input_tokens: int | None = None  # None: litellm's figure for the model, else 32,000
    max_output_tokens: int = 4096
    decoding: str = "auto"  # how an answer's schema is sent (`decoding.SETTINGS`)


class LitellmModel:
    """Calls any provider litellm knows, hosted or an OpenAI-compatible local server."""

    def __init__(self, config: ModelConfig, ledger: Ledger) -> None:
        self.config, self.ledger = config, ledger
        self.name = config.model
        import litellm

        litellm.suppress_debug_info = True
        self._litellm = litellm
        info = model_info(config.model)
        # A spec's prices count only for a model litellm cannot price; they are applied here, never
        # registered with litellm (which would change the price for every study in the process).
        self.prices = config.prices if config.prices and unpriced_info(info) else None
        self.tool_mode: Literal["native", "text"] = (
            config.tool_mode
            if config.tool_mode != "auto"
            else "text"
            if info and info.get("supports_function_calling") is False
            else "native"
        )
        # The forms this server may take a schema in; one it refuses is dropped for the next call.
        # Shared by every model of this process on the same server: what it refused is not sent again.
        key = (config.decoding, config.model, config.api_base)
        self.forms = _FORMS.setdefault(key, list(decoding.candidates(*key)))
        known = (info or {}).get("max_input_tokens")
        self.input_limit = config.max_input_tokens or (int(known) if known else DEFAULT_INPUT_LIMIT)

    def count(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
        """Return the tokens a prompt takes, by the model's tokenizer where litellm knows it."""
        try:
            return int(self._litellm.token_counter(model=self.config.model, messages=messages, tools=tools))  # type: ignore[arg-type]
        except Exception:
            return len(json.dumps([messages, tools], ensure_ascii=False)) // 3

    def price(self, tokens_in: int, tokens_out: int) -> float:
        """Return what a call of this size costs, or 0.0 for a model without a price."""
        if self.prices:
            return tokens_in * self.prices.get("input_cost_per_token", 0.0) + tokens_out * self.prices.get(
                "output_cost_per_token", 0.0
            )
        try:
            a, b = self._litellm.cost_per_token(
                model=self.config.model, prompt_tokens=tokens_in, completion_tokens=tokens_out
            )
            return float(a) + float(b)
        except Exception:
            return 0.0

    def complete(
        self,
        role: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        schema: dict[str, Any] | None = None,
    ) -> Turn:
        """Make one call (retried on transient errors), holding its worst-case cost until it is charged.

        With `schema`, the answer is asked for in the first form of `self.forms` (`decoding`).
        """
        sent = messages if self.config.system_role else fold_system(messages)
        tokens_in = self.count(sent, tools)
        hold = self.ledger.reserve(
            self.price(tokens_in, self.config.max_output_tokens), tokens_in + self.config.max_output_tokens
        )
        began = time.monotonic()
        try:
            resp = self._call(sent, tools, role, schema)
            try:
                turn = _turn(resp, 0.0)
            except (AttributeError, IndexError, TypeError, ValueError) as exc:
                raise ModelError(
                    f"the provider's answer has no message ({type(exc).__name__}: {exc})"
                ) from exc
        except BaseException:
            self.ledger.release(hold)
            raise
        turn = replace(
            turn,
            usd=self.price(turn.tokens_in, turn.tokens_out) if self.prices else self._cost(resp),
            seconds=time.monotonic() - began,
        )
        self.ledger.record(role, self.config.model, messages, turn, hold)
        return turn

    def _call(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        role: str = "",
        schema: dict[str, Any] | None = None,
    ) -> Any:
        kwargs: dict[str, Any] = {
            **self.config.extra,
            "model": self.config.model,
            "messages": messages,
            "timeout": self.config.timeout,
            "max_tokens": self.config.max_output_tokens,
            "max_retries": 0,  # the provider client's own retries would hide statuses from ours
        }
        if tools:
            kwargs["tools"] = tools  # no tool_choice: "auto" is the default, and some servers refuse it
        if self.config.api_base:
            kwargs["api_base"] = self.config.api_base
        if self.config.api_key:
            kwargs["api_key"] = self.config.api_key
        temperature = self.config.temperature
        if isinstance(temperature, dict):
            temperature = temperature.get(role)
        if temperature is not None:
            kwargs["temperature"] = temperature
        attempt = 0
        while True:
            form = self.forms[0] if schema is not None and self.forms else decoding.Decoding.NONE
            try:
                return self._litellm.completion(
                    **kwargs, **decoding.fields(form, role or "answer", schema or {})
                )
            except Exception as exc:
                if fatal(exc):
                    raise
                text = f"{type(exc).__name__}: {str(exc)[:500]}"
                if form is not decoding.Decoding.NONE and decoding.refuses(
                    status_of(exc), str(exc), len(self.forms) > 1, form
                ):
                    with contextlib.suppress(ValueError):  # another call may have dropped it just now
                        self.forms.remove(form)  # this server does not take that form: the next, or none
                    continue
                if type(exc).__name__ == "ContextWindowExceededError":
                    raise ContextTooLong(text) from exc
                if tools and status_of(exc) == 400 and refuses_tools(str(exc)):
                    raise ToolsUnsupported(text) from exc
                if attempt < self.config.retries and transient(exc):
                    time.sleep(wait_before_retry(exc, attempt, self.config.backoff, self.config.max_backoff))
                    attempt += 1
                    continue
                raise ModelError(text) from exc

    def _cost(self, resp: Any) -> float:
        try:
            return float(self._litellm.completion_cost(completion_response=resp))
        except Exception:
            return 0.0


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return the conversation with its system prompt moved into the first user message."""
    system = [m for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    if not system:
        return messages
    head = "\n\n".join(str(m.get("content") or "") for m in system)
    if rest and rest[0].get("role") == "user":
        return [{**rest[0], "content": f"{head}\n\n{rest[0].get('content') or ''}"}, *rest[1:]]
    return [{"role": "user", "content": head}, *rest]


def model_info(model: str) -> dict[str, Any] | None:
    """Return what litellm knows of a model (prices, context, capabilities), or None."""
    import litellm

    try:
        return dict(litellm.get_model_info(model))
    except Exception:  # litellm raises plain Exceptions for models it does not map
        return None


def unpriced_info(info: dict[str, Any] | None) -> bool:
    """Return whether litellm's description of a model gives it no price."""
    return not info or not (info.get("input_cost_per_token") or info.get("output_cost_per_token"))


def refuses_tools(message: str) -> bool:
    """Return whether a 400's message says the server takes no tool definitions (not a bad tool message)."""
    text = message.lower()
    return (
        "tool_call_id" not in text and re.search(r"\btools?\b|tool[ _]choice|function call", text) is not None
    )


def fatal(exc: BaseException) -> bool:
    """Return whether an exception, or one it wraps, is a host's stop signal (a worker's time limit)."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        if type(at).__name__ in FATAL:
            return True
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    return False


FATAL = frozenset({"SoftTimeLimitExceeded", "TimeLimitExceeded", "WorkerLostError"})


def status_of(exc: BaseException) -> int | None:
    """Return the HTTP status an exception carries, if any."""
    status = getattr(exc, "status_code", None)
    return int(status) if isinstance(status, int) else None


def transient(exc: BaseException) -> bool:
    """Return whether another try might succeed: timeouts, lost connections, 429 and 5xx answers."""
    status = status_of(exc)
    if status is not None:
        return status in TRANSIENT_STATUS
    return isinstance(exc, TimeoutError | ConnectionError) or type(exc).__name__ in {
        "Timeout", "APIConnectionError", "APITimeoutError", "ServiceUnavailableError", "InternalServerError",
    }  # fmt: skip


def retry_after(exc: BaseException) -> float | None:
    """Return the seconds a `Retry-After` header on the failed response asks for, if any."""
    headers: Any = getattr(exc, "litellm_response_headers", None)
    response = getattr(exc, "response", None)
    if headers is None and response is not None:
        headers = getattr(response, "headers", None)
    value = headers.get("retry-after") if headers is not None and hasattr(headers, "get") else None
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(str(value))
        except (TypeError, ValueError):
            return None
        return max(0.0, float(when.timestamp()) - time.time())


def wait_before_retry(exc: BaseException, attempt: int, backoff: float, ceiling: float) -> float:
    """Return how long to wait before try `attempt + 2`: the server's `Retry-After`, else jittered backoff."""
    asked = retry_after(exc)
    if asked is not None:
        return min(asked, ceiling)
    return min(backoff * float(2**attempt) * (0.5 + random.random()), ceiling)


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
        finish_reason=str(getattr(choice, "finish_reason", None) or "stop"),
    )
