"""A job's writes through its store: refused once the job is no longer running under its token."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.core import db
from backend.core.config import Settings
from backend.core.models import Job, Node, Study
from backend.engine import sealed
from backend.engine.jobstore import DbStore, Superseded, claim_sealed, token_hash
from backend.engine.site import LocalSite
from backend.services.storage import SqlStorage
from backend.services.studies import create_study
from tests.support.repos import make_repo, tiny_files


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
        job = Job(study_id=sid, node_id=node.id, attempt=0, kind="gate", token=token_hash("job-t-a0"))
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
        job = Job(study_id=sid, node_id=mine.id or 0, attempt=1, status="running", token=token_hash("job-w"))
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


@pytest.mark.parametrize("claim", ["experiment", "sealed"])
def test_a_claim_that_races_a_cancellation_sees_it_and_runs_nothing(claim: str, tmp_path: Path) -> None:
    """A claim read before a stop's cancellation commits must not write its job back as running.

    PostgreSQL shows the claim waiting on the cancellation's lock, so the order is certain; the
    claim then has to read the job again, not write over what it read before.
    """
    import threading

    import psycopg

    from backend.engine.jobstore import claim_experiment
    from tests.support.services import PG_ADMIN, drop_postgres_database, postgres_database
    from tests.support.waiting import wait_for

    name = f"grove_test_claim_race_{claim}"
    settings = Settings(
        data_dir=tmp_path / "d", worktrees_dir=tmp_path / "w", database_url=postgres_database(name)
    )
    try:
        repo = make_repo(tmp_path / "r", tiny_files(name=f"claim-race-{claim}"))
        with db.session(settings.db_url) as s:
            study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
            sid = study.id or 0
            node = Node(study_id=sid, parent_id=study.trunk_node_id, depth=1, title="x = 3", status="queued")
            s.add(node)
            s.flush()
            kind = "experiment" if claim == "experiment" else "gate"
            job = Job(
                study_id=sid,
                node_id=node.id or 0,
                attempt=1 if kind == "experiment" else 0,
                kind=kind,
                token=token_hash("t"),
            )
            s.add(job)
            s.flush()
            jid = job.id or 0
        url = settings.db_url.replace("postgresql+psycopg://", "postgresql://", 1)
        stopper = psycopg.connect(url)  # a stop's cancellation, not yet committed
        stopper.execute("UPDATE job SET status = 'failed' WHERE id = %s", (jid,))
        got: list[object] = []

        def run() -> None:
            try:
                if claim == "experiment":
                    got.append(claim_experiment(settings, jid, "t", "host", 1))
                else:
                    got.append(claim_sealed(settings, jid, "t"))
            except Superseded as exc:
                got.append(exc)

        thread = threading.Thread(target=run)
        thread.start()

        def claim_waits() -> bool:
            with psycopg.connect(PG_ADMIN.rsplit("/", 1)[0] + f"/{name}", autocommit=True) as watch:
                row = watch.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = %s",
                    (name,),
                ).fetchone()
                return bool(row and row[0])

        wait_for(claim_waits, timeout=30)
        stopper.commit()
        stopper.close()
        thread.join(timeout=30)
        assert got and (isinstance(got[0], Superseded) or got[0] is None)
        with db.session(settings.db_url) as s:
            job_now = s.get(Job, jid)
            assert job_now is not None and job_now.status == "failed" and job_now.started_at is None
    finally:
        db.get_engine(settings.db_url).dispose()
        drop_postgres_database(name)
