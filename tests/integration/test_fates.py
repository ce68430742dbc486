"""Node fates read through the API, in bulk (GET /tree) and one by one, on SQLite and PostgreSQL."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from backend.api.main import create_app
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Node, Study
from backend.core.security import create_token
from backend.services.studies import create_study
from tests.conftest import drop_postgres_database, make_repo, postgres_database, tiny_files


@pytest.fixture(params=["sqlite", "postgres"])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    name = f"grove_fates_{os.getpid()}"
    url = postgres_database(name) if request.param == "postgres" else None
    s = Settings(data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt", database_url=url)
    s.ensure_dirs()
    yield s
    if url:
        db.get_engine(s.db_url).dispose()
        drop_postgres_database(name)


def test_every_fate_reads_the_same_in_the_tree_and_on_the_node(settings: Settings, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(name="fates"))
    earlier = make_repo(tmp_path / "e", tiny_files(name="earlier"))
    with db.session(settings.db_url) as s:  # another study first: node ids and numbers differ
        create_study(s, settings, tiny_files(name="earlier")["grove.toml"], str(earlier))
        study = create_study(s, settings, tiny_files(name="fates")["grove.toml"], str(repo))
    sid, root = study.id or 0, study.trunk_node_id
    refine = {"decision": "refine", "open_constraints": ["size"], "reason": "size open"}
    cases = {
        "merged by ada": dict(status="merged", status_by="ada"),
        "rejected by ada: too risky": dict(status="rejected", status_by="ada", status_reason="too risky", gated=True),
        "not a gate candidate: dev LCB \u22120.003 \u2264 0": dict(status="evaluated", gain_lcb=-0.003, verification={"decision": "reject"}),
        "constraint size open \u2192 refined as n{child}": dict(status="rejected", verification=refine),
        "failed: exited with code 1": dict(status="failed", failure="exited with code 1"),
        "pruned by ada: not worth it": dict(status="pruned", status_by="ada", status_reason="not worth it"),
    }  # fmt: skip
    ids: dict[str, int] = {}
    with db.session(settings.db_url) as s:
        st = s.get(Study, sid)
        assert st is not None
        for line, fields in cases.items():
            node = Node(
                study_id=sid, parent_id=root, depth=1, title=line, base_commit=st.trunk_commit, **fields
            )
            s.add(node)
            s.flush()
            ids[line] = node.id or 0
        refined = ids["constraint size open \u2192 refined as n{child}"]
        child = Node(
            study_id=sid, parent_id=refined, depth=2, origin="refine", origin_ref=refined, title="refine"
        )
        s.add(child)
        s.flush()
        child_number = child.number
        assert child_number != child.id
    token = create_token(settings, ["viewer"], "v")
    headers = {"Authorization": f"Bearer {token}"}
    with TestClient(create_app(settings)) as client:
        tree = {
            n["id"]: n["fate"]
            for n in client.get(f"/api/v1/studies/{sid}/tree", headers=headers).json()["nodes"]
        }
        for line, nid in ids.items():
            want = line.format(child=child_number)
            assert tree[nid] == want
            assert client.get(f"/api/v1/studies/{sid}/nodes/{nid}", headers=headers).json()["fate"] == want
        assert tree[root] == "the baseline: trunk at the study's start"
