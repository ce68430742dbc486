"""The executor's ReAct loop (Thought → Action → Observation) over a model and a toolbox.

A model acts through native tool calls, or through the text action format (`TEXT_FORMAT`): one
fenced `action` block holding a JSON object per answer, for servers and models without tool calling.

Exceptions::

    ExecutorError
     └── LimitReached      turn, token, time, context or format-error limit hit before finish()
          └── FormatLimit  answers in a row held no action that could run (the format failed, not the idea)
    (ModelError, BudgetExhausted come from the model seam)

At any limit, if the last `evaluate_dev` passed and nothing changed since, the run ends as if the
model had finished: the change is kept and evaluated rather than thrown away.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agents.executor.tools import SCHEMAS, TOOLS, Submitted, Toolbox
from agents.llm.model import ContextTooLong, Model, ToolsUnsupported, Turn
from agents.policies.llm import schemas

FORMAT_ERRORS = 3  # malformed answers in a row that end an attempt
SHORT = 300  # characters an old observation keeps when the conversation must shrink
CHANGES_FILES = frozenset({"write", "edit", "run"})


class ExecutorError(RuntimeError):
    """The executor stopped without finishing."""


class LimitReached(ExecutorError):
    """A turn, token, time, context or format-error limit was reached."""


class FormatLimit(LimitReached):
    """Too many answers in a row held no action that could run: the model's format failed, not its idea."""


@dataclass(frozen=True)
class Limits:
    turns: int = 30
    tokens: int = 400_000  # new tokens: each call's output and the part of its prompt not sent before
    seconds: float = 1800.0
    keep_turns: int = 4  # turns whose observations stay whole when the conversation must shrink


@dataclass
class Transcript:
    messages: list[dict[str, Any]] = field(default_factory=list)
    feedback: list[str] = field(default_factory=list)  # errors and evaluation results the executor saw
    tokens: int = 0
    turns: int = 0
    dev_ok: bool = False  # the last evaluate_dev passed and no file-changing tool ran since
    context: int = 0  # tokens of the last call's prompt and answer
    stopped: str = ""  # the limit that ended the run, when it ended on a passing evaluate_dev


def _tool_lines() -> str:
    lines = []
    for s in SCHEMAS:
        props = s["parameters"].get("properties", {})
        need = set(s["parameters"].get("required", []))
        args = ", ".join(f"{k}{'' if k in need else '?'}: {v['type']}" for k, v in props.items())
        lines.append(f"- {s['name']}({args}): {s['description']}")
    return "\n".join(lines)


TEXT_FORMAT = (
    "Act by ending each answer with exactly one action block: a fence labelled `action` holding one\n"
    'JSON object whose "tool" names the tool and whose other keys are its arguments, for example\n'
    '```action\n{"tool": "edit", "path": "config.toml", "search": "x = 0", "replace": "x = 3"}\n```\n'
    "Only the first block of an answer runs; its result comes back as the next message.\n"
    "Tools (`?` marks an optional argument):\n" + _tool_lines()
)

_FENCE = re.compile(r"```[ \t]*(action|json|tool|tool_call)?[ \t]*\n", re.I)
_TAG = re.compile(r"<(tool_call|function_call|action)>\s*", re.I)
_TRAILING_COMMA = re.compile(r",(\s*[}\]])")
_ARGS = ("args", "arguments", "parameters")


class FormatError(ValueError):
    """An answer holds no action this loop can run; the message says what to send instead."""


