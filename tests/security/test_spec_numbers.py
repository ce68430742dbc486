"""A spec's integer of thousands of digits is a spec error naming the key or the line, never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_lib

from backend.api.main import create_app
from backend.core.config import Settings
from backend.core.security import create_token
from tests.support.repos import make_repo, tiny_files
from tests.support.services import serve
from tests.support.waiting import free_port

DIGITS = "9" * 5000  # past Python's int-string limit (4,300 digits): tomllib raises a plain ValueError
HEX = "0x" + "f" * 5000  # parses (no limit for hexadecimal), and then cannot be printed in decimal


@pytest.fixture
def api(tmp_path: Path, redis_url: str) -> Iterator[tuple[str, Path, dict[str, str]]]:
    broker = redis_url.rsplit("/", 1)[0] + "/5"
    settings = Settings(
        data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt", redis_url=broker, repo_roots=str(tmp_path)
    )
    settings.ensure_dirs()
    repo = make_repo(tmp_path / "repo", tiny_files(name="numbers"))
    port = free_port()
    server, thread = serve(create_app(settings), port)
    headers = {"Authorization": f"Bearer {create_token(settings, ['operator'], 'op')}"}
    yield f"http://127.0.0.1:{port}/api/v1", repo, headers
    server.should_exit = True
    thread.join(timeout=10)
    redis_lib.Redis.from_url(broker).flushdb()


@pytest.mark.parametrize(
    ("old", "new", "key", "words"),
    [
        ("timeout = 60", f"timeout = {DIGITS}", "spec", "line 12 holds an integer of thousands of digits"),
        ("timeout = 60", f"timeout = -1_{DIGITS}", "spec", "line 12 holds an integer of thousands of digits"),
        ("timeout = 60", f"timeout = {HEX}", "spec.evaluate.timeout", "64-bit"),
        ("seed = 0", f"seed = {HEX}", "spec.policy.seed", "64-bit"),
        ("seed = 0", "seed = 9223372036854775808", "spec.policy.seed", "64-bit"),
        ("[0, 1, 2, 3, 4, 5]", f"[0, {HEX}]", 'spec.search."config.toml:knob.x".values[1]', "64-bit"),
    ],
)
def test_a_huge_integer_is_a_422_naming_where_it_is(
    api: tuple[str, Path, dict[str, str]], old: str, new: str, key: str, words: str
) -> None:
    url, repo, headers = api
    text = (repo / "grove.toml").read_text()
    assert old in text
    body = {"spec": text.replace(old, new, 1), "repository": str(repo)}
    for route in ("/studies/validate", "/studies"):
        resp = httpx.post(f"{url}{route}", json=body, headers=headers, timeout=60)
        assert resp.status_code == 422, (route, resp.status_code, resp.text[:300])
        [error] = resp.json()["detail"]["errors"]
        assert error["key"] == key and words in error["message"], (route, error)
    # The spec as it was is fine: the refusal is the number's.
    fine = httpx.post(f"{url}/studies/validate", json={**body, "spec": text}, headers=headers, timeout=60)
    assert fine.status_code == 200, fine.text
