"""A learning job's files obey the folder rules of repository paths, and a bad file is a clear refusal."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_lib

from backend.api.main import create_app
from backend.core import db
from backend.core.config import Settings
from backend.core.models import LearningJob
from backend.core.security import create_token
from backend.engine import learning
from tests.support.learning import records, tiny_model_dir
from tests.support.services import serve
from tests.support.waiting import free_port

JOBS = "/learning/jobs"


@pytest.fixture
def api(tmp_path: Path, redis_url: str) -> Iterator[tuple[str, Settings, dict[str, str]]]:
    """The API over loopback; repository roots are `tmp_path/allowed`, which also holds Grove's data folder."""
    broker = redis_url.rsplit("/", 1)[0] + "/6"
    allowed = tmp_path / "allowed"
    settings = Settings(
        data_dir=allowed / "data", worktrees_dir=allowed / "wt", redis_url=broker, repo_roots=str(allowed)
    )
    settings.ensure_dirs()
    port = free_port()
    server, thread = serve(create_app(settings), port)
    headers = {"Authorization": f"Bearer {create_token(settings, ['operator'], 'op')}"}
    yield f"http://127.0.0.1:{port}/api/v1", settings, headers
    server.should_exit = True
    thread.join(timeout=10)
    redis_lib.Redis.from_url(broker).flushdb()  # the queued tasks no worker takes


def fake_model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


def jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def post(url: str, headers: dict[str, str], params: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{JOBS}", json={"kind": "distill", "params": params}, headers=headers, timeout=30)


def refusal(resp: httpx.Response) -> tuple[str, str]:
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    return detail["errors"][0]["key"], detail["message"]


def test_learning_files_must_lie_where_repository_paths_may(
    api: tuple[str, Settings, dict[str, str]], tmp_path: Path
) -> None:
    url, settings, headers = api
    model = fake_model(tmp_path / "allowed" / "lm")
    data = jsonl(tmp_path / "allowed" / "t.jsonl", records())
    tasks = jsonl(tmp_path / "allowed" / "tasks.jsonl", [{"prompt": "say 4:", "check": "true"}])
    outside = fake_model(tmp_path / "outside-lm")
    secret = jsonl(tmp_path / "outside" / "t.jsonl", records())

    def refused(params: dict[str, Any]) -> str:
        return refusal(post(url, headers, params))[0]

    ok = post(url, headers, {"model": str(model), "trajectories": str(data)})
    assert ok.status_code == 201, ok.text

    # Outside the roots: refused naming the field, and the same words whether the path exists or not,
    # so a refusal tells nothing about the server's files (today's probe answered "does not exist").
    key, there = refusal(post(url, headers, {"model": str(outside), "trajectories": str(data)}))
    key2, nowhere = refusal(post(url, headers, {"model": "/no/such/model", "trajectories": str(data)}))
    assert key == key2 == "params.model" and "must lie under" in there
    assert there == nowhere and str(outside) not in there
    for name, given in (
        ("trajectories", str(secret)),
        ("trajectories", "/etc/passwd"),
        ("tasks", "/etc/hosts"),
    ):
        params = {"model": str(model), name: given, **({"on_policy": True} if name == "tasks" else {})}
        key, message = refusal(post(url, headers, params))
        assert key == f"params.{name}" and "must lie under" in message, (name, message)
    # An empty model is no path (it was `./config.json` of the API's working folder).
    assert refused({"model": "", "trajectories": str(data)}) == "params.model"
    # A link under the roots to a file outside them is where it leads.
    link = tmp_path / "allowed" / "link.jsonl"
    link.symlink_to(secret)
    assert refused({"model": str(model), "trajectories": str(link)}) == "params.trajectories"
    # Inside Grove's own data folder (other jobs' artifacts, clones with sealed files): refused though under a root.
    artifact = fake_model(settings.data_dir / "learning" / "job-1" / "model")
    key, message = refusal(post(url, headers, {"model": str(artifact), "trajectories": str(data)}))
    assert key == "params.model" and "inside Grove's own folder" in message
    grove_file = jsonl(settings.data_dir / "repos" / "x" / "t.jsonl", records())
    assert refused({"model": str(model), "trajectories": str(grove_file)}) == "params.trajectories"
    # A URL is no local path.
    assert refused({"model": "https://example.org/lm", "trajectories": str(data)}) == "params.model"
    # Within the rules, tasks are fine too.
    assert (
        post(url, headers, {"model": str(model), "tasks": str(tasks), "on_policy": True}).status_code == 201
    ), "tasks"


def test_canon_on_a_file_that_is_not_json_is_a_422_naming_the_field(
    api: tuple[str, Settings, dict[str, str]], tmp_path: Path
) -> None:
    url, _, headers = api
    model = fake_model(tmp_path / "allowed" / "lm")
    for name, text in (("binary", b"\x00\x01\xff\xfe"), ("text", b"not json at all\n"), ("list", b"[1, 2]\n"),
                       ("huge", b'{"n": ' + b"9" * 5000 + b"}\n")):  # fmt: skip
        bad = tmp_path / "allowed" / f"{name}.jsonl"
        bad.write_bytes(text)
        resp = post(url, headers, {"model": str(model), "trajectories": str(bad), "method": "canon"})
        key, message = refusal(resp)
        assert key == "params.trajectories" and str(bad) in message, (name, message)


def test_a_stored_file_that_is_not_json_fails_the_job_naming_the_field(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt")
    settings.ensure_dirs()
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"prompt": "x", "rollout": "y"}\nnot json\n')
    with db.session(settings.db_url) as s:
        job_id = learning.submit(s, "distill", {"model": str(tiny_model_dir(tmp_path / "lm")),
                                                "trajectories": str(bad), "steps": 1}).id or 0  # fmt: skip
    assert learning.run(settings, job_id) == "failed"
    with db.session(settings.db_url) as s:
        job = s.get(LearningJob, job_id)
        assert job is not None
    assert job.error.startswith("LearningJobError: params.trajectories:"), job.error
    assert "line 2 is not JSON" in job.error