def parse_action(text: str) -> tuple[str, dict[str, Any]]:
    """Return the tool name and arguments of the first action in `text`.

    An action is a JSON object naming a tool: `{"tool": name, ...arguments}` (or with its arguments
    under "args", "arguments" or "parameters"), or a function call `{"name": name, "arguments": {...}}`
    (also under "function", or in a list of calls, of which the first runs). It stands in a fenced
    block (```action, ```json, ```tool or unlabelled), in a `<tool_call>` tag, or bare in the text
    (a bare function call needs its arguments key). Arguments written as a JSON string are read too.
    """
    marks = sorted(
        [(m.end(), "the <" + m.group(1) + "> block") for m in _TAG.finditer(text)]
        + [(m.end(), "the action block" if m.group(1) else "") for m in _FENCE.finditer(text)]
    )
    first_error = ""
    for end, where in marks:
        try:
            value = _decode(text[end:].lstrip())
        except ValueError as exc:
            first_error = first_error or (f"{where} is not valid JSON ({exc})" if where else "")
            continue
        action = _action(value, marked=True)
        if action is not None:
            return action
        first_error = first_error or (
            f'{where} must be a JSON object with a "tool" key, or {{"name": ..., "arguments": {{...}}}}'
            if where
            else ""
        )
    for m in re.finditer(r"[{\[]", text):
        try:
            value = _decode(text[m.start() :])
        except ValueError:
            continue
        action = _action(value, marked=False)
        if action is not None:
            return action
    raise FormatError(first_error or "the answer holds no action block")


def _decode(text: str) -> Any:
    """Return the JSON value at the start of `text`, forgiving trailing commas."""
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except ValueError:
        lenient = _TRAILING_COMMA.sub(r"\1", text)
        if lenient == text:
            raise
        return json.JSONDecoder().raw_decode(lenient)[0]


def _action(value: Any, marked: bool) -> tuple[str, dict[str, Any]] | None:
    """Return the call a decoded value spells, or None; `marked`: it stood in a block or tag."""
    if isinstance(value, list):
        value = value[0] if value else None
    if not isinstance(value, dict):
        return None
    function = value.get("function")
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        value = function
    if isinstance(value.get("tool"), str):
        name, key = value["tool"], "tool"
    elif isinstance(value.get("name"), str) and (marked or any(k in value for k in _ARGS)):
        name, key = value["name"], "name"
    else:
        return None
    raw = next((value[k] for k in _ARGS if k in value), None)
    if isinstance(raw, str):
        try:
            raw = json.loads(raw or "{}")
        except ValueError:
            raise FormatError(f"the arguments of {name} are not a JSON object") from None
    if isinstance(raw, dict):
        args = raw
    elif raw is None and key == "tool":
        args = {k: v for k, v in value.items() if k != "tool"}
    elif raw is None:
        args = {}
    else:
        raise FormatError(f"the arguments of {name} must be a JSON object")
    return tool_name(name), args


def tool_name(name: str) -> str:
    """Return a tool's name without the namespace some chat templates give it (`functions.edit`)."""
    return name.strip().rsplit(".", 1)[-1]


