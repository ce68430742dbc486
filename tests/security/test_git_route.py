"""The worker git route serves one study's repository: no path of it reaches another folder."""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from backend.api.main import create_app
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Job, Node, Study
from backend.core.security import create_token
from backend.engine.jobstore import token_hash
from backend.services.studies import create_study
from tests.conftest import free_port, make_repo, serve, tiny_files

TOKEN = "0123456789abcdef0123456789abcdef"


@dataclass
class Route:
    port: int
    headers: dict[str, str]
    mine: Study
    theirs: Study


@pytest.fixture(scope="module")
def route(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Route]:
    root = tmp_path_factory.mktemp("gitroute")
    settings = Settings(data_dir=root / "data", worktrees_dir=root / "wt", redis_url=redis_url)
    settings.ensure_dirs()
    with db.session(settings.db_url) as s:
        mine, theirs = (
            create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
            for repo in (make_repo(root / n, tiny_files(name=n)) for n in ("mine", "theirs"))
        )
        node = Node(study_id=mine.id or 0, parent_id=mine.trunk_node_id, depth=1, title="x", status="running",
                    base_commit=mine.trunk_commit, branch=f"grove/{mine.name}/n99")  # fmt: skip
        s.add(node)
        s.flush()
        job = Job(study_id=mine.id or 0, node_id=node.id or 0, attempt=1, status="running")
        job.token = token_hash(TOKEN)
        s.add(job)
        s.flush()
        for row in (mine, theirs, job):
            s.refresh(row)
            s.expunge(row)
    port = free_port()
    server, thread = serve(create_app(settings), port)
    worker = create_token(settings, ["worker"], "fleet")
    headers = {"Authorization": f"Bearer {worker}", "X-Grove-Job": f"{job.id}:{TOKEN}"}
    yield Route(port, headers, mine, theirs)
    server.should_exit = True
    thread.join(timeout=10)


def get(r: Route, raw: str) -> tuple[int, bytes]:
    """GET a path exactly as written (no client normalises its dots or decodes its escapes)."""
    conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=30)
    try:
        conn.request("GET", f"/api/v1/worker/git/{r.mine.id}/{raw}", headers=r.headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


REFS = "info/refs?service=git-upload-pack"


def test_the_studys_own_refs_are_served(route: Route) -> None:
    code, body = get(route, REFS)
    assert code == 200 and f"refs/heads/grove/{route.mine.name}/trunk".encode() in body


@pytest.mark.parametrize(
    "raw",
    [
        "..%2Ftheirs%2F" + REFS,  # a job of one study reading another study's clone
        "..%2ftheirs/" + REFS,
        "%2E%2E%2Ftheirs%2F" + REFS,
        "..%2F..%2F..%2F..%2F..%2F..%2Fetc%2Fpasswd",
        "%2Fetc%2Fpasswd",
        "info%2Frefs?service=git-upload-pack",  # an encoded slash, even in a harmless path
        "info%5Crefs?service=git-upload-pack",
        "../theirs/" + REFS,  # the same, unencoded
        "./" + REFS,
        "/" + REFS,  # an absolute part
        "objects//info/packs",
        "HEAD%00",
    ],
)
def test_traversal_encoded_slashes_and_absolute_parts_are_refused(route: Route, raw: str) -> None:
    code, body = get(route, raw)
    assert 400 <= code < 500, (raw, code, body[:200])
    assert route.theirs.name.encode() not in body and b"root:" not in body
