"""The worker git route serves one study's repository: no path of it reaches another folder."""

from __future__ import annotations

import http.client
import subprocess
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from backend.api.main import create_app
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Job, Node, Study
from backend.core.security import create_token
from backend.engine.jobstore import token_hash
from backend.services.studies import create_study
from tests.support.repos import make_repo, tiny_files
from tests.support.services import serve
from tests.support.waiting import free_port

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


def _sealed_objects(r: Route) -> tuple[str, list[str]]:
    """Return the sealed blob's loose-object path and the clone's pack files, both present on disk."""
    repo = Path(r.mine.repo_path)
    base = f"refs/grove/sealed/{r.mine.name}"
    blob = subprocess.run(["git", "rev-parse", f"{base}:data/test/offset.txt"], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    # The same object written loose as well (a clone keeps its objects packed): both forms must be refused.
    loose = f"objects/{blob[:2]}/{blob[2:]}"
    content = b"777.125\n"
    (repo / ".git" / loose).parent.mkdir(exist_ok=True)
    (repo / ".git" / loose).write_bytes(zlib.compress(b"blob %d\0" % len(content) + content))
    packs = sorted(p.relative_to(p.parents[2]).as_posix() for p in repo.glob("**/objects/pack/pack-*.*"))
    assert packs, "the clone has no pack to ask for"
    return loose, packs


def test_the_dumb_protocol_serves_nothing(route: Route) -> None:
    loose, packs = _sealed_objects(route)
    sealed_ref = f"refs/grove/sealed/{route.mine.name}".encode()
    for raw in ["info/refs", "info/refs?service=git-receive-pack", "objects/info/packs", "HEAD",
                "objects/info/alternates", "objects/info/http-alternates", "info/refs?service=git-upload-pack&x=1",
                loose, *packs]:  # fmt: skip
        code, body = get(route, raw)
        assert code == 403, (raw, code, body[:200])
        assert sealed_ref not in body and b"777.125" not in body and not body.startswith(b"PACK"), raw


def test_the_smart_fetch_does_not_reach_the_sealed_base(route: Route, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{route.port}/api/v1/worker/git/{route.mine.id}"
    extra = [f"http.extraHeader={k}: {v}" for k, v in route.headers.items()]
    args = [a for e in extra for a in ("-c", e)]
    run = subprocess.run(["git", *args, "ls-remote", url], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert f"refs/heads/grove/{route.mine.name}/trunk" in run.stdout
    assert "refs/grove/sealed" not in run.stdout and "refs/heads/main" not in run.stdout
    # Wanting the sealed base by its id is refused: protocol v0 takes advertised tips only.
    sealed = subprocess.run(["git", "rev-parse", f"refs/grove/sealed/{route.mine.name}"], cwd=route.mine.repo_path,
                            check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    local = tmp_path / "local"
    subprocess.run(["git", "init", "-q", str(local)], check=True)
    got = subprocess.run(["git", *args, "-c", "protocol.version=2", "fetch", "-q", url, sealed], cwd=local,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert got.returncode != 0
    shown = subprocess.run(["git", "cat-file", "-e", sealed], cwd=local, capture_output=True)
    assert shown.returncode != 0
