"""Abuse at the service's edges: bodies, streams, tokens, repository sources, specs and model keys."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import select

from agents.spec import SpecError, parse_spec
from backend.api.main import create_app
from backend.core import db
from backend.core.config import PROJECT_ROOT, Settings
from backend.core.models import ApiToken, now
from backend.core.security import create_token, lookup
from backend.services.studies import create_study
from tests.support.fake_llm import FakeLLM
from tests.support.repos import make_repo, tiny_files
from tests.support.services import serve
from tests.support.waiting import free_port


@pytest.fixture
def api(tmp_path: Path, redis_url: str) -> Iterator[tuple[str, Settings]]:
    """Serve the API over loopback with small caps and repository roots under `tmp_path/allowed`."""
    settings = Settings(
        data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt", redis_url=redis_url, max_body_bytes=20_000,
        sse_per_token=2, repo_roots=str(tmp_path / "allowed"), repo_hosts="git.example.org",
    )  # fmt: skip
    settings.ensure_dirs()
    port = free_port()
    server, thread = serve(create_app(settings), port)
    yield f"http://127.0.0.1:{port}/api/v1", settings
    server.should_exit = True
    thread.join(timeout=10)


def bearer(settings: Settings, *roles: str, name: str = "t") -> dict[str, str]:
    return {"Authorization": f"Bearer {create_token(settings, list(roles), name)}"}


def test_a_body_over_the_cap_is_413_whether_announced_or_streamed(api: tuple[str, Settings]) -> None:
    url, settings = api
    headers = bearer(settings, "operator")
    big = {"spec": "x" * 50_000, "repository": "/nowhere"}
    assert httpx.post(f"{url}/studies", json=big, headers=headers).status_code == 413

    def chunks() -> Iterator[bytes]:
        yield b'{"spec": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'", "repository": "/nowhere"}'

    resp = httpx.post(
        f"{url}/studies", content=chunks(), headers={**headers, "Content-Type": "application/json"}
    )
    assert resp.status_code == 413 and "over 20000 bytes" in resp.text
    assert (
        httpx.post(f"{url}/studies", json={"spec": "", "repository": "x"}, headers=headers).status_code == 422
    )


def test_event_streams_are_capped_per_token(api: tuple[str, Settings], tmp_path: Path) -> None:
    url, settings = api
    repo = make_repo(tmp_path / "allowed" / "r", tiny_files(name="sse-cap"))
    with db.session(settings.db_url) as s:
        sid = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo)).id
    headers = bearer(settings, "viewer", name="watcher")
    other = bearer(settings, "viewer", name="someone-else")
    with httpx.Client(timeout=10) as client:
        first = client.send(
            client.build_request("GET", f"{url}/studies/{sid}/events", headers=headers), stream=True
        )
        second = client.send(
            client.build_request("GET", f"{url}/studies/{sid}/events", headers=headers), stream=True
        )
        try:
            assert first.status_code == second.status_code == 200
            third = client.get(f"{url}/studies/{sid}/events", headers=headers)
            assert third.status_code == 429 and "at most 2 open event streams" in third.text
            with client.stream("GET", f"{url}/studies/{sid}/events", headers=other) as theirs:
                assert theirs.status_code == 200  # the cap is per token
        finally:
            first.close()
        _wait_for_slot(client, f"{url}/studies/{sid}/events", headers)
        second.close()


def _wait_for_slot(client: httpx.Client, url: str, headers: dict[str, str]) -> None:
    """A closed stream frees its slot once the server notices the disconnect."""
    from tests.support.waiting import wait_for

    def free() -> bool:
        with client.stream("GET", url, headers=headers) as resp:
            return resp.status_code == 200

    wait_for(free, timeout=30)


def test_tokens_can_be_listed_revoked_and_expire(api: tuple[str, Settings]) -> None:
    url, settings = api
    env = {
        **os.environ,
        "GROVE_DATA_DIR": str(settings.data_dir),
        "GROVE_WORKTREES_DIR": str(settings.worktrees_dir),
    }

    def grove(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "backend.cli.main", *args], cwd=PROJECT_ROOT, env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    made = grove("token", "create", "--role", "viewer", "--name", "alice", "--expires-days", "30")
    token = made.stdout.strip()
    assert made.returncode == 0 and token.startswith("grove_")
    headers = {"Authorization": f"Bearer {token}"}
    assert httpx.get(f"{url}/studies", headers=headers).status_code == 200
    listed = grove("token", "list")
    assert "alice" in listed.stdout and "live" in listed.stdout and token not in listed.stdout
    assert grove("token", "revoke", "alice").returncode == 0
    assert httpx.get(f"{url}/studies", headers=headers).status_code == 401
    assert "revoked" in grove("token", "list").stdout
    assert grove("token", "revoke", "nobody").returncode == 1
    assert grove("token", "create", "--role", "viewer", "--expires-days", "0").returncode == 2

    late = create_token(settings, ["viewer"], "late", expires_days=1)
    with db.session(settings.db_url) as s:
        assert lookup(s, late) is not None
        row = s.exec(select(ApiToken).where(ApiToken.name == "late")).one()
        row.expires_at = now()
        s.add(row)
    assert httpx.get(f"{url}/studies", headers={"Authorization": f"Bearer {late}"}).status_code == 401
    assert "expired" in grove("token", "list").stdout


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{tmp}/outside", "must lie under"),
        ("file://{tmp}/outside", "file: URLs are not accepted"),
        ("file://{tmp}/allowed/x/..%2F..%2Foutside", "file: URLs are not accepted"),
        ("file://localhost/etc", "file: URLs are not accepted"),
        ("{tmp}/allowed/../outside", "must lie under"),
        ("--upload-pack=touch /tmp/x", "must not start with '-'"),
        ("{tmp}/allowed/\u0000x", "without control characters"),
        ("ext::sh -c touch% /tmp/pwned", "must lie under"),
        ("~no-such-user-on-this-server/r", "cannot expand '~no-such-user-on-this-server'"),
        ("http://git.example.org/r.git", "scheme 'http' is not allowed"),
        ("https://evil.example.com/r.git", "not in GROVE_REPO_HOSTS"),
        ("git@evil.example.com:r.git", "not in GROVE_REPO_HOSTS"),
    ],
)
def test_repository_sources_over_the_api_are_limited(
    api: tuple[str, Settings], tmp_path: Path, source: str, message: str
) -> None:
    url, settings = api
    repo = make_repo(tmp_path / "outside", tiny_files(name="outside"))
    body = {"spec": (repo / "grove.toml").read_text(), "repository": source.format(tmp=tmp_path)}
    for path in ("/studies", "/studies/validate"):
        resp = httpx.post(f"{url}{path}", json=body, headers=bearer(settings, "operator"))
        assert resp.status_code == 422, resp.text
        detail = resp.json()["detail"]
        assert detail["errors"][0]["key"] == "repository" and message in detail["message"]
    inside = make_repo(tmp_path / "allowed" / "ok", tiny_files(name="inside"))
    ok = {"spec": (inside / "grove.toml").read_text(), "repository": str(inside)}
    assert (
        httpx.post(f"{url}/studies/validate", json=ok, headers=bearer(settings, "operator")).status_code
        == 200
    )


def test_groves_own_clones_and_worktrees_cannot_be_submitted_as_a_repository(tmp_path: Path) -> None:
    # As `grove up` sets it: the repository root is the folder Grove runs in, its data folder inside.
    settings = Settings(
        data_dir=tmp_path / ".grove", worktrees_dir=tmp_path / "worktrees", repo_roots=str(tmp_path)
    )
    settings.ensure_dirs()
    victim = make_repo(tmp_path / "victim", tiny_files(name="victim"))
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (victim / "grove.toml").read_text(), str(victim))
    clone = Path(study.repo_path)
    assert clone.is_relative_to(settings.data_dir.resolve())
    worktree = settings.worktrees_dir / "victim" / "n1"
    worktree.mkdir(parents=True)
    port = free_port()
    server, thread = serve(create_app(settings), port)
    try:
        url, headers = f"http://127.0.0.1:{port}/api/v1", bearer(settings, "operator")
        spec = tiny_files(name="thief")["grove.toml"]
        for source in (clone, settings.data_dir, worktree, tmp_path / "victim" / ".." / ".grove" / "repos"):
            resp = httpx.post(
                f"{url}/studies/validate", json={"spec": spec, "repository": str(source)}, headers=headers
            )
            assert resp.status_code == 422, (source, resp.text)
            assert "inside Grove's own folder" in resp.json()["detail"]["message"]
        # The original is fine, and so is a snapshot `grove submit` made of a plain folder.
        imported = make_repo(settings.data_dir / "imports" / "plain-1", tiny_files(name="plain"))
        for source in (victim, imported):
            ok = httpx.post(
                f"{url}/studies/validate", json={"spec": spec, "repository": str(source)}, headers=headers
            )
            assert ok.status_code == 200, ok.text
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.parametrize(
    ("patch", "key"),
    [
        (("timeout = 60", "timeout = inf"), "evaluate.timeout"),
        (("timeout = 60", "timeout = nan"), "evaluate.timeout"),
        (("timeout = 60", "timeout = 1e12"), "evaluate.timeout"),
        (("margin = 0.5", "margin = inf"), "gate.margin"),
        (("parallel = 2", "parallel = 2\nhours = 1e308"), "budget.hours"),
        (("[policy]", "[sandbox]\nmemory_mb = 99999999999\n\n[policy]"), "sandbox.memory_mb"),
        (("[policy]", "[sandbox]\nprocesses = 10000000\n\n[policy]"), "sandbox.processes"),
        (("children = 2", 'children = 2\napi_key_env = "OPENAI_API_KEY"'), "policy.api_key_env"),
    ],
)
def test_spec_numbers_must_be_finite_and_sane(
    api: tuple[str, Settings], tmp_path: Path, patch: Any, key: str
) -> None:
    url, settings = api
    text = tiny_files(name="absurd")["grove.toml"].replace(*patch)
    with pytest.raises(SpecError) as err:
        parse_spec(text)
    assert [i.key for i in err.value.issues] == [key]
    repo = make_repo(tmp_path / "allowed" / "r", tiny_files(name="absurd"))
    resp = httpx.post(
        f"{url}/studies", json={"spec": text, "repository": str(repo)}, headers=bearer(settings, "operator")
    )
    assert resp.status_code == 422 and resp.json()["detail"]["errors"][0]["key"] == f"spec.{key}"


def test_a_deeply_nested_spec_is_a_clear_error(api: tuple[str, Settings], tmp_path: Path) -> None:
    url, settings = api
    text = "a = " + "[" * 5000 + "]" * 5000
    with pytest.raises(SpecError, match="nested too deeply"):
        parse_spec(text)
    repo = make_repo(tmp_path / "allowed" / "r", tiny_files(name="deep"))
    resp = httpx.post(
        f"{url}/studies", json={"spec": text, "repository": str(repo)}, headers=bearer(settings, "operator")
    )
    assert resp.status_code == 422 and "nested too deeply" in resp.text


def _authorization_sent(monkeypatch: pytest.MonkeyPatch, spec_extra: str, env: dict[str, str]) -> str:
    """Return the Authorization header a model call for a spec with this [policy] tail sends."""
    from agents.llm.model import LitellmModel, ModelConfig, Unbilled
    from agents.policies.registry import endpoint

    with FakeLLM({}) as attacker, monkeypatch.context() as m:
        files = tiny_files(name="keys")
        text = files["grove.toml"].replace(
            'kind = "search"', f'kind = "search"\napi_base = "{attacker.url}"{spec_extra}'
        )
        spec = parse_spec(text)
        m.delenv("GROVE_LLM_API_BASE", raising=False)
        for k, v in env.items():
            m.setenv(k, v.replace("{url}", attacker.url))
        base, key = endpoint(spec, "openai/fake-model")
        LitellmModel(
            ModelConfig(model="openai/fake-model", api_base=base, api_key=key, retries=0), Unbilled()
        ).complete(
            "ideator", [{"role": "system", "content": "ROLE: ideator"}, {"role": "user", "content": "hi"}]
        )
        return str(attacker.requests[-1]["authorization"])


def test_a_spec_api_base_never_gets_the_server_key_unless_allow_listed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = "sk-server-" + os.urandom(6).hex()
    assert _authorization_sent(monkeypatch, "", {"OPENAI_API_KEY": key}) == "Bearer no-key"
    allowed = {"OPENAI_API_KEY": key, "GROVE_LLM_API_BASES": "{url}"}
    assert _authorization_sent(monkeypatch, "", allowed) == f"Bearer {key}"
    own = '\napi_key_env = "GROVE_KEY_MINE"'
    assert (
        _authorization_sent(monkeypatch, own, {"OPENAI_API_KEY": key, "GROVE_KEY_MINE": "mine"})
        == "Bearer mine"
    )


def test_network_for_a_study_needs_the_operators_leave(api: tuple[str, Settings], tmp_path: Path) -> None:
    url, settings = api
    files = tiny_files(name="wants-net")
    files["grove.toml"] = files["grove.toml"].replace("[policy]", "[sandbox]\nnetwork = true\n\n[policy]")
    repo = make_repo(tmp_path / "allowed" / "net", files)
    body = {"spec": files["grove.toml"], "repository": str(repo)}
    resp = httpx.post(f"{url}/studies", json=body, headers=bearer(settings, "operator"))
    assert resp.status_code == 422 and resp.json()["detail"]["errors"][0]["key"] == "spec.sandbox.network"
    assert "GROVE_SANDBOX_NETWORK=true" in resp.text
    allowed = settings.model_copy(update={"sandbox_network": True})
    with db.session(allowed.db_url) as s:
        assert create_study(s, allowed, files["grove.toml"], str(repo)).status == "created"


def test_an_llm_study_with_no_model_is_refused_when_it_is_made(
    api: tuple[str, Settings], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GROVE_MODEL", raising=False)
    url, settings = api
    files = tiny_files(name="no-model")
    files["grove.toml"] = files["grove.toml"].replace('kind = "search"', 'kind = "llm"')
    assert 'kind = "llm"' in files["grove.toml"]
    repo = make_repo(tmp_path / "allowed" / "nomodel", files)
    body = {"spec": files["grove.toml"], "repository": str(repo)}
    for path in ("/studies/validate", "/studies"):
        resp = httpx.post(f"{url}{path}", json=body, headers=bearer(settings, "operator"))
        assert resp.status_code == 422, resp.text
        assert resp.json()["detail"]["errors"][0]["key"] == "spec.policy.model" and "GROVE_MODEL" in resp.text
    assert "no-model" not in httpx.get(f"{url}/studies", headers=bearer(settings, "viewer")).text
    # Named in the spec, it is accepted.
    named = files["grove.toml"].replace(
        'kind = "llm"',
        'kind = "llm"\nmodel = "openai/local"\ninput_usd_per_mtok = 0.1\noutput_usd_per_mtok = 0.1',
    )
    resp = httpx.post(
        f"{url}/studies/validate", json={**body, "spec": named}, headers=bearer(settings, "operator")
    )
    assert resp.status_code == 200, resp.text


def test_an_llm_study_whose_model_cannot_serve_it_is_refused_before_anything_runs(
    api: tuple[str, Settings], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    url, settings = api
    files = tiny_files(name="no-server")
    files["grove.toml"] = files["grove.toml"].replace(
        'kind = "search"',
        'kind = "llm"\nmodel = "openai/local"\ninput_usd_per_mtok = 0.1\noutput_usd_per_mtok = 0.1',
    )
    repo = make_repo(tmp_path / "allowed" / "noserver", files)
    body = {"spec": files["grove.toml"], "repository": str(repo)}

    def refused(key: str, *words: str) -> None:
        for path in ("/studies/validate", "/studies"):
            resp = httpx.post(f"{url}{path}", json=body, headers=bearer(settings, "operator"), timeout=30)
            assert resp.status_code == 422, resp.text
            errors = resp.json()["detail"]["errors"]
            assert any(e["key"] == key and all(w in e["message"] for w in words) for e in errors), errors
        assert "no-server" not in httpx.get(f"{url}/studies", headers=bearer(settings, "viewer")).text

    closed = free_port()  # nothing listens there
    monkeypatch.setenv("GROVE_LLM_API_BASE", f"http://127.0.0.1:{closed}/v1")
    refused("spec.policy.model", f"127.0.0.1:{closed}", "GROVE_LLM_API_BASE", "does not answer")

    class Small(BaseHTTPRequestHandler):  # a vLLM-like server that reports a 2,048-token context
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            data = b'{"object": "list", "data": [{"id": "local", "max_model_len": 2048}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    small = ThreadingHTTPServer(("127.0.0.1", 0), Small)
    Thread(target=small.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("GROVE_LLM_API_BASE", f"http://127.0.0.1:{small.server_address[1]}/v1")
        refused("spec.policy.max_input_tokens", "holds 2048 tokens", "at most")
        monkeypatch.setenv("GROVE_LLM_MAX_INPUT_TOKENS", "1000")
        monkeypatch.setenv("GROVE_LLM_MAX_OUTPUT_TOKENS", "512")
        refused("spec.policy.max_input_tokens", "GROVE_LLM_MAX_INPUT_TOKENS = 1000", "shortest prompt")
        # Limits that fit a server that answers are accepted.
        monkeypatch.setenv("GROVE_LLM_MAX_INPUT_TOKENS", "1536")
        monkeypatch.setenv("GROVE_LLM_MAX_OUTPUT_TOKENS", "512")
        resp = httpx.post(
            f"{url}/studies/validate", json=body, headers=bearer(settings, "operator"), timeout=30
        )
    finally:
        small.shutdown()
    assert resp.status_code == 200, resp.text


def test_the_api_never_fetches_a_spec_model_server_the_operator_has_not_listed(
    api: tuple[str, Settings], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    seen: list[str] = []

    class Listening(BaseHTTPRequestHandler):  # a host a spec would like the API to probe
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            seen.append(self.path)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    target = ThreadingHTTPServer(("127.0.0.1", 0), Listening)
    Thread(target=target.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{target.server_address[1]}/v1"
    url, settings = api
    monkeypatch.delenv("GROVE_LLM_API_BASE", raising=False)
    files = tiny_files(name="probe")
    files["grove.toml"] = files["grove.toml"].replace(
        'kind = "search"',
        f'kind = "llm"\nmodel = "openai/local"\napi_base = "{base}"\n'
        "input_usd_per_mtok = 0.1\noutput_usd_per_mtok = 0.1",
    )
    repo = make_repo(tmp_path / "allowed" / "probe", files)
    body = {"spec": files["grove.toml"], "repository": str(repo)}
    try:
        resp = httpx.post(
            f"{url}/studies/validate", json=body, headers=bearer(settings, "operator"), timeout=30
        )
        assert resp.status_code == 200, resp.text
        assert seen == []
        monkeypatch.setenv("GROVE_LLM_API_BASES", base)  # the operator's own: now it is asked
        resp = httpx.post(
            f"{url}/studies/validate", json=body, headers=bearer(settings, "operator"), timeout=30
        )
        assert resp.status_code == 200, resp.text
        assert seen == ["/v1/models"]
    finally:
        target.shutdown()
