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


def test_more_seeds_are_not_worth_it_beside_a_better_candidate_or_past_the_budget(
    settings: Settings, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "r", tiny_files(name="worth-it", experiments=6))
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
        sid, base = study.id or 0, study.trunk_commit

        def node(title: str, status: str, dev: float | None, decision: str, commit: str = base) -> Node:
            n = Node(study_id=sid, parent_id=study.trunk_node_id, depth=1, title=title, status=status,
                     dev_mean=dev, base_commit=commit, verification={"decision": decision})  # fmt: skip
            s.add(n)
            s.flush()
            return n

        mine = node("mine", "running", None, "")
        node("better but refined", "evaluated", 9.5, "refine")
        node("better on an old trunk", "evaluated", 9.5, "accept", commit="0" * 40)
        node("worse", "evaluated", 7.0, "accept")
        best = node("better", "awaiting_approval", 9.0, "accept")
        job = Job(study_id=sid, node_id=mine.id or 0, attempt=1, status="running", token="job-w")
        s.add(job)
        s.flush()
        store = DbStore(settings, sid, mine.id or 0, job.id or 0, "job-w")
        number = best.number
    assert store.not_worth_it(8.0, 0, 1) == f"n{number} is better on dev and already a candidate"
    assert store.not_worth_it(9.2, 0, 1) == ""  # better than every accepted candidate on its trunk
    # One experiment job so far (this one) of 6, and every 2 (`repeats`) extra runs count as one:
    # 1 run spent plus 5 more seeds of the node and of trunk is 1 + 11 // 2 = 6; one run more is 7.
    assert store.not_worth_it(9.2, 1, 5) == ""
    assert store.not_worth_it(9.2, 2, 5) == "the experiment budget would be overspent"
