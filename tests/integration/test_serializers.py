from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.api.serializers import study_public
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Node, Study
from backend.services.studies import create_study
from tests.conftest import drop_postgres_database, make_repo, postgres_database, tiny_files


@pytest.fixture(params=["sqlite", "postgres"])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    name = f"grove_best_{os.getpid()}_{uuid.uuid4().hex[:8]}"  # an engine is cached per URL
    url = postgres_database(name) if request.param == "postgres" else None
    s = Settings(data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt", database_url=url)
    s.ensure_dirs()
    yield s
    if url:
        db.get_engine(s.db_url).dispose()
        drop_postgres_database(name)


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
