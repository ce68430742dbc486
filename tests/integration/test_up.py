"""`grove up` starts the whole stack on one machine and stops it cleanly."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from backend.core.config import PROJECT_ROOT
from tests.support.repos import make_repo, tiny_files
from tests.support.services import spawn_up
from tests.support.waiting import free_port, wait_for


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def processes_using(marker: str) -> list[int]:
    """Return pids whose environment mentions `marker` (our data directory)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker.encode() in (d / "environ").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


def worker_group(marker: str, node: str) -> int | None:
    """Return the process group of our Celery worker named `node` (its main process's pid)."""
    for pid in processes_using(marker):
        try:
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
            if f"{node}@%h".encode() in argv and os.getpgid(pid) == pid:
                return pid
        except OSError:
            continue
    return None


def run_to_the_end(api: str, headers: dict[str, str], repo: Path) -> dict[str, Any]:
    """Submit the repository's study over the API and return it once it has finished."""
    resp = httpx.post(
        f"{api}/studies",
        json={"spec": (repo / "grove.toml").read_text(), "repository": str(repo)},
        headers=headers,
    )
    assert resp.status_code == 201, resp.text
    url = f"{api}/studies/{resp.json()['id']}"
    wait_for(lambda: httpx.get(url, headers=headers).json()["status"] == "finished", timeout=180)
    return dict(httpx.get(url, headers=headers).json())


def test_grove_up_serves_a_study_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    port, board = free_port(), free_port()
    proc, out = spawn_up(tmp_path, port, board)
    try:
        text = out.read_text()
        token = re.search(r"token\s+(grove_\S+)", text).group(1)  # type: ignore[union-attr]
        redis_port = int(re.search(r"redis\s+redis://127.0.0.1:(\d+)", text).group(1))  # type: ignore[union-attr]
        api = f"http://127.0.0.1:{port}/api/v1"
        assert httpx.get(f"{api}/health").json() == {"status": "ok", "database": "ok", "redis": "ok"}
        assert f"dashboard http://127.0.0.1:{board}" in text
        assert (tmp_path / "data" / "up.json").stat().st_mode & 0o077 == 0  # it holds a token
        assert httpx.get(f"http://127.0.0.1:{board}/_stcore/health").text == "ok"
        headers = {"Authorization": f"Bearer {token}"}
        study = run_to_the_end(
            api, headers, make_repo(tmp_path / "r", tiny_files(name="up-study", experiments=3))
        )
        assert study["trunk_heldout"] > 700

        # A crashed part is restarted, and says so; the stack keeps serving.
        marker = str(tmp_path / "data")
        dead = worker_group(marker, "cpu")
        assert dead is not None
        os.killpg(dead, signal.SIGKILL)
        wait_for(lambda: "worker-cpu exited with code" in out.read_text(), timeout=30)
        assert "restarted it" in out.read_text() and proc.poll() is None
        wait_for(lambda: worker_group(marker, "cpu") not in (None, dead), timeout=30)
        run_to_the_end(
            api, headers, make_repo(tmp_path / "r2", tiny_files(name="after-crash", experiments=2))
        )
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=90)
    assert code == 0
    assert "Grove stopped." in out.read_text()
    assert not listening(port) and not listening(redis_port) and not listening(board)
    assert processes_using(str(tmp_path / "data")) == []


def test_grove_up_names_a_service_that_does_not_answer(tmp_path: Path) -> None:
    closed = free_port()  # nothing listens there
    env = {
        **os.environ,
        "GROVE_DATA_DIR": str(tmp_path / "data"),
        "GROVE_WORKTREES_DIR": str(tmp_path / "wt"),
    }
    cases = {
        "GROVE_REDIS_URL": (f"redis://127.0.0.1:{closed}/0", f"Redis at GROVE_REDIS_URL=redis://127.0.0.1:{closed}/0 does not answer"),
        "GROVE_DATABASE_URL": (f"postgresql://grove@127.0.0.1:{closed}/grove", "the database at GROVE_DATABASE_URL does not answer"),
    }  # fmt: skip
    for name, (value, said) in cases.items():
        run_env = {k: v for k, v in env.items() if k not in cases} | {name: value}
        done = subprocess.run(
            [sys.executable, "-m", "backend.cli.main", "up", "--port", str(free_port()), "--no-dashboard"],
            env=run_env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 1, done.stdout + done.stderr
        assert said in " ".join(done.stderr.split()), done.stderr
        assert processes_using(str(tmp_path / "data")) == []  # nothing left running