def run(
    model: Model,
    toolbox: Toolbox,
    system: str,
    task: str,
    limits: Limits = Limits(),
    tr: Transcript | None = None,
    refused: Callable[[str, str], None] | None = None,
) -> str:
    """Run until the model calls finish(report) and return the report; `tr` records the conversation.

    `refused(reason, answer)` is told of every answer (or tool call) refused for its format.
    """
    tr = tr if tr is not None else Transcript()
    text_mode = getattr(model, "tool_mode", "native") == "text"
    action = schemas.action(SCHEMAS, toolbox.editable)
    tr.messages[:] = [
        {"role": "system", "content": system + ("\n\n" + TEXT_FORMAT if text_mode else "")},
        {"role": "user", "content": task},
    ]
    started, errors, squeezed = time.monotonic(), 0, False
    while True:
        if tr.turns >= limits.turns:
            return _stop(tr, f"turn limit ({limits.turns}) reached before finish()")
        if tr.tokens >= limits.tokens:
            return _stop(tr, f"token limit ({limits.tokens}) reached before finish()")
        if time.monotonic() - started >= limits.seconds:
            return _stop(tr, f"time limit ({limits.seconds:g} s) reached before finish()")
        over = fit(model, tr.messages, limits.keep_turns, None if text_mode else TOOLS)
        if over:
            return _stop(tr, over)
        try:
            turn = (
                model.complete(
                    "executor", tr.messages, schema=action
                )  # one action, in the form decoding holds to
                if text_mode
                else model.complete("executor", tr.messages, TOOLS)
            )
        except ToolsUnsupported:
            if text_mode:
                raise
            text_mode = True  # the server takes no tool definitions: go on in the text action format
            setattr(model, "tool_mode", "text")  # noqa: B010 - not every Model has the attribute
            tr.messages[:] = as_text(tr.messages)
            continue
        except ContextTooLong as exc:
            if squeezed:
                return _stop(tr, f"the conversation no longer fits the model's context ({exc})")
            squeezed = True
            shorten(tr.messages, keep_turns=1)
            continue
        squeezed = False
        tr.turns += 1
        tr.tokens += turn.tokens_out + max(0, turn.tokens_in - tr.context)
        tr.context = turn.tokens_in + turn.tokens_out
        tr.messages.append(
            turn.message() if not text_mode else {"role": "assistant", "content": turn.content}
        )
        try:
            if text_mode or not turn.tool_calls:
                ran = _text_turn(toolbox, turn, tr)
            else:
                ran = _tool_turn(toolbox, turn, tr, refused)
        except Submitted as done:
            return done.report
        except FormatError as exc:
            ran = False
            tr.messages.append({"role": "user", "content": _format_help(exc, turn.finish_reason, text_mode)})
            tr.feedback.append(f"format: {exc}")
            if refused is not None:
                refused(_why(exc, turn.finish_reason), turn.content)
        errors = 0 if ran else errors + 1
        if errors >= FORMAT_ERRORS:
            return _stop(tr, f"{FORMAT_ERRORS} answers in a row held no action that could run", FormatLimit)
        _stamp(tr, limits)


def _tool_turn(
    toolbox: Toolbox, turn: Turn, tr: Transcript, refused: Callable[[str, str], None] | None = None
) -> bool:
    """Run a turn's native tool calls; return whether any ran."""
    ran = False
    for call in turn.tool_calls:
        name = tool_name(call.name)
        if turn.finish_reason == "length":
            obs = (
                "error: your answer was cut off by the output limit, so this call's arguments are "
                "incomplete and nothing ran; send less per call (edit a part instead of writing a whole file)"
            )
            tr.feedback.append(f"{call.name}: {obs}")
            tr.messages.append({"role": "tool", "tool_call_id": call.id, "content": obs})
            if refused is not None:
                refused(f"{call.name}: {obs.removeprefix('error: ')}", call.arguments)
            continue
        try:
            args = _decode((call.arguments or "{}").strip() or "{}")
            if isinstance(args, str):  # arguments encoded twice, as a JSON string of a JSON object
                args = _decode(args.strip() or "{}")
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
        except ValueError as exc:
            obs = f"error: malformed arguments for {call.name}: {exc}. Send the arguments as a JSON object."
            if refused is not None:
                refused(obs.removeprefix("error: "), call.arguments)
        else:
            ran = True
            obs = _act(toolbox, name, args, tr, call.id)
        tr.messages.append({"role": "tool", "tool_call_id": call.id, "content": obs})
    return ran


def _text_turn(toolbox: Toolbox, turn: Turn, tr: Transcript) -> bool:
    """Run the first action block of a text answer (or raise FormatError)."""
    name, args = parse_action(turn.content)
    obs = _act(toolbox, name, args, tr, None)
    tr.messages.append({"role": "user", "content": f"Observation ({name}):\n{obs}"})
    return True


