"""Learning jobs through the API and a real `gpu`-queue Celery worker, on the CPU with a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from backend.api.main import create_app
from backend.core.config import PROJECT_ROOT
from backend.core.security import create_token
from tests.conftest import Service, sqlite_service, wait_for
from tests.learning_fixtures import records, tiny_model, tiny_tokenizer


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
    tok = tiny_tokenizer()
    model_dir = tmp_path / "tiny-lm"
    tiny_model(len(tok), dtype=torch.float32).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
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
    from tests.conftest import free_port
    from tests.frontend.conftest import serve

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
