"""Clones of repositories from URLs: hosts inside the server's network are refused, and a clone that
hangs neither holds a coordinator slot nor shows viewers how the network answered.

Real parts only: the API over loopback, a real Redis, real Celery workers, real git against TCP
servers on loopback.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from sqlmodel import col, select

from backend.api.main import create_app
from backend.core import cloning, db
from backend.core.config import Settings
from backend.core.models import Job, Study
from backend.core.security import create_token
from tests.support.repos import make_repo, tiny_files
from tests.support.services import Service, serve, sqlite_service
from tests.support.waiting import free_port, wait_for


class Silent:
    """A TCP server on loopback that accepts every connection and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.held: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                continue

    def close(self) -> None:
        """Stop accepting and hang up: a clone still waiting on it fails at once."""
        self.stop.set()
        self.thread.join(timeout=5)
        for c in self.held:
            c.close()
        self.sock.close()


@pytest.fixture
def silent() -> Iterator[Silent]:
    server = Silent()
    yield server
    server.close()


def bearer(settings: Settings, role: str = "operator") -> dict[str, str]:
    return {"Authorization": f"Bearer {create_token(settings, [role], 'clone-policy')}"}


@pytest.fixture
def api(tmp_path: Path, redis_url: str) -> Iterator[tuple[str, Settings]]:
    """The API over loopback (no workers: a refused source never reaches one)."""
    settings = Settings(data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt", redis_url=redis_url)
    settings.ensure_dirs()
    port = free_port()
    server, thread = serve(create_app(settings), port)
    yield f"http://127.0.0.1:{port}/api/v1", settings
    server.should_exit = True
    thread.join(timeout=10)


INSIDE = [
    "git://127.0.0.1:6379/x",  # Redis on this machine
    "https://169.254.169.254/latest/meta-data/",  # a cloud's metadata service (link-local)
    "ssh://[::1]/x",
    "https://0x7f000001/x",  # 127.0.0.1 in hex
    "https://2130706433/x",  # 127.0.0.1 as one number
    "https://0177.0.0.1/x",  # 127.0.0.1 in octal
    "https://127.1/x",
    "https://[::ffff:127.0.0.1]/x",  # IPv4-mapped
    "https://[2002:7f00:1::]/x",  # 6to4 around 127.0.0.1
    "https://localhost/x",
    "git@localhost:x.git",  # scp-like ssh
    "ssh://git@10.1.2.3:2222/x",  # private
    "https://192.168.1.1/x",
    "https://[fe80::1]/x",  # link-local
    "git://0.0.0.0/x",  # unspecified
    "https://[::]/x",
    "https://224.0.0.1/x",  # multicast
    "https://100.64.0.1/x",  # shared address space
    "https://240.0.0.1/x",  # reserved
]


@pytest.mark.parametrize("source", INSIDE)
def test_urls_inside_the_servers_network_are_refused_naming_the_repository(
    api: tuple[str, Settings], source: str
) -> None:
    url, settings = api
    spec = tiny_files(name="inside")["grove.toml"]
    for path in ("/studies", "/studies/validate"):
        resp = httpx.post(f"{url}{path}", json={"spec": spec, "repository": source}, headers=bearer(settings))
        assert resp.status_code == 422, (path, resp.text)
        detail = resp.json()["detail"]
        assert detail["errors"][0]["key"] == "repository", detail
        assert "inside this server's network" in detail["message"] and "GROVE_REPO_HOSTS" in detail["message"]
    with db.session(settings.db_url) as s:
        assert s.exec(select(Study)).all() == []  # nothing was created, nothing sent


@pytest.mark.parametrize(
    ("source", "said"),
    [
        ("https://no-such-host.invalid/x", "cannot resolve host 'no-such-host.invalid'"),
        ("https://github.com\\@127.0.0.1/x", "cannot read the host"),  # parsers disagree on the host
        ("https://a@b@127.0.0.1/x", "cannot read the host"),
        ("ssh://-oProxyCommand=touch%20x@example.org/x", "cannot read the host"),
        ("http://169.254.169.254/", "scheme 'http' is not allowed"),
        ("git+ssh://127.0.0.1/x", "scheme 'git+ssh' is not allowed"),
    ],
)
def test_unresolvable_or_unreadable_hosts_are_a_clear_422(
    api: tuple[str, Settings], source: str, said: str
) -> None:
    url, settings = api
    spec = tiny_files(name="odd")["grove.toml"]
    resp = httpx.post(f"{url}/studies", json={"spec": spec, "repository": source}, headers=bearer(settings))
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert detail["errors"][0]["key"] == "repository" and said in detail["message"], detail


def test_the_operator_allows_inside_hosts_in_GROVE_REPO_HOSTS_and_then_only_those(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Addresses, networks and names; the older name of the setting still works.
    monkeypatch.setenv("GROVE_GIT_ALLOWED_HOSTS", "127.0.0.0/8, ::1 ,169.254.169.254,localhost")
    monkeypatch.setenv("GROVE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("GROVE_WORKTREES_DIR", str(tmp_path / "wt"))
    monkeypatch.setenv("GROVE_REDIS_URL", redis_url)
    settings = Settings()
    assert settings.repo_hosts.startswith("127.0.0.0/8")
    settings.clone_first_byte_timeout = 2.0  # validate asks each host; none of these serves git
    settings.ensure_dirs()
    port = free_port()
    server, thread = serve(create_app(settings), port)
    try:
        url, headers = f"http://127.0.0.1:{port}/api/v1", bearer(settings)
        spec = tiny_files(name="allowed")["grove.toml"]
        for source in ("git://127.0.0.1:6379/x", "https://0x7f000001/x", "https://127.1/x", "ssh://[::1]/x",
                       "https://[::ffff:127.0.0.1]/x", "https://169.254.169.254/latest/", "git@localhost:x.git"):  # fmt: skip
            resp = httpx.post(
                f"{url}/studies/validate",
                json={"spec": spec, "repository": source},
                headers=headers,
                timeout=30,
            )
            # The policy lets each through; validate then finds that nothing there serves a repository.
            said = resp.json()["detail"]["message"]
            assert resp.status_code == 422 and said.startswith("repository: "), (source, resp.text)
            assert "GROVE_REPO_HOSTS" not in said and "inside this server's network" not in said, said
            assert "did not answer" in said or "cannot read the repository at" in said, said
        for source, said in (
            ("https://10.1.2.3/x", "host '10.1.2.3' is not in GROVE_REPO_HOSTS"),
            ("https://8.8.8.8/x", "host '8.8.8.8' is not in GROVE_REPO_HOSTS"),  # set: nothing else
            ("https://169.254.169.253/x", "is not in GROVE_REPO_HOSTS"),
        ):
            resp = httpx.post(f"{url}/studies", json={"spec": spec, "repository": source}, headers=headers)
            assert resp.status_code == 422 and said in resp.json()["detail"]["message"], resp.text
            assert resp.json()["detail"]["errors"][0]["key"] == "repository"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_the_clone_connects_to_the_address_that_was_checked(silent: Silent, tmp_path: Path) -> None:
    # A name nobody resolves, checked at 127.0.0.1: git reaches the silent server there (so it is
    # killed for silence, not refused for the name), whatever DNS would answer by the time it clones.
    for source in (f"https://pinned.invalid:{silent.port}/r", f"git://Pinned.invalid:{silent.port}/r"):
        checked = cloning.Checked(cloning.parse(source), (ipaddress.ip_address("127.0.0.1"),))
        before = len(silent.held)
        with pytest.raises(cloning.CloneStalled) as failed:
            cloning.clone(source, tmp_path / "dest", timeout=30, first_byte_timeout=1, checked=checked)
        assert failed.value.first_byte and len(silent.held) > before, source
        said = cloning.failure(source, failed.value)
        assert (
            said
            == "repository: could not clone from pinned.invalid: the host did not send anything within 1 s"
        )


def start_service(
    root: Path, redis_url: str, db_number: int, env: dict[str, str], whole: bool = True
) -> Service:
    """A clone worker (two slots); `whole`: and a coordinator worker (two, with the reconciler) and a cpu worker (two)."""
    svc = sqlite_service(root, redis_url, db_number=db_number)
    redis.Redis.from_url(svc.settings.redis_url).flushdb()
    svc.env.update(env)
    svc.settings.repo_hosts = env.get("GROVE_REPO_HOSTS", "")
    if whole:
        svc.start_worker("policy-coord", "coordinator", 2, beat=True)
        svc.start_worker("policy-cpu", "cpu,sealed", 2)
    svc.start_worker("policy-clone", "clone", 2)
    return svc


def study(settings: Settings, sid: int) -> Study:
    with db.session(settings.db_url) as s:
        st = s.get(Study, sid)
        assert st is not None
        return st


def test_two_hanging_clones_do_not_hold_up_another_study(
    tmp_path: Path, redis_url: str, silent: Silent
) -> None:
    """The must-hold: two clones that hang hold the clone worker's slots, not the coordinator's."""
    svc = start_service(tmp_path / "svc", redis_url, 5, {"GROVE_REPO_HOSTS": "127.0.0.1"})
    port = free_port()
    server, thread = serve(create_app(svc.settings), port)
    try:
        url, headers = f"http://127.0.0.1:{port}/api/v1", bearer(svc.settings)
        hanging = []
        for name, source in (("hangs-git", f"git://127.0.0.1:{silent.port}/a"),
                             ("hangs-https", f"https://127.0.0.1:{silent.port}/b")):  # fmt: skip
            spec = tiny_files(name=name)["grove.toml"]
            resp = httpx.post(f"{url}/studies", json={"spec": spec, "repository": source}, headers=headers)
            assert resp.status_code == 201 and resp.json()["status"] == "cloning", resp.text
            hanging.append(resp.json()["id"])
        # Both clones are running: each holds its lease and a connection the server never answers.
        r = redis.Redis.from_url(svc.settings.redis_url)
        wait_for(lambda: all(r.exists(f"grove:clone:{sid}") for sid in hanging), timeout=30)
        wait_for(lambda: len(silent.held) >= 2, timeout=30)

        repo = make_repo(tmp_path / "local", tiny_files(name="goes-on", experiments=2))
        body = {"spec": (repo / "grove.toml").read_text(), "repository": str(repo)}
        resp = httpx.post(f"{url}/studies", json=body, headers=headers)
        assert resp.status_code == 201, resp.text
        sid = resp.json()["id"]

        def experiments_started() -> bool:
            with db.session(svc.settings.db_url) as s:
                jobs = s.exec(
                    select(Job).where(
                        Job.study_id == sid, Job.kind == "experiment", col(Job.started_at).is_not(None)
                    )
                ).all()
            return bool(jobs)

        wait_for(experiments_started, timeout=10)
        # ...while the two clones still hang.
        assert [study(svc.settings, h).status for h in hanging] == ["cloning", "cloning"]
        assert all(r.exists(f"grove:clone:{h}") for h in hanging)
        # Received by the clone worker (twice), never by the coordinator.
        assert (svc.logs / "policy-clone.log").read_text().count("clone.repository[") >= 2
        assert "clone.repository[" not in (svc.logs / "policy-coord.log").read_text()
        silent.close()  # the hanging clones fail at once: the workers stop without waiting on them
        wait_for(lambda: all(study(svc.settings, h).status == "failed" for h in hanging), timeout=30)
    finally:
        silent.close()  # a clone still waiting fails at once, so the workers stop without waiting on it
        server.should_exit = True
        thread.join(timeout=10)
        svc.stop()


def test_a_clone_that_gets_no_byte_fails_soon_with_a_plain_reason(
    tmp_path: Path, redis_url: str, silent: Silent
) -> None:
    env = {
        "GROVE_REPO_HOSTS": "127.0.0.1",
        "GROVE_CLONE_FIRST_BYTE_TIMEOUT": "2",
        "GROVE_CLONE_TIMEOUT": "120",
    }
    svc = start_service(
        tmp_path / "svc", redis_url, 6, env, whole=False
    )  # clones that fail need nothing else
    port = free_port()
    server, thread = serve(create_app(svc.settings), port)
    closed = free_port()  # nothing listens there
    try:
        url, headers = f"http://127.0.0.1:{port}/api/v1", bearer(svc.settings)
        viewer = bearer(svc.settings, "viewer")
        cases = {
            "silent-git": (f"git://127.0.0.1:{silent.port}/r", "the host did not send anything within 2 s"),
            "silent-https": (
                f"https://127.0.0.1:{silent.port}/r",
                "the host did not send anything within 2 s",
            ),
            "silent-ssh": (
                f"ssh://git@127.0.0.1:{silent.port}/r",
                "the host did not send anything within 2 s",
            ),
            "closed-git": (f"git://127.0.0.1:{closed}/r", "the host refused or could not be reached"),
            "closed-https": (f"https://127.0.0.1:{closed}/r", "the host refused or could not be reached"),
        }
        ids = {}
        for name, (source, _) in cases.items():
            spec = tiny_files(name=name)["grove.toml"]
            resp = httpx.post(f"{url}/studies", json={"spec": spec, "repository": source}, headers=headers)
            assert resp.status_code == 201, resp.text
            ids[name] = resp.json()["id"]

        def ended() -> bool:
            return all(
                httpx.get(f"{url}/studies/{sid}", headers=viewer).json()["status"] == "failed"
                for sid in ids.values()
            )

        # Two clone slots, five clones: the silent ones take 2 s each, far less than GROVE_CLONE_TIMEOUT.
        wait_for(ended, timeout=30)
        for name, (_, plain) in cases.items():
            reason = httpx.get(f"{url}/studies/{ids[name]}", headers=viewer).json()["stop_reason"]
            assert reason == f"repository: could not clone from 127.0.0.1: {plain}", reason
            for port_number in (silent.port, closed):
                assert str(port_number) not in reason
            for leak in (
                "errno",
                "refused (",
                "Connection",
                "fatal",
                "curl",
                "ssh:",
                "timed out",
                "connect to",
            ):
                assert leak not in reason, reason
        # The full error is in the clone worker's log, for the operator.
        log = (svc.logs / "policy-clone.log").read_text()
        assert "no byte arrived within 2s" in log and "Connection refused" in log
    finally:
        silent.close()  # a clone still waiting fails at once, so the workers stop without waiting on it
        server.should_exit = True
        thread.join(timeout=10)
        svc.stop()
