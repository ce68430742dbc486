"""Learning jobs through the API and a real `gpu`-queue Celery worker, on the CPU with a tiny model."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from backend.api.main import create_app
from backend.core import db
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.models import LearningJob
from backend.core.security import create_token
from backend.engine import learning
from backend.worker.celery_app import make_app
from tests.support.learning import records, tiny_model_dir
from tests.support.services import Service, sqlite_service
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def gpu_queue(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Service]:
    """A worker on the `gpu` queue only (there is no GPU here: the jobs run on the CPU)."""
    svc = sqlite_service(tmp_path_factory.mktemp("learning"), redis_url, db_number=9)
    svc.start_worker("learn-gpu", "gpu", 1)
    yield svc
    svc.stop()


def wait_done(client: TestClient, headers: dict[str, str], job_id: int) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        body = client.get(f"/api/v1/learning/jobs/{job_id}", headers=headers).json()
        return body if body["status"] in ("done", "failed") else None

    return wait_for(done, timeout=240)  # type: ignore[return-value]


def test_distillation_job_runs_on_the_gpu_queue_with_events_and_an_artifact(
    gpu_queue: Service, tmp_path: Path
) -> None:
    model_dir = tiny_model_dir(tmp_path / "tiny-lm")
    data = tmp_path / "trajectories.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records()))
    settings = gpu_queue.settings
    headers = {"Authorization": f"Bearer {create_token(settings, ['operator'], 'learn')}"}
    with TestClient(create_app(settings)) as client:
        bad = client.post("/api/v1/learning/jobs", headers=headers,
                          json={"kind": "distill", "params": {"model": str(tmp_path / "nope"), "trajectories": str(data)}})  # fmt: skip
        assert bad.status_code == 422 and bad.json()["detail"]["errors"][0]["key"] == "params.model"
        unknown = client.post(
            "/api/v1/learning/jobs", headers=headers, json={"kind": "distill", "params": {"stpes": 3}}
        )
        assert unknown.status_code == 422 and "params.stpes" in unknown.json()["detail"]["message"]

        params = {"model": str(model_dir), "trajectories": str(data), "steps": 6, "batch_size": 2, "lr": 3e-3,
                  "teacher": "ema", "beta": 0.5, "support": "full"}  # fmt: skip
        made = client.post(
            "/api/v1/learning/jobs", headers=headers, json={"kind": "distill", "params": params}
        )
        assert made.status_code == 201, made.text
        job = wait_done(client, headers, made.json()["id"])
    assert job["status"] == "done", job["error"]
    assert job["device"] == "cpu" and job["progress"] == 1.0
    types = [e["type"] for e in job["events"]]
    assert types == ["learning.queued", "learning.started"] + ["learning.progress"] * 6 + [
        "learning.finished"
    ]
    progress = [e["payload"]["progress"] for e in job["events"] if e["type"] == "learning.progress"]
    assert progress == sorted(progress) and progress[-1] == 1.0
    out = Path(job["artifact"])
    result = json.loads((out / "result.json").read_text())
    assert result == {k: job["result"][k] for k in result}
    assert result["records"] == 2 and result["steps"] == 6
    assert result["last_loss"] < result["first_loss"]
    assert len(json.loads((out / "history.json").read_text())) == 6
    assert (out / "model" / "config.json").is_file() and (out / "model" / "model.safetensors").is_file()


def test_sparse_attention_evaluation_job_reports_recall(gpu_queue: Service) -> None:
    settings = gpu_queue.settings
    headers = {"Authorization": f"Bearer {create_token(settings, ['operator'], 'learn')}"}
    params = {"docs": 16, "doc_len": 64, "pool": 16, "top_k": 4, "trials": 16, "noise": 0.3}
    with TestClient(create_app(settings)) as client:
        wrong = client.post(
            "/api/v1/learning/jobs", headers=headers, json={"kind": "sparse_eval", "params": {"docs": "8"}}
        )
        assert wrong.status_code == 422 and "params.docs: expected int" in wrong.json()["detail"]["message"]
        made = client.post(
            "/api/v1/learning/jobs", headers=headers, json={"kind": "sparse_eval", "params": params}
        )
        assert made.status_code == 201, made.text
        job = wait_done(client, headers, made.json()["id"])
    assert job["status"] == "done", job["error"]
    assert job["result"]["kv_tokens"] == 4 * 4 + 8 and job["result"]["context_tokens"] == 16 * 64
    assert 0.5 <= job["result"]["recall"] <= 1.0
    assert [e["payload"]["trial"] for e in job["events"] if e["type"] == "learning.progress"] == [8, 16]


def test_the_task_module_imports_no_torch_before_the_fork() -> None:
    code = "import sys, backend.worker.tasks; sys.exit(1 if 'torch' in sys.modules or 'transformers' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, check=False).returncode == 0


def test_grove_learn_queues_and_follows_a_job(gpu_queue: Service) -> None:
    from tests.frontend.conftest import serve
    from tests.support.waiting import free_port

    settings = gpu_queue.settings
    port = free_port()
    server, thread = serve(create_app(settings), port)
    try:
        token = create_token(settings, ["operator"], "cli")
        out = subprocess.run(
            [sys.executable, "-m", "backend.cli.main", "learn", "sparse_eval", "--set", "docs=8", "--set", "doc_len=32",
             "--set", "pool=8", "--set", "trials=8", "--api", f"http://127.0.0.1:{port}/api/v1", "--token", token,
             "--wait"],
            cwd=PROJECT_ROOT, env=gpu_queue.env, capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "learning.finished" in out.stdout and "artifact: " in out.stdout
        bad = subprocess.run(
            [sys.executable, "-m", "backend.cli.main", "learn", "sparse_eval", "--set", "k=3", "--api",
             f"http://127.0.0.1:{port}/api/v1", "--token", token],
            cwd=PROJECT_ROOT, env=gpu_queue.env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert bad.returncode == 1 and "params.k: unknown" in bad.stderr
    finally:
        server.should_exit = True
        thread.join(timeout=30)


CHECK = """\
import os, sys
answer = open("answer.txt").read()
if "4" in answer:
    sys.exit(0)
