"""The `llm` policy with servers and models that misbehave, through `grove run` and the scripted server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from agents.executor.tools import TOOLS
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.models import Event, LlmCall, Node, Study, Trajectory
from tests.integration.test_llm_policy import IDEA, grove_run, llm_repo, prompt, rows, tool
from tests.support.fake_llm import FakeLLM
from tests.support.repos import git
from tests.support.waiting import wait_for


def db_session(settings: Settings) -> Any:
    from backend.core import db

    return db.session(settings.db_url)


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
    # finish() showed the change once; the model confirmed it with a second finish.
    assert "Before you finish, check your change" in last and "+x = 3" in last
    assert len(executor_requests(llm)) == 7 and len(executor) == 6  # the 502 was not charged


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
    import litellm  # after Grove's model seam, which keeps litellm from fetching its price list

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


def _study_with_budget(settings: Settings, tmp_path: Path, usd: float, policy: str = "") -> int:
    from backend.core import db
    from backend.services.studies import create_study

    repo = llm_repo(tmp_path, usd=usd, policy=policy)
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
        assert study.id is not None
        return study.id


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_calls_in_flight_together_cannot_overshoot_the_usd_budget(tmp_path: Path, backend: str) -> None:
    from agents.llm.model import BudgetExhausted, LitellmModel, ModelConfig
    from backend.core.models import LlmHold
    from backend.engine.jobstore import DbStore
    from backend.services.ledger import StoreLedger
    from tests.support.services import drop_postgres_database, postgres_database

    name = f"grove_holds_{os.getpid()}"
    url = postgres_database(name) if backend == "postgres" else None
    settings = Settings(data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt", database_url=url)
    settings.ensure_dirs()
    try:
        # Each call may cost up to ~$0.0021 (about 60 tokens in at $1/M, 1000 out at $2/M): one fits in
        # $0.003, two do not, whatever they turn out to cost.
        sid = _study_with_budget(settings, tmp_path, usd=0.003)
        release = threading.Event()
        script = {"executor": [{"wait": release, "content": "first"}, {"content": "third"}]}
        prices = {"input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6}
        messages = [{"role": "system", "content": "ROLE: executor"}, {"role": "user", "content": "go"}]
        with FakeLLM(script) as llm:

            def model() -> LitellmModel:
                config = ModelConfig("openai/fake-model", api_base=llm.url, api_key="k", prices=prices,
                                     max_output_tokens=1000)  # fmt: skip
                return LitellmModel(config, StoreLedger(DbStore(settings, sid, None)))

            outcome: dict[str, object] = {}

            def first() -> None:
                outcome["first"] = model().complete("executor", messages).content

            a = threading.Thread(target=first)
            a.start()
            wait_for(lambda: len(llm.requests) == 1)  # the first call is in flight, its hold taken
            with pytest.raises(BudgetExhausted, match=r"held by calls in flight"):
                model().complete("executor", messages)
            assert len(llm.requests) == 1  # the second call never reached the server
            release.set()
            a.join(timeout=60)
            assert outcome["first"] == "first"
            # Settled at its real cost (far below the hold), the budget has room for another call.
            assert model().complete("executor", messages).content == "third"
        calls = rows(settings, LlmCall)
        assert len(calls) == 2 and sum(c.usd for c in calls) <= 0.003
        assert rows(settings, LlmHold) == []  # every hold was settled or dropped
    finally:
        if url:
            from backend.core.db import get_engine

            get_engine(settings.db_url).dispose()
            drop_postgres_database(name)


def test_a_spent_budget_pauses_the_study_without_overshooting(settings: Settings, tmp_path: Path) -> None:
    budget = 0.004
    repo = llm_repo(tmp_path, usd=budget, policy="max_output_tokens = 100\n")
    script = {"ideator": [IDEA], "executor": [tool("list") for _ in range(30)]}
    with FakeLLM(script) as llm:
        env = {**os.environ, "GROVE_DATA_DIR": str(settings.data_dir), "GROVE_WORKTREES_DIR": str(settings.worktrees_dir),
               "GROVE_LLM_API_BASE": llm.url}  # fmt: skip
        proc = subprocess.Popen(
            [sys.executable, "-m", "backend.cli.main", "run", str(repo), "--auto-approve", "--quiet"],
            cwd=PROJECT_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_for(
                lambda: (
                    (settings.data_dir / "grove.db").exists()
                    and (studies := rows(settings, Study))
                    and studies[0].status == "paused"
                ),
                timeout=120,
            )
            stop = subprocess.run([sys.executable, "-m", "backend.cli.main", "stop", "llm-study"],
                                  cwd=PROJECT_ROOT, env=env, capture_output=True, text=True)  # fmt: skip
            assert stop.returncode == 0, stop.stderr
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    events = rows(settings, Event)
    assert "budget.exhausted" in [e.type for e in events]
    paused = next(e for e in events if e.type == "study.paused")
    assert "LLM budget spent" in paused.payload["reason"]
    calls = rows(settings, LlmCall)
    assert len(calls) >= 3 and sum(c.usd for c in calls) <= budget  # several calls, never past the budget
    node = rows(settings, Node, Node.id == 2)[0]
    assert node.status == "failed" and node.failure.startswith("BudgetExhausted: LLM budget spent")
    # Stopped while the spent budget held it paused: the report says both, in words.
    report = Path(rows(settings, Study)[0].report_path).read_text()
    assert "**Ended by:** stopped by a user" in report
    assert f"while paused because the LLM budget (${budget:.4g}) was spent" in report


def test_an_unpriced_model_with_a_usd_budget_is_refused_naming_the_keys(
    settings: Settings, tmp_path: Path
) -> None:
    repo = llm_repo(tmp_path)
    spec = (repo / "grove.toml").read_text()
    spec = spec.replace("input_usd_per_mtok = 1.0\noutput_usd_per_mtok = 2.0\n", "")
    (repo / "grove.toml").write_text(spec)
    git("commit", "-qam", "no prices", cwd=repo)
    res = grove_run(settings, repo, "http://127.0.0.1:9/v1", timeout=60)
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert (
        "policy.input_usd_per_mtok" in out and "policy.output_usd_per_mtok" in out and "budget.tokens" in out
    )
    assert "'openai/fake-model'" in out
    # budget.usd = 0 with a token budget is the way for a local model.
    (repo / "grove.toml").write_text(spec.replace("usd = 1.0", "usd = 0\ntokens = 50000"))
    git("commit", "-qam", "tokens", cwd=repo)
    edit = tool("edit", path="config.toml", search="x = 0", replace="x = 3")
    with FakeLLM({"ideator": [IDEA], "executor": [edit, tool("finish", report="x = 3")]}) as llm:
        res = grove_run(settings, repo, llm.url)
    assert res.returncode == 0, res.stderr + res.stdout
    assert rows(settings, Node, Node.id == 2)[0].status == "merged"


def test_an_executor_longer_than_the_evaluations_but_within_its_minutes_completes_under_celery(
    tmp_path: Path,
) -> None:
    from backend.core import db
    from backend.services.studies import create_study
    from backend.worker.celery_app import make_app
    from tests.integration.test_faults import RedisServer
    from tests.support.services import Service
    from tests.support.waiting import free_port

    server = RedisServer(free_port(), tmp_path)
    server.start()
    url = f"redis://127.0.0.1:{server.port}/0"
    settings = Settings(data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt", redis_url=url)
    settings.ensure_dirs()
    # timeout × repeats + margin = 4 × 2 + 5 = 13 s; the executor alone runs a 15 s command.
    repo = llm_repo(tmp_path, policy="executor_minutes = 1\n")
    spec = (repo / "grove.toml").read_text().replace("timeout = 60", "timeout = 4")
    script = {
        "ideator": [IDEA],
        "executor": [
            tool("run", command="sleep 15", timeout=30),
            tool("edit", path="config.toml", search="x = 0", replace="x = 3"),
            tool("finish", report="Set x = 3 after a long think."),
        ],
    }
    with FakeLLM(script) as llm:
        env = {**os.environ, "GROVE_DATA_DIR": str(settings.data_dir), "GROVE_WORKTREES_DIR": str(settings.worktrees_dir),
               "GROVE_REDIS_URL": url, "GROVE_TASK_MARGIN_SECONDS": "5", "GROVE_LLM_API_BASE": llm.url,
               "GROVE_LLM_BACKOFF": "0.05"}  # fmt: skip
        svc = Service(settings, env)
        try:
            svc.start_worker("coord", "coordinator", 2, beat=True)
            svc.start_worker("cpu", "cpu,sealed", 2)
            with db.session(settings.db_url) as s:
                sid = create_study(s, settings, spec, str(repo)).id
            make_app(settings).send_task("coordinator.advance", args=[sid])
            wait_for(lambda: rows(settings, Study, Study.id == sid)[0].status == "finished", timeout=240)
        finally:
            svc.stop()
            server.stop()
    node = rows(settings, Node, Node.id == 2)[0]
    assert node.status == "merged" and node.attempts == 1, node.failure  # not killed and tried again
    traj = rows(settings, Trajectory, Trajectory.node_id == 2)[0]
    assert traj.report == "Set x = 3 after a long think."
    ran = next(m for m in traj.messages if m["role"] == "tool")
    assert ran["content"].startswith("exit code 0")  # the 15 s command ran to its end


def test_a_sibling_executor_gets_the_reflections_of_related_failed_attempts(
    settings: Settings, tmp_path: Path
) -> None:
    repo = llm_repo(tmp_path, experiments=3, fail_at=5)
    child = json.loads(IDEA["content"])["children"][0]
    two = {
        "children": [child, {**child, "title": "Push the knob to its upper end", "mechanism": "set x to 4"}]
    }
    written = "x = 5 crashes the evaluator; keep x at 4 or below."
    script = {
        "ideator": [{"content": json.dumps(two)}],
        "reflect": [{"content": written}],
        "executor": [
            tool("edit", path="config.toml", search="x = 0", replace="x = 5"),
            tool("finish", report="Set x = 5."),
            tool("finish", report="Set x = 5."),
            tool("edit", path="config.toml", search="x = 0", replace="x = 3"),
            tool("finish", report="Set x = 3."),
        ],
    }
    with FakeLLM(script) as llm:
        res = grove_run(settings, repo, llm.url)
    assert res.returncode == 0, res.stderr + res.stdout
    tasks = {}
    for r in llm.requests:
        if r["role"] == "executor":
            task = r["body"]["messages"][1]["content"]
            tasks.setdefault(task.split("Your hypothesis (node ", 1)[1].split(")", 1)[0], task)
    assert set(tasks) == {"n2", "n3"}
    assert (
        "Reflections from failed attempts on related nodes" not in tasks["n2"]
    )  # the first attempt had none
    sibling = tasks["n3"]
    assert "Reflections from failed attempts on related nodes" in sibling
    assert "- n2 (Centre the knob): Attempt 1 failed:" in sibling and written in sibling


def test_a_second_study_of_the_same_repository_gets_the_first_ones_findings_with_provenance(
    settings: Settings, tmp_path: Path
) -> None:
    from fastapi.testclient import TestClient

    from backend.api.main import create_app
    from backend.core.security import create_token

    repo = llm_repo(tmp_path)
    script = {
        "ideator": [IDEA],
        "executor": [
            tool("edit", path="config.toml", search="x = 0", replace="x = 3"),
            tool("finish", report="x = 3"),
        ],
    }
    with FakeLLM(script) as llm:
        assert grove_run(settings, repo, llm.url).returncode == 0
    first = rows(settings, Study)[0]
    assert first.status == "finished" and rows(settings, Node, Node.id == 2)[0].status == "merged"

    # The same repository under another path and another study name.
    clone = tmp_path / "elsewhere"
    git("clone", "-q", str(repo), str(clone), cwd=tmp_path)
    spec = (clone / "grove.toml").read_text().replace('name = "llm-study"', 'name = "llm-again"')
    (clone / "grove.toml").write_text(spec)
    git("commit", "-qam", "a second study", cwd=clone)
    with FakeLLM({"ideator": [{"content": '{"children": []}'}]}) as llm:
        assert grove_run(settings, clone, llm.url).returncode == 0
        ideator = next(r["body"] for r in llm.requests if r["role"] == "ideator")
    evidence = json.loads(ideator["messages"][1]["content"])
    memory = evidence["lab_memory"]
    assert any("merged: Centre the knob" in m and "from study llm-study, n2" in m and "dev effect +" in m
               for m in memory), memory  # fmt: skip
    # No held-out number and no sealed byte goes into memory or the prompt.
    text = json.dumps(ideator)
    assert first.trunk_heldout and first.baseline_heldout
    for value in first.trunk_heldout + first.baseline_heldout:
        assert f"{value:g}" not in text and str(value) not in text
    assert "777" not in text

    viewer = {"Authorization": f"Bearer {create_token(settings, ['viewer'], 'v')}"}
    operator = {"Authorization": f"Bearer {create_token(settings, ['operator'], 'o')}"}
    with TestClient(create_app(settings)) as client:
        listed = client.get("/api/v1/memory", params={"study": "llm-study"}, headers=viewer).json()
        merged = next(e for e in listed if e["text"].startswith("merged: Centre the knob"))
        assert merged["provenance"] == "study llm-study, n2" and merged["node_numbers"] == [2]
        again = rows(settings, Study, Study.name == "llm-again")[0]
        knew = client.get(f"/api/v1/studies/{again.id}/memory", headers=viewer).json()
        assert merged["id"] in [e["id"] for e in knew]
        # The dashboard's study page shows it as what Grove already knew.
        from tests.frontend.conftest import app_test, texts
        from tests.support.services import serve
        from tests.support.waiting import free_port

        port = free_port()
        server, thread = serve(create_app(settings), port)
        try:
            at = app_test(f"http://127.0.0.1:{port}/api/v1", viewer["Authorization"].split()[1],
                          page="views/study.py", study=again.id)  # fmt: skip
            assert not at.exception, at.exception
            shown, plain = texts(at), [str(t.value) for t in at.text]
            assert "What Grove already knew" in shown and any(
                t.startswith(f"M{merged['id']}  merged: Centre the knob") for t in plain
            )
            assert "finding from study llm-study, n2" in shown
        finally:
            server.should_exit = True
            thread.join(timeout=30)
        assert client.delete(f"/api/v1/memory/{merged['id']}", headers=viewer).status_code == 403
        assert client.delete(f"/api/v1/memory/{merged['id']}", headers=operator).status_code == 204
        assert client.get(f"/api/v1/memory/{merged['id']}", headers=viewer).status_code == 404
        knew = client.get(f"/api/v1/studies/{again.id}/memory", headers=viewer).json()
        assert merged["id"] not in [e["id"] for e in knew]  # forgotten: no later study is given it
    env = {**os.environ, "GROVE_DATA_DIR": str(settings.data_dir)}
    cli = [sys.executable, "-m", "backend.cli.main", "memory"]

    def grove_memory(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *args], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True)

    out = grove_memory("list", "--study", "llm-study")
    assert out.returncode == 0, out.stderr
    assert "merged:" not in out.stdout and "study llm-study" in out.stdout  # the deleted entry is gone
    left = [e["id"] for e in listed if e["id"] != merged["id"]]
    assert left, "the study left only its merged change"
    shown = grove_memory("show", str(left[0]))
    assert (
        shown.returncode == 0 and f"[M{left[0]}]" in shown.stdout and "from study llm-study" in shown.stdout
    )
    gone = grove_memory("delete", str(left[0]))
    assert gone.returncode == 0 and f"deleted memory entry {left[0]}" in gone.stdout
    shown = grove_memory("show", str(left[0]))
    assert shown.returncode == 1 and f"no memory entry with id {left[0]}" in shown.stderr


def test_the_repository_map_shows_files_symbols_and_editable_text_but_nothing_sealed(tmp_path: Path) -> None:
    from backend.core import gitops
    from backend.services.storage import repository_map
    from tests.support.repos import make_repo

    repo = make_repo(tmp_path / "r", {
        "model.py": "import os\n\nclass Net:\n    pass\n\ndef train(lr):\n    return lr\n",
        "config.toml": "[knob]\nx = 0\n",
        "data/test/offset.txt": "777.125\n",
        "data/test/labels.py": "def secret():\n    return 777.125\n",
        "README.md": "a repository\n",
        "data/dev/rows.csv": "a,b\n" + "".join(f"{i},{i * 2}\n" for i in range(100)),
        "data/dev/blob.bin": "\0\1\2",
    })  # fmt: skip
    head = gitops.git("rev-parse", "HEAD", cwd=repo).strip()
    m = repository_map(gitops.Repo(repo), head, ["config.toml", "model.py"], ["data/test/**"], ["data/**"])
    assert {f["path"] for f in m["files"]} == {
        "model.py", "config.toml", "README.md", "data/dev/rows.csv", "data/dev/blob.bin"
    }  # fmt: skip
    assert m["python_symbols"] == {"model.py": ["Net", "train"]}
    assert m["editable_contents"]["config.toml"] == "[knob]\nx = 0\n"
    # What the evaluator reads, protected: the first lines of its text files; binary and sealed ones never.
    assert set(m["protected_preview"]) == {"data/dev/rows.csv"}
    assert m["protected_preview"]["data/dev/rows.csv"].startswith("a,b\n0,0\n1,2\n")
    assert m["protected_preview"]["data/dev/rows.csv"].count("\n") == 29  # 30 lines
    assert "777" not in json.dumps(m) and "secret" not in json.dumps(m)


def test_a_token_budget_holds_like_the_usd_one(settings: Settings, tmp_path: Path) -> None:
    from agents.llm.model import BudgetExhausted, LitellmModel, ModelConfig
    from backend.engine.jobstore import DbStore
    from backend.services.ledger import StoreLedger

    sid = _study_with_budget(settings, tmp_path, usd=0.0)
    spec_budget = "usd = 0.0\ntokens = 2000"
    with db_session(settings) as s:
        study = s.get(Study, sid)
        assert study is not None
        study.spec_toml = study.spec_toml.replace("usd = 0.0", spec_budget)
        s.add(study)
    messages = [{"role": "system", "content": "ROLE: executor"}, {"role": "user", "content": "go"}]
    with FakeLLM({"executor": [{"content": "one"}, {"content": "two"}]}) as llm:

        def model(out: int) -> LitellmModel:
            config = ModelConfig("openai/fake-model", api_base=llm.url, api_key="k", max_output_tokens=out)
            return LitellmModel(config, StoreLedger(DbStore(settings, sid, None)))

        with pytest.raises(
            BudgetExhausted,
            match=r"0 of 2000 tokens used, 0 held by calls in flight, and this call may take 40\d\d",
        ):
            model(4000).complete("executor", messages)  # its worst case alone passes 2000 tokens
        assert model(500).complete("executor", messages).content == "one"
    assert len(llm.requests) == 1
    assert sum(c.tokens_in + c.tokens_out for c in rows(settings, LlmCall)) <= 2000
