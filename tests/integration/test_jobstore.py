"""A job's writes through its store: refused once the job is no longer running under its token."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.core import db
from backend.core.config import Settings
from backend.core.models import Job, Node, Study
from backend.engine import sealed
from backend.engine.jobstore import DbStore, Superseded, claim_sealed
from backend.engine.site import LocalSite
from backend.services.storage import SqlStorage
from backend.services.studies import create_study
from tests.conftest import make_repo, tiny_files


def test_a_gate_job_cancelled_by_a_stop_writes_no_verdict_or_query(
    settings: Settings, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(name="cancelled-gate"))
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
        sid, root = study.id or 0, study.trunk_node_id
        node = Node(study_id=sid, parent_id=root, depth=1, title="x = 3", status="evaluated", dev_mean=9.0)
        s.add(node)
        s.flush()
        job = Job(study_id=sid, node_id=node.id, attempt=0, kind="gate", token="job-t-a0")
        s.add(job)
        s.flush()
        nid, jid = node.id or 0, job.id or 0
    assert claim_sealed(settings, jid, "job-t-a0") is not None  # its worker started it
    store = DbStore(settings, sid, nid, jid, "job-t-a0")
    store.add_receipts(nid, [])  # while it runs, it may write
    SqlStorage(settings.db_url).cancel_active(sid)  # then the study is stopped
    for write in (
        lambda: store.test_query(),
        lambda: store.verdict(True, "passed: held-out gain +9", "c" * 40, [9.0], 9.0),
        lambda: store.keep_trunk_heldout("c" * 40, [1.0, 2.0]),
        lambda: store.gate_crashed("killed"),
        lambda: store.add_receipts(nid, []),
    ):
        with pytest.raises(Superseded):
            write()
    with db.session(settings.db_url) as s:
        node_now, study_now, job_now = s.get(Node, nid), s.get(Study, sid), s.get(Job, jid)
        assert node_now is not None and study_now is not None and job_now is not None
        assert not node_now.gated and node_now.status == "evaluated" and node_now.heldout_values == []
        assert study_now.test_queries == 0 and job_now.status == "failed"
    # A redelivered task of the cancelled job runs nothing and says so.
    assert sealed.run(LocalSite(settings), jid, "job-t-a0") == "superseded"