sys.exit(f"wrong: the answer is 4, not {answer[:20]!r} (home {os.environ.get('HOME')})")
"""


def run_job(settings: Settings, kind: str, params: dict[str, Any]) -> dict[str, Any]:
    """Queue a learning job over the API as an operator and return it once it ended."""
    headers = {"Authorization": f"Bearer {create_token(settings, ['operator'], 'learn')}"}
    with TestClient(create_app(settings)) as client:
        made = client.post("/api/v1/learning/jobs", headers=headers, json={"kind": kind, "params": params})
        assert made.status_code == 201, made.text
        return wait_done(client, headers, made.json()["id"])


def test_on_policy_sdpo_rounds_sample_check_in_the_sandbox_and_distil(
    gpu_queue: Service, tmp_path: Path
) -> None:
    model_dir = tiny_model_dir(tmp_path / "tiny-lm")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        json.dumps({"prompt": "add two and two:", "check": "python3 check.py", "files": {"check.py": CHECK}}) + "\n"
        + json.dumps({"prompt": "write 4:", "check": "grep -q 4 out.txt", "answer_file": "out.txt"}) + "\n"
    )  # fmt: skip
    params = {"model": str(model_dir), "tasks": str(tasks), "on_policy": True, "rounds": 3, "samples": 4,
              "steps": 4, "batch_size": 4, "max_new_tokens": 12, "lr": 3e-3, "beta": 0.5, "support": "full",
              "max_tokens": 256}  # fmt: skip
    job = run_job(gpu_queue.settings, "distill", params)
    assert job["status"] == "done", job["error"]
    rounds = [e["payload"] for e in job["events"] if e["type"] == "learning.progress"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert all(0.0 <= r["pass_rate"] <= 1.0 for r in rounds)
    result = job["result"]
    assert result["prompts"] == 2 and result["pass_rate"] == [r["pass_rate"] for r in rounds]
    # The teacher–student divergence on each round's own rollouts falls with the round's steps.
    assert all(a < b for a, b in zip(result["divergence_after"], result["divergence_before"], strict=True))
    out = Path(job["artifact"])
    history = json.loads((out / "history.json").read_text())
    assert len(history) == 3 and all(h["rollouts"] == 8 and len(h["steps"]) == 4 for h in history)
    # Importance weights come from the behaviour log-probs recorded while sampling: exactly 1 on the
    # round's first step (the student is the behaviour policy), then the student moves away.
    for h in history:
        weights = [s["is_weight"] for s in h["steps"]]
        assert abs(weights[0] - 1.0) < 1e-4 and any(abs(w - 1.0) > 1e-6 for w in weights[1:])
    # The checkers ran in the sandbox (HOME is the box's /tmp), and their output is the feedback.
    feedback = [s["feedback"] for h in history for s in h["samples"]]
    assert all(f == "The checker passed." or f.startswith("The checker failed") for f in feedback)
    assert any("wrong: the answer is 4" in f and "home /tmp" in f for f in feedback)
    assert (out / "model" / "model.safetensors").is_file()


def test_canon_and_opsa_jobs_run_on_the_gpu_queue(gpu_queue: Service, tmp_path: Path) -> None:
    model_dir = tiny_model_dir(tmp_path / "tiny-lm")
    data = tmp_path / "trajectories.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records()))
    settings = gpu_queue.settings
    headers = {"Authorization": f"Bearer {create_token(settings, ['operator'], 'learn')}"}
    base = {
        "model": str(model_dir),
        "trajectories": str(data),
        "steps": 2,
        "batch_size": 2,
        "support": "full",
    }
    canon = {**base, "method": "canon", "on_policy": True, "rounds": 1, "samples": 3, "max_new_tokens": 6}
    opsa = {**base, "teacher": "trust_region", "opsa": True, "opsa_weight": 0.5, "opsa_fraction": 0.5}
    with TestClient(create_app(settings)) as client:
        ids = []
        for params in (canon, opsa):
            made = client.post(
                "/api/v1/learning/jobs", headers=headers, json={"kind": "distill", "params": params}
            )
            assert made.status_code == 201, made.text
            ids.append(made.json()["id"])
        canon_job, opsa_job = (wait_done(client, headers, i) for i in ids)
    assert canon_job["status"] == "done", canon_job["error"]
    history = json.loads((Path(canon_job["artifact"]) / "history.json").read_text())
    # CANON's privileged text is the majority answer among the prompt's own rollouts.
    texts = [s["text"] for s in history[0]["samples"][:3]]
    assert history[0]["samples"][0]["feedback"] in {t.strip() for t in texts}
    assert opsa_job["status"] == "done", opsa_job["error"]
    steps = json.loads((Path(opsa_job["artifact"]) / "history.json").read_text())
    assert len(steps) == 2 and all(s["opsa"] != 0.0 for s in steps)


def test_a_trained_router_finds_the_needle_on_documents_it_never_saw(gpu_queue: Service) -> None:
    params = {"docs": 32, "doc_len": 64, "pool": 16, "top_k": 2, "trials": 32, "steps": 200, "lr": 3e-3}
    job = run_job(gpu_queue.settings, "sparse_train", params)
    assert job["status"] == "done", job["error"]
    result = job["result"]
    # A fresh layer's routers are random: recall near chance (k/N); trained, well above it.
    assert result["recall_before"] <= 0.2 and result["recall_after"] >= result["recall_before"] + 0.25, result
    assert result["last_loss"] < result["first_loss"]
    steps = [e["payload"]["step"] for e in job["events"] if e["type"] == "learning.progress"]
    assert steps == list(range(20, 201, 20))
    out = Path(job["artifact"])
    assert len(json.loads((out / "history.json").read_text())) == 200
    state = torch.load(out / "layer.pt")
    assert {"router_q.weight", "router_k.weight"} <= set(state)


def test_a_file_missing_where_the_job_runs_fails_it_naming_the_field_and_the_machine(
    gpu_queue: Service, tmp_path: Path
) -> None:
    settings = gpu_queue.settings
    params = learning.DistillParams(model=str(tmp_path / "gone"), trajectories=str(tmp_path / "t.jsonl"))
    with db.session(settings.db_url) as s:  # checked where it was submitted, then moved away
        job = LearningJob(kind="distill", params=params.model_dump(), token="t")
        s.add(job)
        s.flush()
        job_id = job.id or 0
    make_app(settings).send_task("gpu.learn", args=[job_id, "t"])

    def ended() -> LearningJob | None:
        with db.session(settings.db_url) as s:
            row = s.get(LearningJob, job_id)
            return row if row is not None and row.status in ("done", "failed") else None

    row = wait_for(ended, timeout=120)
    assert isinstance(row, LearningJob) and row.status == "failed"
    assert "params.model" in row.error and f"on {socket.gethostname()}" in row.error
    assert row.host == socket.gethostname()
