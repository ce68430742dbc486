"""Fitting a role's prompt to the model's input limit, counted as the executor counts its own.

A role builds its prompt at a level of detail (0 is the fullest); `fitted` returns the first level
whose messages fit `input_limit` less the margin the executor's loop keeps (`loop.fit`), counted by
the model's own counter (litellm's token counter for the model, where it knows the tokenizer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agents.llm.model import ContextTooLong

Messages = list[dict[str, Any]]


def room(model: object) -> int | None:
    """Return the tokens a prompt may take on this model, or None where the model cannot count."""
    limit: int | None = getattr(model, "input_limit", None)
    if limit is None or getattr(model, "count", None) is None:
        return None
    return limit - max(64, limit // 20)  # a provider's template and tokenizer add a little to the count


def fitted(model: object, role: str, build: Callable[[int], Messages], levels: int) -> Messages:
    """Return the fullest of `build(0)`, `build(1)`, … `build(levels - 1)` that fits the model's input.

    Raises ContextTooLong (a ModelError) when even the shortest does not fit.
    """
    space = room(model)
    messages = build(0)
    if space is None:
        return messages
    count: Callable[[Messages], int] = model.count  # type: ignore[attr-defined]
    need = 0
    for level in range(levels):
        if level:
            messages = build(level)
        need = int(count(messages))
        if need <= space:
            return messages
    limit = getattr(model, "input_limit", None)
    raise ContextTooLong(
        f"the {role}'s prompt needs {need} tokens at its shortest and the input limit is {limit} "
        f"(policy.max_input_tokens)"
    )


def cut(text: object, chars: int) -> str:
    """Return a text cut to `chars` characters, marked where it was cut."""
    s = "" if text is None else str(text)
    return s if len(s) <= chars else s[: max(chars - 1, 0)].rstrip() + "…"
