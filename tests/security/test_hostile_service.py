"""A scripted LLM executor attacks from its tools, on real Celery workers: everything fails, nothing leaks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import select

from backend.core import db
from backend.core.models import Event, LlmCall, Node, ReceiptRow, Study
from backend.services.ledger import prompt_of
from backend.services.studies import create_study
from backend.worker.celery_app import make_app
from tests.security.hostile import Hostile, attack_lines, expected, hostile_repo
from tests.support.fake_llm import FakeLLM
from tests.support.repos import TINY_SPEC, git
from tests.support.services import Service, sqlite_service
from tests.support.waiting import wait_for

SPEC = f"""\
{TINY_SPEC.split("[[constraints]]")[0].format(name="hostile-llm")}
[budget]
experiments = 1
parallel = 1

[gate]
mode = "auto"
margin = 0.5
test_repeats = 2

[policy]
kind = "llm"
model = "openai/fake-model"
input_usd_per_mtok = 1.0
output_usd_per_mtok = 2.0
max_turns = 16
"""
IDEA = {
    "content": json.dumps(
        {
            "children": [
                {
                    "parent_id": 1, "title": "Centre the knob", "mechanism": "set knob.x to 3",
                    "hypothesis": "the score peaks at x = 3", "observable": "dev score near 10", "risks": "none",
                    "expected_gain": 5.0,
                }
            ]
        }
    )
}  # fmt: skip


def tool(name: str, **args: Any) -> dict[str, Any]:
    return {"tool": name, "args": args}


@pytest.fixture
def hostile_service(tmp_path: Path, redis_url: str) -> Iterator[tuple[Service, Hostile, FakeLLM]]:
    root = tmp_path / "svc"
    svc = sqlite_service(root, redis_url, db_number=12)
    h = hostile_repo(tmp_path, "hostile-llm", svc.settings.data_dir, svc.settings.worktrees_dir, spec=SPEC)
    (h.repo / "notes.txt").write_text("a" * 60 + "!\n")
    git("add", "notes.txt", cwd=h.repo)
    git("commit", "-qm", "notes", cwd=h.repo)
    script = {
        "ideator": [IDEA],
        "executor": [
            tool("run", command="python attack.py dev"),
            tool(
                "run", command="cat /proc/*/environ | tr '\\0' '\\n'; git show HEAD:data/test/secret.txt; env"
            ),
            tool("read", path=".git"),
            tool("read", path="leak.txt"),
            tool("grep", pattern="(a|aa)+$"),
            tool("write", path=".git/hooks/post-commit", content="#!/bin/sh\ntouch /tmp/x\n"),
            tool(
                "run",
                command=f"git init -q sub && git -C sub config core.fsmonitor 'touch {h.pwn}-nested; false' && "
                "echo m > sub/f && git -C sub add f && git -C sub -c user.name=x -c user.email=x@x commit -qm x",
            ),
            tool("edit", path="config.toml", search="x = 0", replace="x = 3"),
            tool("evaluate_dev"),
            tool("finish", report="Set x = 3."),
        ],
    }
    with FakeLLM(script) as llm:
        svc.env.update(
            {
                "OPENAI_API_KEY": h.key,
                "GROVE_TOKEN": h.token,
                "GROVE_LLM_API_BASE": llm.url,
                "GROVE_LLM_BACKOFF": "0.05",
            }
        )
        svc.start_worker("coord", "coordinator", 1, beat=True)
        svc.start_worker("cpu", "cpu,sealed", 1)
        try:
            yield svc, h, llm
        finally:
            svc.stop()


def test_hostile_executor_on_celery_workers(hostile_service: tuple[Service, Hostile, FakeLLM]) -> None:
    svc, h, llm = hostile_service
    with db.session(svc.settings.db_url) as s:
        study = create_study(s, svc.settings, SPEC.replace('"eval.py"]', '"eval.py", "attack.py", "targets.json"]'),
                             str(h.repo))  # fmt: skip
    sid = study.id or 0
    make_app(svc.settings).send_task("coordinator.advance", args=[sid])

    def done() -> bool:
        with db.session(svc.settings.db_url) as s:
            st = s.get(Study, sid)
            return st is not None and st.status in ("finished", "failed")

    wait_for(done, timeout=240)
    with db.session(svc.settings.db_url) as s:
        st = s.get(Study, sid)
        calls = list(s.exec(select(LlmCall)))
        receipts = list(s.exec(select(ReceiptRow)))
        events = list(s.exec(select(Event)))
        nodes = list(s.exec(select(Node)))
    assert st is not None and st.status == "finished", st
    executor = [c for c in calls if c.role == "executor"]
    with db.session(svc.settings.db_url) as s:
        transcript = json.dumps(prompt_of(s, executor[-1]))
    outcomes = attack_lines(transcript.replace("\\n", "\n"))
    assert set(outcomes) == expected("dev") and set(outcomes.values()) == {"blocked"}, outcomes
    assert "not a git repository" in transcript
    assert transcript.count("refused") >= 3  # .git, leak.txt, .git/hooks
    assert "grep stopped: the pattern took over" in transcript
    assert "dev evaluation ok" in transcript

    # The model's server is the operator's, so it gets the key; nothing it is sent holds a secret.
    assert all(r["authorization"] == f"Bearer {h.key}" for r in llm.requests)
    bodies = json.dumps([r["body"] for r in llm.requests])
    logs = "".join(p.read_text(errors="replace") for p in svc.logs.glob("*.log"))
    public = json.dumps([e.payload for e in events]) + json.dumps([n.model_dump(mode="json") for n in nodes])
    outputs = "".join(Path(r.stdout_path).read_text() + Path(r.stderr_path).read_text() for r in receipts)
    # The evaluator attacks on the worker too, in every dev and sealed run.
    assert {r.kind for r in receipts} == {"dev", "test"}
    for r in receipts:
        seen = attack_lines(Path(r.stdout_path).read_text())
        assert set(seen) == expected(r.kind) and set(seen.values()) == {"blocked"}, (r.kind, seen)
    for secret in h.secrets:
        for where, text in (
            ("prompts", bodies),
            ("logs", logs),
            ("events/nodes", public),
            ("receipts", outputs),
        ):
            assert secret not in text, (secret, where)
    assert "777." not in bodies and "777." not in json.dumps([e.payload for e in events])
    assert h.host_leftovers() == []
    merged = [n for n in nodes if n.status == "merged" and n.parent_id]
    assert merged or any(n.status == "rejected" for n in nodes), [(n.id, n.status, n.failure) for n in nodes]
