"""Studies from a git URL are cloned off the request path: `cloning` -> created, or failed with the reason."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backend.api.main import create_app
from backend.core.security import create_token
from tests.support.repos import make_repo, tiny_files
from tests.support.services import Service, serve, sqlite_service
from tests.support.waiting import free_port, wait_for


@pytest.fixture
def remote(tmp_path: Path) -> Iterator[str]:
    """Serve repositories under `tmp_path/remote` with `git daemon` on loopback; yield its git:// URL."""
    base = tmp_path / "remote"
    base.mkdir()
    port = free_port()
    proc = subprocess.Popen(
        ["git", "daemon", "--reuseaddr", "--export-all", f"--base-path={base}", "--listen=127.0.0.1",
         f"--port={port}", str(base)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def up() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    wait_for(up, timeout=20)
    yield f"git://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def silent() -> Iterator[str]:
    """A git:// server that accepts connections and never answers (a remote that hangs)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"git://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    for c in held:
        c.close()
    sock.close()


@pytest.fixture
def api(tmp_path: Path, redis_url: str) -> Iterator[tuple[str, dict[str, str], Service]]:
    svc = sqlite_service(tmp_path / "svc", redis_url, db_number=13)
    svc.env["GROVE_CLONE_TIMEOUT"] = "5"
    svc.env["GROVE_CLONE_FIRST_BYTE_TIMEOUT"] = "3"
    # The remotes here are on loopback, which the API refuses unless the operator allows it.
    svc.env["GROVE_REPO_HOSTS"] = svc.settings.repo_hosts = "127.0.0.1"
    svc.start_worker("clone-coord", "coordinator", 2)
    svc.start_worker("clone-clone", "clone", 2)
    svc.start_worker("clone-cpu", "cpu,sealed", 2)
    port = free_port()
    server, thread = serve(create_app(svc.settings), port)
    headers = {"Authorization": f"Bearer {create_token(svc.settings, ['operator'], 'cloner')}"}
    try:
        yield f"http://127.0.0.1:{port}/api/v1", headers, svc
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        svc.stop()


def status(url: str, headers: dict[str, str], sid: int) -> dict[str, object]:
    body: dict[str, object] = httpx.get(f"{url}/studies/{sid}", headers=headers).json()
    return body


def test_a_study_from_a_url_is_cloned_in_the_background(
    api: tuple[str, dict[str, str], Service], remote: str, silent: str, tmp_path: Path
) -> None:
    url, headers, _ = api
    make_repo(tmp_path / "remote" / "tiny", tiny_files(name="from-url", experiments=2))
    spec = (tmp_path / "remote" / "tiny" / "grove.toml").read_text()

    hanging = httpx.post(
        f"{url}/studies",
        json={"spec": spec.replace("from-url", "hangs"), "repository": f"{silent}/r"},
        headers=headers,
    )
    assert hanging.status_code == 201 and hanging.json()["status"] == "cloning", hanging.text
    hid = hanging.json()["id"]
    # The API answers while that clone hangs, and a cloning study can be stopped.
    assert status(url, headers, hid)["status"] == "cloning"
    stopped = httpx.post(
        f"{url}/studies", json={"spec": spec.replace("from-url", "stopped"), "repository": f"{silent}/s"},
        headers=headers,
    ).json()["id"]  # fmt: skip
    assert httpx.post(f"{url}/studies/{stopped}/stop", headers=headers).status_code == 200
    assert status(url, headers, stopped)["status"] == "failed"
    assert "before its clone finished" in str(status(url, headers, stopped)["stop_reason"])
    check = httpx.post(
        f"{url}/studies/validate", json={"spec": spec, "repository": f"{remote}/tiny"}, headers=headers
    )
    assert check.status_code == 200 and "the repository answered" in check.text, check.text

    good = httpx.post(f"{url}/studies", json={"spec": spec, "repository": f"{remote}/tiny"}, headers=headers)
    assert good.status_code == 201, good.text
    gid = good.json()["id"]
    missing = httpx.post(
        f"{url}/studies", json={"spec": spec.replace("from-url", "missing"), "repository": f"{remote}/nope"},
        headers=headers,
    )  # fmt: skip
    mid = missing.json()["id"]

    wait_for(lambda: status(url, headers, gid)["status"] == "finished", timeout=180)
    wait_for(lambda: status(url, headers, mid)["status"] == "failed", timeout=60)
    wait_for(lambda: status(url, headers, hid)["status"] == "failed", timeout=60)
    said = (
        "repository: could not clone from 127.0.0.1: authentication failed or the repository does not exist"
    )
    assert status(url, headers, mid)["stop_reason"] == said
    said = "repository: could not clone from 127.0.0.1: the host did not send anything within 3 s"
    assert status(url, headers, hid)["stop_reason"] == said
    types = [e["type"] for e in httpx.get(f"{url}/studies/{gid}/events/log", headers=headers).json()]
    assert types[:3] == ["study.cloning", "study.created", "study.started"]
    assert status(url, headers, gid)["trunk_heldout"]


def test_validate_asks_the_repository_and_names_what_it_cannot_reach(
    api: tuple[str, dict[str, str], Service], remote: str, silent: str, tmp_path: Path
) -> None:
    url, headers, svc = api
    svc.settings.clone_first_byte_timeout = 3.0
    make_repo(tmp_path / "remote" / "tiny", tiny_files(name="asked"))
    spec = (tmp_path / "remote" / "tiny" / "grove.toml").read_text()

    def validate(spec_text: str, repository: str) -> httpx.Response:
        return httpx.post(
            f"{url}/studies/validate",
            json={"spec": spec_text, "repository": repository},
            headers=headers,
            timeout=60,
        )

    assert validate(spec, f"{remote}/tiny").status_code == 200
    started = time.monotonic()
    hung = validate(spec, f"{silent}/r")
    assert hung.status_code == 422 and time.monotonic() - started < 30, (
        hung.text
    )  # bounded: the first-byte time
    assert hung.json()["detail"]["errors"][0]["key"] == "repository"
    assert "did not answer within 3 s" in hung.json()["detail"]["message"]
    missing = validate(spec, f"{remote}/nope")
    assert missing.status_code == 422 and missing.json()["detail"]["errors"][0]["key"] == "repository"
    assert "authentication failed or the repository does not exist" in missing.text
    branch = validate(spec.replace("[study]", '[study]\nbase = "no-such-branch"', 1), f"{remote}/tiny")
    assert branch.status_code == 422 and branch.json()["detail"]["errors"][0]["key"] == "study.base", (
        branch.text
    )
    assert validate(spec.replace("[study]", '[study]\nbase = "main"', 1), f"{remote}/tiny").status_code == 200
    assert not list((svc.settings.data_dir / "repos").glob("*"))  # nothing was cloned
