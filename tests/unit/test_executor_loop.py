"""The executor loop and the model seam's pure parts, with deterministic doubles for model and runtime."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agents.executor import loop
from agents.executor.tools import Observation, Toolbox, check_arguments
from agents.llm.model import (
    ContextTooLong,
    ToolCall,
    ToolsUnsupported,
    Turn,
    fold_system,
    retry_after,
    transient,
    wait_before_retry,
)


class Runtime:
    def __init__(self, dev: str = 'dev evaluation ok: {"score": 10}', dev_ok: bool = True) -> None:
        self.dev, self.dev_ok, self.commands = dev, dev_ok, []  # type: ignore[var-annotated]

    def run(self, command: str, timeout: float) -> tuple[int | None, str]:
        self.commands.append((command, timeout))
        return 0, "ran"

    def evaluate_dev(self) -> Observation:
        return Observation(self.dev, self.dev_ok)


class Scripted:
    """A model that answers from a list: Turns, or exceptions to raise."""

    name = "scripted"

    def __init__(
        self, answers: list[Turn | Exception], tool_mode: str = "native", input_limit: int | None = None
    ) -> None:
        self.answers, self.tool_mode, self.input_limit = list(answers), tool_mode, input_limit
        self.prompts: list[list[dict[str, Any]]] = []
        self.tools: list[object] = []
        self.schemas: list[object] = []

    def count(self, messages: list[dict[str, Any]], tools: object = None) -> int:
        return len(json.dumps(messages)) // 4

    def complete(
        self, role: str, messages: list[dict[str, Any]], tools: Any = None, schema: object = None
    ) -> Turn:
        self.prompts.append(json.loads(json.dumps(messages)))
        self.tools.append(tools)
        self.schemas.append(schema)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def call(name: str, finish_reason: str = "tool_calls", raw: str | None = None, **args: Any) -> Turn:
    return Turn("", [ToolCall(f"c{name}", name, raw if raw is not None else json.dumps(args))], 100, 10, 0.0,
                finish_reason=finish_reason)  # fmt: skip


def text(content: str) -> Turn:
    return Turn(content, [], 100, 10, 0.0)


@pytest.fixture
def box(tmp_path: Path) -> Toolbox:
    (tmp_path / "config.toml").write_text("x = 0\n")
    (tmp_path / "notes.txt").write_text("note " * 2000)
    return Toolbox(tmp_path, ["config.toml"], Runtime())


def test_a_cut_off_call_and_a_wrong_typed_argument_become_observations(box: Toolbox) -> None:
    model = Scripted([
        call("write", finish_reason="length", raw='{"path": "config.toml", "content": "x = '),
        call("run", command="sleep 1", timeout="60s"),
        call("read", path="config.toml", start="1"),
        call("run", command="true", timeout=5),
        call("finish", report="done"),
    ])  # fmt: skip
    tr = loop.Transcript()
    assert loop.run(model, box, "ROLE: executor", "task", tr=tr) == "done"
    observations = [m["content"] for m in tr.messages if m["role"] == "tool"]
    assert "cut off by the output limit" in observations[0] and "nothing ran" in observations[0]
    assert "`timeout` must be a number" in observations[1] and "60s" in observations[1]
    assert "`start` must be an integer" in observations[2]
    assert box.runtime.commands == [("true", 5)]  # type: ignore[attr-defined]
    assert "[turn 4 of 30]" in observations[3]  # the model is told where it stands


def test_a_tool_that_raises_anything_is_an_observation(tmp_path: Path) -> None:
    class Broken(Runtime):
        def evaluate_dev(self) -> Observation:
            raise LookupError("the evaluator vanished")

    model = Scripted([call("evaluate_dev"), call("finish", report="ok")])
    tr = loop.Transcript()
    loop.run(model, Toolbox(tmp_path, ["*"], Broken()), "s", "t", tr=tr)
    assert "error: evaluate_dev failed: LookupError: the evaluator vanished" in tr.messages[3]["content"]


def test_text_format_actions_run_and_malformed_answers_get_the_format(box: Toolbox) -> None:
    model = Scripted(
        [
            text("I will look first."),
            text('Reading.\n```action\n{"tool": "read", "path": "config.toml"}\n```'),
            text('```json\n{"tool": "edit", "args": {"path": "config.toml", "search": "x = 0", "replace": "x = 3"}}\n```'),
            text('```action\n{"tool": "finish", "report": "set ```x``` to 3"}\n```'),
        ],
        tool_mode="text",
    )  # fmt: skip
    tr = loop.Transcript()
    assert loop.run(model, box, "ROLE: executor", "task", tr=tr) == "set ```x``` to 3"
    assert model.tools == [None] * 4  # no tool definitions in the text mode
    # Each answer is asked for as one action: the tool's name and its arguments, paths a change may write listed.
    action = model.schemas[0]
    assert isinstance(action, dict) and model.schemas == [action] * 4
    edit = next(o for o in action["anyOf"] if o["properties"]["tool"]["enum"] == ["edit"])
    assert edit["required"] == ["tool", "path", "search", "replace"]
    assert edit["properties"]["path"]["enum"] == sorted(box.editable)
    assert (
        "```action" in model.prompts[0][0]["content"]
        and "- edit(path: string" in model.prompts[0][0]["content"]
    )
    assert "holds no action block" in model.prompts[1][-1]["content"]
    assert "Observation (read):\n1\tx = 0" in model.prompts[2][-1]["content"]
    assert (box.root / "config.toml").read_text() == "x = 3\n"


def test_three_answers_without_an_action_end_the_attempt(box: Toolbox) -> None:
    model = Scripted(
        [text("hmm"), text("```action\n{not json}\n```"), text("still thinking")], tool_mode="text"
    )
    with pytest.raises(loop.LimitReached, match="3 answers in a row held no action"):
        loop.run(model, box, "s", "t")


def test_a_native_model_that_writes_an_action_block_is_understood(box: Toolbox) -> None:
    model = Scripted([text('```action\n{"tool": "list"}\n```'), call("finish", report="r")])
    tr = loop.Transcript()
    assert loop.run(model, box, "s", "t", tr=tr) == "r"
    assert "config.toml" in tr.messages[3]["content"]


def test_a_server_without_tools_switches_the_run_to_the_text_format(box: Toolbox) -> None:
    model = Scripted(
        [
            call("list"),
            ToolsUnsupported("400: tools"),
            text('```action\n{"tool": "finish", "report": "r"}\n```'),
        ]
    )
    tr = loop.Transcript()
    assert loop.run(model, box, "s", "t", tr=tr) == "r"
    assert model.tool_mode == "text" and model.tools[2] is None
    # The conversation so far was rewritten: no tool messages are sent to a server without tools.
    assert all(m["role"] != "tool" and "tool_calls" not in m for m in model.prompts[2])
    assert '```action\n{"tool": "list"}\n```' in model.prompts[2][2]["content"]


def test_old_observations_shrink_to_fit_the_input_limit(box: Toolbox) -> None:
    reads = [call("read", path="notes.txt") for _ in range(8)]
    model = Scripted([*reads, call("finish", report="r")], input_limit=5000)
    loop.run(model, box, "s", "t", limits=loop.Limits(keep_turns=2))
    assert max(model.count(p) for p in model.prompts) <= 5000
    last = model.prompts[-1]
    assert "characters cut to save context" in last[3]["content"]  # the first read, shortened
    assert "note note" in last[-1]["content"] and len(last[-1]["content"]) > 5000  # the latest is whole


def test_a_limit_after_a_passing_dev_evaluation_keeps_the_change(box: Toolbox) -> None:
    model = Scripted([
        call("edit", path="config.toml", search="x = 0", replace="x = 3"),
        call("evaluate_dev"),
        ContextTooLong("context"),
        ContextTooLong("context"),
    ])  # fmt: skip
    tr = loop.Transcript()
    report = loop.run(model, box, "s", "t", tr=tr)
    assert report.startswith("Stopped: the conversation no longer fits") and tr.stopped
    # Without a passing evaluation since the last change, the same limit fails the attempt.
    model = Scripted([call("evaluate_dev"), call("edit", path="config.toml", search="x = 3", replace="x = 4"),
                      ContextTooLong("c"), ContextTooLong("c")])  # fmt: skip
    with pytest.raises(loop.LimitReached):
        loop.run(model, box, "s", "t")


def test_tokens_count_what_is_new_not_the_resent_prompt(box: Toolbox) -> None:
    turns = [Turn("", [ToolCall(f"c{i}", "list", "{}")], 1000 + 100 * i, 10, 0.0) for i in range(5)]
    tr = loop.Transcript()
    loop.run(Scripted([*turns, call("finish", report="r")]), box, "s", "t", tr=tr)
    # 1000 new on the first call, then 90 new per call (100 more prompt, less the 10 already answered).
    assert tr.tokens == 1010 + 4 * 100 + 10  # the last call's smaller prompt adds only its answer


def test_answers_without_an_action_are_reported_and_end_the_attempt_as_a_format_failure(box: Toolbox) -> None:
    model = Scripted([
        call("functions.edit", raw=json.dumps(json.dumps({"path": "config.toml", "search": "x = 0", "replace": "x = 1"}))),
        call("read", raw='{"path": "config.toml"'),
        text("I will now think about the knob."),
        text("```action\n{'tool': 'read'}\n```"),
    ])  # fmt: skip
    refused: list[tuple[str, str]] = []
    with pytest.raises(loop.FormatLimit, match="3 answers in a row held no action"):
        loop.run(
            model,
            box,
            "sys",
            "task",
            loop.Limits(turns=10),
            refused=lambda why, answer: refused.append((why, answer)),
        )
    assert (box.root / "config.toml").read_text() == "x = 1\n"  # arguments encoded twice still ran
    assert [why.split(":")[0] for why, _ in refused] == ["malformed arguments for read", "the answer holds no action block",
                                                         "the action block is not valid JSON (Expecting property name enclosed in double quotes"]  # fmt: skip
    assert refused[1][1] == "I will now think about the knob."  # the answer itself goes with the reason


def test_parse_action_formats() -> None:
    assert loop.parse_action('x\n```action\n{"tool": "read", "path": "a"}\n```') == ("read", {"path": "a"})
    assert loop.parse_action('```\n{"tool": "list", "args": {"path": "."}}\n```') == ("list", {"path": "."})
    with pytest.raises(loop.FormatError, match="not valid JSON"):
        loop.parse_action("```action\n{'tool': 'read'}\n```")
    with pytest.raises(loop.FormatError, match='"tool" key'):
        loop.parse_action('```action\n{"path": "read"}\n```')
    with pytest.raises(loop.FormatError, match="no action block"):
        loop.parse_action("I will read the config next.")
    # What open models write besides: a function call in a block, a tag, bare, or in a list of calls.
    assert loop.parse_action('```action\n{"name": "read"}\n```') == ("read", {})
    assert loop.parse_action('{"tool": "read", "path": "a"}') == ("read", {"path": "a"})
    tagged = '<tool_call>\n{"name": "edit", "arguments": {"path": "a", "search": "x", "replace": "y"}}\n</tool_call>'
    assert loop.parse_action(tagged) == ("edit", {"path": "a", "search": "x", "replace": "y"})
    assert loop.parse_action('Reading.\n{"name": "read", "arguments": {"path": "a"}}') == (
        "read",
        {"path": "a"},
    )
    assert loop.parse_action('```json\n{"name": "evaluate_dev", "arguments": {},}\n```') == (
        "evaluate_dev",
        {},
    )
    assert loop.parse_action('[TOOL_CALLS] [{"name": "read", "arguments": "{\\"path\\": \\"a\\"}"}]') == (
        "read", {"path": "a"},
    )  # fmt: skip
    wrapped = '{"type": "function", "function": {"name": "functions.read", "parameters": {"path": "a"}}}'
    assert loop.parse_action(wrapped) == ("read", {"path": "a"})
    with pytest.raises(loop.FormatError, match="<tool_call> block is not valid JSON"):
        loop.parse_action("<tool_call>{'name': 'read'}</tool_call>")
    with pytest.raises(loop.FormatError, match="no action block"):  # a bare object that is no call
        loop.parse_action('lr is {"name": "lr", "value": 3}')


def test_check_arguments() -> None:
    assert check_arguments("read", {"path": "a", "start": 2}) == ""
    assert "missing required argument(s) path" in check_arguments("read", {})
    assert "unknown argument(s) mode" in check_arguments("list", {"mode": "x"})
    assert "`timeout` must be a number" in check_arguments("run", {"command": "c", "timeout": True})


def test_retry_decisions_follow_status_and_retry_after() -> None:
    class Err(Exception):
        def __init__(self, status: int | None, headers: dict[str, str] | None = None) -> None:
            self.status_code, self.litellm_response_headers = status, headers

    assert transient(Err(502)) and transient(Err(429)) and transient(Err(503)) and not transient(Err(400))
    assert not transient(Err(401)) and transient(TimeoutError()) and not transient(ValueError())
    assert retry_after(Err(429, {"retry-after": "7"})) == 7.0
    assert wait_before_retry(Err(429, {"retry-after": "7"}), 0, 1.0, 60.0) == 7.0
    assert wait_before_retry(Err(429, {"retry-after": "700"}), 0, 1.0, 60.0) == 60.0  # capped
    assert 0 < retry_after(Err(503, {"retry-after": "Wed, 01 Jan 2120 00:00:00 GMT"})) <= 10**10  # type: ignore[operator]
    assert 2.0 <= wait_before_retry(Err(502), 2, 1.0, 60.0) <= 6.0  # 4 s with jitter


def test_fold_system_moves_the_system_prompt_into_the_first_user_message() -> None:
    folded = fold_system([{"role": "system", "content": "ROLE: x"}, {"role": "user", "content": "hi"}])
    assert folded == [{"role": "user", "content": "ROLE: x\n\nhi"}]


def test_the_scripted_server_fails_a_test_whose_prompt_held_a_sealed_number() -> None:
    from tests.support.fake_llm import FakeLLM

    with pytest.raises(AssertionError, match="sealed byte or a held-out number"), FakeLLM({}) as llm:
        llm.answer({"model": "m", "messages": [{"role": "user", "content": "dev 9.5, held-out 768.125"}]})
    with FakeLLM({}) as llm:  # dev numbers and counts pass
        llm.answer({"model": "m", "messages": [{"role": "user", "content": "dev 9.5 over 1779 tokens"}]})


def test_what_a_tool_call_did_is_its_flag_not_its_words(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("x = 0\n")
    (tmp_path / "notes.txt").write_text("error: this line is the file's own text\n")
    # A dev evaluation whose words read like a pass but that failed, and one read of a file whose
    # text reads like a tool error: the flags decide, never the words.
    box = Toolbox(
        tmp_path, ["config.toml"], Runtime(dev="dev evaluation ok (so the evaluator claims)", dev_ok=False)
    )
    model = Scripted([call("read", path="notes.txt"), call("evaluate_dev"), call("finish", report="done")])
    tr = loop.Transcript()
    loop.run(model, box, "s", "t", tr=tr)
    assert tr.dev_ok is False
    assert [f.split(":", 1)[0] for f in tr.feedback] == ["evaluate_dev"]
    assert box.act("read", {"path": "missing.txt"}).ok is False
    assert box.act("read", {"path": "notes.txt"}) == ("1\terror: this line is the file's own text", True)