def _act(toolbox: Toolbox, name: str, args: dict[str, Any], tr: Transcript, call_id: str | None) -> str:
    try:
        obs, ok = toolbox.act(name, args)
    except Submitted:
        tr.messages.append(
            {"role": "tool", "tool_call_id": call_id, "content": "finished"}
            if call_id
            else {"role": "user", "content": "Observation (finish): finished"}
        )
        raise
    if name == "evaluate_dev":
        tr.dev_ok = ok
    elif name in CHANGES_FILES and ok:
        tr.dev_ok = False
    if not ok or name in ("evaluate_dev", "run"):
        tr.feedback.append(f"{name}: {obs[:2000]}")
    return obs


def _stamp(tr: Transcript, limits: Limits) -> None:
    """Tell the model where it stands: turn k of N, on the turn's last observation."""
    last = tr.messages[-1]
    if last["role"] in ("tool", "user"):
        last["content"] = f"{last['content']}\n[turn {tr.turns} of {limits.turns}]"


def _why(exc: FormatError, finish_reason: str) -> str:
    if finish_reason == "length":
        return "your answer was cut off by the output limit before its action was complete"
    return str(exc)


def _format_help(exc: FormatError, finish_reason: str, text_mode: bool) -> str:
    why = _why(exc, finish_reason)
    how = (
        'End your answer with one ```action block holding a JSON object with a "tool" key.'
        if text_mode
        else "Call one of the tools, or end your answer with one ```action block holding a JSON object "
        'with a "tool" key.'
    )
    return f"error: {why}; nothing ran. {how} Call finish(report) when you are done."


def _stop(tr: Transcript, reason: str, limit: type[LimitReached] = LimitReached) -> str:
    """End at a limit: keep the change if its last dev evaluation passed, else raise `limit`."""
    if not tr.dev_ok:
        raise limit(reason)
    tr.stopped = reason
    return f"Stopped: {reason}. The last evaluate_dev passed on the files as they are, so they are kept."


def shorten(messages: list[dict[str, Any]], keep_turns: int) -> None:
    """Cut observations and long answers older than the last `keep_turns` turns, in place."""
    starts = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if len(starts) <= keep_turns:
        return
    for m in messages[2 : starts[-keep_turns]]:
        content = m.get("content")
        if isinstance(content, str) and len(content) > SHORT + 100:
            m["content"] = content[:SHORT] + f"\n[… {len(content) - SHORT} characters cut to save context]"
        for call in m.get("tool_calls") or []:
            fn = call["function"]
            if len(fn["arguments"]) > SHORT + 100:
                try:
                    args = json.loads(fn["arguments"])
                except ValueError:
                    args = {}
                if isinstance(args, dict):
                    args = {
                        k: (v[:SHORT] + "…" if isinstance(v, str) and len(v) > SHORT else v)
                        for k, v in args.items()
                    }
                fn["arguments"] = json.dumps(args)


def fit(
    model: Model, messages: list[dict[str, Any]], keep_turns: int, tools: list[dict[str, Any]] | None = None
) -> str:
    """Shrink old turns until the prompt fits the model's input limit; return why it cannot."""
    limit: int | None = getattr(model, "input_limit", None)
    count = getattr(model, "count", None)
    if limit is None or count is None:
        return ""
    room = limit - max(64, limit // 20)  # a provider's template and tokenizer add a little to our count
    for keep in (None, keep_turns, 1):
        if keep is not None:
            shorten(messages, keep)
        need = int(count(messages, tools))
        if need <= room:
            return ""
    return f"context limit: the conversation needs {need} tokens even shortened, the input limit is {limit}"


def as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return a tool-calling conversation rewritten in the text action format."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "system":
            out.append({"role": "system", "content": f"{m['content']}\n\n{TEXT_FORMAT}"})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [
                f"```action\n{json.dumps({'tool': c['function']['name'], **_args(c['function']['arguments'])})}\n```"
                for c in m["tool_calls"]
            ]
            out.append({"role": "assistant", "content": "\n".join([m.get("content") or "", *blocks]).strip()})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"Observation:\n{m['content']}"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    return out


def _args(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
