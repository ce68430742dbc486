"""Node fates read through the API, in bulk (GET /tree) and one by one, on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlmodel import col, select

from backend.api.main import create_app
from backend.api.serializers import study_public
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Node, Study
from backend.core.security import create_token
from backend.services.studies import create_study
from tests.support.repos import make_repo, tiny_files
from tests.support.services import drop_postgres_database, postgres_database


@pytest.fixture(params=["sqlite", "postgres"])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    name = f"grove_fates_{os.getpid()}_{uuid.uuid4().hex[:8]}"  # an engine is cached per URL
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


def test_the_kept_tree_reads_as_a_fresh_one_after_every_kind_of_change(
    settings: Settings, tmp_path: Path
) -> None:
    from sqlalchemy import event

    from backend.api import schemas
    from backend.services.fates import study_fates, told_of

    repo = make_repo(tmp_path / "r", tiny_files(name="kept"))
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, tiny_files(name="kept")["grove.toml"], str(repo))
    sid, root = study.id or 0, study.trunk_node_id
    with db.session(settings.db_url) as s:
        st = s.get(Study, sid)
        assert st is not None
        for i in range(30):
            s.add(Node(study_id=sid, parent_id=root, depth=1, title=f"n{i}", status="evaluated",
                       base_commit=st.trunk_commit, dev_mean=0.5, dev_n=2, gain=0.1, gain_lcb=0.05))  # fmt: skip
    fields = [f for f in schemas.NodeSummary.model_fields]
    headers = {"Authorization": f"Bearer {create_token(settings, ['viewer'], 'v')}"}
    seen: list[str] = []

    def count(conn, cursor, statement, params, context, executemany) -> None:  # type: ignore[no-untyped-def]
        seen.append(statement)

    def fresh() -> list[dict[str, object]]:
        with db.session(settings.db_url) as s:
            st = s.get(Study, sid)
            assert st is not None
            fate = study_fates(s, st)
            nodes = s.exec(select(Node).where(Node.study_id == sid).order_by(col(Node.id))).all()
            told = {n.id: {**told_of(s, n)._asdict(), "fate": fate[n.id or 0]} for n in nodes}
            return [{f: told[n.id][f] if f in told[n.id] else getattr(n, f) for f in fields} for n in nodes]

    with TestClient(create_app(settings)) as client:
        node_reads: list[str] = []

        def read() -> list[dict[str, object]]:
            seen.clear()
            nodes: list[dict[str, object]] = client.get(
                f"/api/v1/studies/{sid}/tree", headers=headers
            ).json()["nodes"]
            node_reads[:] = [q for q in seen if "FROM node" in q]
            assert nodes == fresh()
            return nodes

        read()
        event.listen(db.get_engine(settings.db_url), "before_cursor_execute", count)
        try:
            read()  # nothing changed: only the stamps are read
            assert len(node_reads) == 1, node_reads
            with db.session(settings.db_url) as s:
                ids = [
                    n.id or 0 for n in s.exec(select(Node).where(Node.study_id == sid).order_by(col(Node.id)))
                ]
                a, b, c = (s.get(Node, i) for i in ids[3:6])
                assert a is not None and b is not None and c is not None
                a.status, a.status_by = "merged", "ada"  # its own row changes
                b.status, b.verification = "rejected", {"decision": "refine", "open_constraints": ["size"]}
                s.add_all([a, b])
            read()
            with db.session(settings.db_url) as s:  # a refine child: its parent's row does not change
                s.add(
                    Node(
                        study_id=sid,
                        parent_id=b.id,
                        depth=2,
                        origin="refine",
                        origin_ref=b.id,
                        title="refine",
                    )
                )
            assert any("refined as" in str(n["fate"]) for n in read())
            with db.session(settings.db_url) as s:  # trunk moves: every evaluated node's fate may change
                st = s.get(Study, sid)
                assert st is not None
                st.trunk_commit = "0" * 40
                s.add(st)
            read()
            with db.session(settings.db_url) as s:  # a node removed, nothing else changed
                last = s.get(Node, ids[-1])
                assert last is not None
                s.delete(last)
            assert ids[-1] not in {n["id"] for n in read()}
        finally:
            event.remove(db.get_engine(settings.db_url), "before_cursor_execute", count)


def test_best_dev_is_the_best_node_whose_constraints_held(settings: Settings, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(name="best"))
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
        sid, root = study.id or 0, study.trunk_node_id
        root_node = s.get(Node, root)
        assert root_node is not None
        root_node.dev_mean = 0.2
        s.add(root_node)
        for title, dev, decision in (
            ("fits", 0.5, "accept"),
            ("too big", 0.9, "refine"),
            ("worse", 0.1, "reject"),
        ):
            s.add(Node(study_id=sid, parent_id=root, depth=1, title=title, status="evaluated", dev_mean=dev,
                       verification={"decision": decision}))  # fmt: skip
    with db.session(settings.db_url) as s:
        st = s.get(Study, sid)
        assert st is not None
        # The tiny study maximizes: the node that broke a constraint is not the best, however good.
        assert study_public(s, st).best_dev == 0.5
