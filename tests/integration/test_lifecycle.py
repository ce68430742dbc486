"""Every study status change goes through one service: API and CLI alike, one event each, live over SSE."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
from sqlmodel import col, select

from backend.api.main import create_app
from backend.core import db
from backend.core.config import PROJECT_ROOT
from backend.core.models import Event
from backend.core.security import create_token
from tests.support.repos import make_repo, tiny_files
from tests.support.services import Service, serve
from tests.support.waiting import free_port, wait_for


def listen(url: str, token: str, until: str, out: list[dict[str, Any]]) -> None:
    """Collect a study's server-sent events into `out` until one of type `until` arrives."""
    current: dict[str, Any] = {}
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.stream("GET", url, headers=headers, timeout=httpx.Timeout(10, read=300)) as resp:
        for line in resp.iter_lines():
            if line.startswith("event:"):
                current["type"] = line[6:].strip()
            elif line.startswith("id:"):
                current["id"] = int(line[3:].strip())
            elif line.startswith("data:"):
                current["data"] = json.loads(line[5:].strip())
            elif not line and current:
                out.append(current)
                current = {}
                if out[-1]["type"] == until:
                    return


def grove(service: Service, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a `grove` command against the service's database and broker."""
    return subprocess.run(
        [sys.executable, "-m", "backend.cli.main", *args],
        env=service.env,
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_pause_resume_stop_from_api_and_cli_each_write_one_event_seen_live(
    service: Service, tmp_path: Path
) -> None:
    name = f"life-{service.settings.db_url.split(':', 1)[0].split('+')[0]}"
    files = tiny_files(name=name, mode="auto", experiments=60, sleep=0.3, plateau_stop=100)
    # A continuous knob: the search never runs out of proposals, so the study runs until it is stopped.
    files["grove.toml"] = files["grove.toml"].replace(
        "{ values = [0, 1, 2, 3, 4, 5] }", "{ low = 0.0, high = 6.0 }"
    )
    files["config.toml"] = files["config.toml"].replace("x = 0", "x = 0.0")
    repo = make_repo(tmp_path / "r", files)
    token = create_token(service.settings, ["operator"], "ada")
    port = free_port()
    server, thread = serve(create_app(service.settings), port)
    api = f"http://127.0.0.1:{port}/api/v1"
    http = httpx.Client(base_url=api, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    try:
        created = http.post("/studies", json={"spec": files["grove.toml"], "repository": str(repo)})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        seen: list[dict[str, Any]] = []
        listener = threading.Thread(
            target=listen, args=(f"{api}/studies/{sid}/events", token, "study.finished", seen), daemon=True
        )
        listener.start()

        def status() -> str:
            return str(http.get(f"/studies/{sid}").json()["status"])

        wait_for(lambda: status() == "running", timeout=120)
        assert http.post(f"/studies/{sid}/pause").json()["status"] == "paused"
        again = http.post(f"/studies/{sid}/pause")
        assert again.status_code == 409 and "is paused" in again.json()["detail"]
        resumed = grove(service, "resume", name)
        assert resumed.returncode == 0, resumed.stderr
        assert status() == "running"
        paused = grove(service, "pause", name)
        assert paused.returncode == 0, paused.stderr
        assert status() == "paused"
        assert http.post(f"/studies/{sid}/resume").json()["status"] == "running"
        stopped = grove(service, "stop", name)
        assert stopped.returncode == 0, stopped.stderr
        twice = grove(service, "stop", name)
        assert twice.returncode == 1 and "cannot become stopping" in twice.stderr
        assert http.post(f"/studies/{sid}/resume").status_code == 409
        listener.join(timeout=180)
        assert not listener.is_alive(), f"no study.finished over SSE; saw {[e['type'] for e in seen]}"
    finally:
        http.close()
        server.should_exit = True
        thread.join(timeout=30)

    live = [(e["type"], e["data"]["payload"].get("by")) for e in seen if e["type"].startswith("study.")]
    assert live == [
        ("study.created", None),
        ("study.started", None),
        ("study.paused", "ada"),
        ("study.resumed", "cli"),
        ("study.paused", "cli"),
        ("study.resumed", "ada"),
        ("study.stopping", "cli"),
        ("study.finished", None),
    ]
    with db.session(service.settings.db_url) as s:
        rows = s.exec(select(Event).where(Event.study_id == sid).order_by(col(Event.id))).all()
        stored = [e.id for e in rows if e.type.startswith("study.")]
    assert stored == [e["id"] for e in seen if e["type"].startswith("study.")]
