"""The `llm` policy with servers and models that misbehave, through `grove run` and the scripted server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import litellm

from agents.executor.tools import TOOLS
from backend.core.config import Settings
from backend.core.models import LlmCall, Node, Trajectory
from tests.fake_llm import FakeLLM
from tests.integration.test_llm_policy import IDEA, grove_run, llm_repo, prompt, rows, tool


def executor_requests(llm: FakeLLM) -> list[dict[str, Any]]:
    return [r["body"] for r in llm.requests if r["role"] == "executor"]


def test_a_server_refusing_tool_choice_with_rough_answers_still_completes_a_node(
    settings: Settings, tmp_path: Path
) -> None:
    repo = llm_repo(tmp_path)
    script = {
        "ideator": [{"status": 503, "retry_after": "0"}, IDEA],  # retried after the server's Retry-After
        "executor": [
            {"status": 502},  # a gateway hiccup: retried
            {"tool": "write", "raw": '{"path": "config.toml", "content": "[knob]\\nx = ', "finish_reason": "length"},
            tool("run", command="true", timeout="60s"),
            tool("edit", path="config.toml", search="x = 0", replace="x = 3"),
            tool("evaluate_dev"),
            tool("finish", report="Set x = 3."),
        ],
    }  # fmt: skip
    with FakeLLM(script, refuse_tool_choice=True) as llm:
        res = grove_run(settings, repo, llm.url)
    assert res.returncode == 0, res.stderr + res.stdout
    node = rows(settings, Node, Node.id == 2)[0]
    assert node.status == "merged", node.failure
    assert all("tool_choice" not in r["body"] for r in llm.requests)
    statuses = [r["role"] for r in llm.requests]
    assert statuses[:2] == ["ideator", "ideator"]  # the 503 and its retry
    executor = [c for c in rows(settings, LlmCall) if c.role == "executor"]
    last = json.dumps(prompt(settings, executor[-1]))
    assert "cut off by the output limit" in last and "nothing ran" in last
    observations = [m["content"] for m in prompt(settings, executor[-1]) if m["role"] == "tool"]
    assert any('`timeout` must be a number, got "60s"' in o for o in observations), observations
    assert "dev evaluation ok" in last
    assert len(executor_requests(llm)) == 6 and len(executor) == 5  # the 502 was not charged


def test_a_text_format_model_on_a_server_without_tools_completes_a_node(
    settings: Settings, tmp_path: Path
) -> None:
    policy = "system_role = false\nextra = {num_ctx = 8192, top_k = 20}\n"
    repo = llm_repo(tmp_path, policy=policy)
    script = {
        "ideator": [IDEA],
        "executor": [
            {"content": "Let me look at the config first."},  # no action: told the format
            {"content": 'Reading it.\n```action\n{"tool": "read", "path": "config.toml"}\n```'},
            {"content": '```action\n{"tool": "edit", "path": "config.toml", "search": "x = 0", "replace": "x = 3"}\n```'},
            {"content": '```action\n{"tool": "evaluate_dev"}\n```'},
            {"content": 'Done.\n```action\n{"tool": "finish", "report": "Set x = 3 in text format."}\n```'},
        ],
    }  # fmt: skip
    with FakeLLM(script, refuse_tools=True) as llm:
        res = grove_run(settings, repo, llm.url)
    assert res.returncode == 0, res.stderr + res.stdout
    node = rows(settings, Node, Node.id == 2)[0]
    assert node.status == "merged", node.failure
    bodies = executor_requests(llm)
    assert "tools" in bodies[0] and all("tools" not in b for b in bodies[1:])  # refused once, then text
    assert all(m["role"] != "system" for r in llm.requests for m in r["body"]["messages"])
    assert all(r["body"].get("num_ctx") == 8192 and r["body"].get("top_k") == 20 for r in llm.requests)
    assert "holds no action block" in json.dumps(bodies[2]["messages"])
    assert "Observation (read)" in json.dumps(bodies[3]["messages"])
    traj = rows(settings, Trajectory, Trajectory.node_id == 2)[0]
    assert traj.report == "Set x = 3 in text format."


def test_a_long_transcript_stays_under_the_input_limit_and_a_late_context_error_keeps_a_passing_change(
    settings: Settings, tmp_path: Path
) -> None:
    limit = 3000
    repo = llm_repo(tmp_path, policy=f"max_input_tokens = {limit}\nkeep_turns = 2\n",
                    extra_files={"notes.txt": "a long note about the knob\n" * 150})  # fmt: skip
    script = {
        "ideator": [IDEA],
        "executor": [
            *[tool("read", path="notes.txt") for _ in range(5)],
            tool("edit", path="config.toml", search="x = 0", replace="x = 3"),
            tool("evaluate_dev"),
            {"context_error": True},
            {"context_error": True},
        ],
    }
    with FakeLLM(script) as llm:
        res = grove_run(settings, repo, llm.url)
    assert res.returncode == 0, res.stderr + res.stdout
    bodies = executor_requests(llm)
    sizes = [
        litellm.token_counter(model="openai/fake-model", messages=b["messages"], tools=TOOLS) for b in bodies
    ]
    assert max(sizes) <= limit and len(bodies) == 9, sizes
    assert "characters cut to save context" in json.dumps(bodies[6]["messages"])
    node = rows(settings, Node, Node.id == 2)[0]
    assert node.status == "merged" and node.dev_n >= 1, node.failure  # evaluated, gated and merged
    traj = rows(settings, Trajectory, Trajectory.node_id == 2)[0]
    assert traj.report.startswith("Stopped: the conversation no longer fits the model's context")
