"""A body is read only from a caller with a live token: a large anonymous request costs the API nothing."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from backend.core.config import PROJECT_ROOT, Settings
from backend.core.security import create_token
from tests.support.waiting import free_port, wait_for

MB = 1_000_000


@dataclass
class Api:
    port: int
    proc: subprocess.Popen[bytes]
    settings: Settings

    def peak_rss(self) -> int:
        """Return the API process's peak resident memory in bytes (VmHWM)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Api]:
    root = tmp_path_factory.mktemp("bodies")
    settings = Settings(data_dir=root / "data", worktrees_dir=root / "wt", redis_url=redis_url)
    settings.ensure_dirs()
    env = {**os.environ, "GROVE_DATA_DIR": str(settings.data_dir), "GROVE_WORKTREES_DIR": str(settings.worktrees_dir),
           "GROVE_REDIS_URL": redis_url}  # fmt: skip
    env.pop("GROVE_DATABASE_URL", None)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "backend.api.app:app", "--host", "127.0.0.1", "--port", str(port)],
        env=env, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/api/v1/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, timeout=60)
    yield Api(port, proc, settings)
    proc.terminate()
    proc.wait(timeout=30)


def send_until_answered(port: int, head: bytes, total: int, chunked: bool = False) -> bytes:
    """Send `head`, then up to `total` bytes of body until the server answers; return its answer."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        sock.sendall(head)
        block = b"x" * (1 << 20)
        piece = (b"%x\r\n" % len(block) + block + b"\r\n") if chunked else block
        sent = 0
        while sent < total:
            readable, writable, _ = select.select([sock], [sock], [], 30)
            if readable:
                break
            if writable:
                try:
                    sock.sendall(piece)
                except (BrokenPipeError, ConnectionResetError):
                    break
                sent += len(block)
        answer = b""
        while b"\r\n\r\n" not in answer:
            got = sock.recv(65536)
            if not got:
                break
            answer += got
        return answer
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("path", "chunked"),
    [("/api/v1/worker/jobs/1/publish?token=t&ref=r&commit=" + "a" * 40, False),
     ("/api/v1/worker/jobs/1/publish?token=t&ref=r&commit=" + "a" * 40, True),
     ("/api/v1/worker/jobs/1/call/add_records", False),
     ("/api/v1/studies", True)],
)  # fmt: skip
def test_a_large_body_without_a_token_is_refused_before_it_is_read(
    api: Api, path: str, chunked: bool
) -> None:
    before = api.peak_rss()
    size = 300 * MB
    framing = b"Transfer-Encoding: chunked\r\n" if chunked else b"Content-Length: %d\r\n" % size
    head = b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n%s\r\n" % (
        path.encode(),
        framing,
    )
    answer = send_until_answered(api.port, head, size, chunked)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    grew = api.peak_rss() - before
    assert grew < 5 * MB, grew / MB


def test_a_token_without_the_worker_role_cannot_send_a_bundle(api: Api) -> None:
    viewer = create_token(api.settings, ["viewer"], "v")
    before = api.peak_rss()
    path = "/api/v1/worker/jobs/1/publish?token=t&ref=r&commit=" + "a" * 40
    head = (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\nContent-Length: %d\r\n\r\n"
            % (path.encode(), viewer.encode(), 300 * MB))  # fmt: skip
    answer = send_until_answered(api.port, head, 300 * MB)
    assert answer.startswith(b"HTTP/1.1 403"), answer[:200]
    assert api.peak_rss() - before < 5 * MB


def test_every_other_route_takes_a_small_body_even_from_a_worker(api: Api) -> None:
    worker = create_token(api.settings, ["worker"], "w")
    url = f"http://127.0.0.1:{api.port}/api/v1"
    big = b"x" * (api.settings.max_body_bytes + 1)
    for path in ("/worker/studies/ended", "/worker/jobs/1/claim", "/worker/learning/1/progress"):
        resp = httpx.post(url + path, content=big, headers={"Authorization": f"Bearer {worker}"})
        assert resp.status_code == 413, (path, resp.status_code, resp.text[:200])
    # A bundle may be larger than that: it passes the cap and reaches its route (no job 1 runs).
    resp = httpx.post(url + "/worker/jobs/1/publish", params={"token": "t", "ref": "r", "commit": "a" * 40},
                      content=big, headers={"Authorization": f"Bearer {worker}"})  # fmt: skip
    assert resp.status_code == 409, resp.text
