"""The coordinator reads the tree in a fixed number of queries, whatever its size."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from sqlalchemy import event
from sqlmodel import Session, select

from agents.coordinator.evidence import tree_of
from agents.coordinator.ports import Integration, NodeRecord
from agents.coordinator.records import RecordIndex, index_of
from agents.policies.base import Proposal
from agents.tree.insights import InsightUpdate
from agents.tree.status import NodeStatus
from backend.core import db
from backend.core.config import Settings
from backend.core.models import InsightVersion, Job, Node, ReceiptRow, Trajectory
from backend.services.storage import SqlStorage
from backend.services.studies import create_study
from tests.support.repos import tiny_files


@contextmanager
def counting(url: str) -> Iterator[list[str]]:
    """Collect every SQL statement the engine runs inside the block."""
    seen: list[str] = []

    def before(conn, cursor, statement, params, context, executemany) -> None:  # type: ignore[no-untyped-def]
        seen.append(statement)

    engine = db.get_engine(url)
    event.listen(engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", before)


def grow(s: Session, study_id: int, root: int, count: int) -> None:
    """Add `count` evaluated nodes, each with two attempts, receipts, insights and a report."""
    for i in range(count):
        node = Node(
            study_id=study_id, parent_id=root, depth=1, status="evaluated", title=f"n{i}",
            dev_values=[1.0, 2.0], dev_mean=1.5, dev_n=2, attempts=2,
        )  # fmt: skip
        s.add(node)
        s.flush()
        assert node.id is not None
        old, new = (
            Job(study_id=study_id, node_id=node.id, attempt=1),
            Job(study_id=study_id, node_id=node.id, attempt=2),
        )
        s.add_all([old, new])
        s.flush()
        for job, value in ((old, 99.0), (new, float(i))):
            s.add(
                ReceiptRow(study_id=study_id, node_id=node.id, job_id=job.id, ok=True, metrics={"m": value})
            )
        s.add(ReceiptRow(study_id=study_id, node_id=node.id, job_id=new.id, ok=False, metrics={"m": -1.0}))
        s.add(InsightVersion(study_id=study_id, node_id=node.id, version=1, text="first"))
        s.add(InsightVersion(study_id=study_id, node_id=node.id, version=2, text=f"newest {i}"))
        s.add(Trajectory(study_id=study_id, node_id=node.id, job_id=old.id or 0, report="old report"))
        s.add(Trajectory(study_id=study_id, node_id=node.id, job_id=new.id or 0, report=f"report {i}"))
    s.commit()


def new_study(settings: Settings, repo: Path, grown: int = 0) -> tuple[int, int]:
    """Create the tiny study (with `grown` evaluated nodes); return its id and its root node's."""
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, tiny_files()["grove.toml"], str(repo))
        assert study.id is not None and study.trunk_node_id is not None
        sid, root = study.id, study.trunk_node_id
    if grown:
        with db.session(settings.db_url) as s:
            grow(s, sid, root, grown)
    return sid, root


def test_reading_the_tree_takes_the_same_queries_at_any_size(settings: Settings, tiny_repo: Path) -> None:
    sid, root = new_study(settings, tiny_repo)
    storage = SqlStorage(settings.db_url)
    counts = []
    # A first read loads everything; later reads fetch the stamps of what moved, then its rows.
    for more in (0, 20, 200):
        with db.session(settings.db_url) as s:
            grow(s, sid, root, more)
        storage.forget()  # a new coordinator step
        with counting(settings.db_url) as seen:
            records = storage.nodes(sid)
        counts.append(len([q for q in seen if q.lstrip().upper().startswith("SELECT")]))
    assert counts[0] <= 5 and counts[1] == counts[2] <= 6, counts
    assert len(records) == 1 + 20 + 200
    last = records[-1]
    # Only the latest attempt's clean dev receipts count; the newest insight; the latest job's report.
    assert last.evidence.dev_metrics == {"m": 199.0} and len(last.dev_receipts) == 1
    assert last.evidence.insight == "newest 199" and last.evidence.report == "report 199"
    assert records[0].evidence.parent_id is None and records[0].evidence.report == ""


def node_records_of(settings: Settings, sid: int) -> list[NodeRecord]:
    from backend.services.recordcache import node_records

    with db.session(settings.db_url) as s:
        return list(node_records(s, sid))


def test_the_cached_tree_matches_a_full_read_after_every_kind_of_change(
    settings: Settings, tiny_repo: Path
) -> None:
    from sqlmodel import select

    from backend.services.recordcache import RecordCache, node_records

    sid, _ = new_study(settings, tiny_repo, grown=30)
    # No look-back margin: only what the change markers say changed is read again.
    cache = RecordCache(margin=timedelta(0))

    def cached_read() -> list[object]:
        with db.session(settings.db_url) as s:
            records = cache.refresh(s, sid)
        # The groups a step reads and the tree view, kept up to date by what changed, read as
        # ones built afresh from a full read.
        fresh = node_records_of(settings, sid)
        want = RecordIndex(fresh)
        got = index_of(records)
        assert got.by_id == want.by_id and got.completed == want.completed and got.refs == want.refs
        assert {k: v for k, v in got.by_status.items() if v} == want.by_status
        assert {k: v for k, v in got.by_decision.items() if v} == want.by_decision
        assert {k: v for k, v in got.failed_by_attempts.items() if v} == want.failed_by_attempts
        view, afresh = tree_of(records), tree_of(list(fresh))
        assert view.nodes == afresh.nodes
        assert all(view.children(i) == afresh.children(i) for i in afresh.nodes)
        assert all(view.with_status(st) == afresh.with_status(st) for st in NodeStatus)
        return list(records)

    def full() -> list[object]:
        with db.session(settings.db_url) as s:
            return list(node_records(s, sid))

    assert cached_read() == full()
    with db.session(settings.db_url) as s:
        nodes = list(s.exec(select(Node).where(Node.study_id == sid).order_by(Node.id)))  # type: ignore[arg-type]
        old, other, third = nodes[3], nodes[7], nodes[11]
        old.dev_mean, old.status = 9.5, "rejected"  # a plain update of an old node
        old.verification = {"decision": "refine", "refine_goal": "fix it"}
        s.add(old)
        s.add(InsightVersion(study_id=sid, node_id=other.id or 0, version=3, text="second thoughts"))
        # Two writers raced to version 3: the later row is the insight, in a full read and the cache.
        s.add(InsightVersion(study_id=sid, node_id=other.id or 0, version=3, text="third thoughts"))
        job = Job(study_id=sid, node_id=third.id or 0, attempt=3)  # a new attempt: only its receipts count
        third.status = "failed"
        s.add(third)
        s.add(job)
        s.flush()
        s.add(ReceiptRow(study_id=sid, node_id=third.id, job_id=job.id, ok=True, metrics={"m": 42.0}))
        s.add(Trajectory(study_id=sid, node_id=third.id or 0, job_id=job.id or 0, report="third report"))
        s.add(
            Node(
                study_id=sid, parent_id=old.id, depth=2, status="proposed", title="new child", origin="refine"
            )
        )
    cached = cached_read()
    assert cached == full() and SqlStorage(settings.db_url).nodes(sid) == cached
    by_id = {r.evidence.id: r for r in cached}
    assert by_id[old.id or 0].evidence.dev_mean == 9.5 and by_id[old.id or 0].evidence.status == "rejected"
    assert by_id[other.id or 0].evidence.insight == "third thoughts"
    assert by_id[third.id or 0].evidence.dev_metrics == {"m": 42.0}
    assert by_id[third.id or 0].evidence.report == "third report"
    assert cached[-1].evidence.title == "new child"
    with db.session(settings.db_url) as s:  # the refine child is integrated, another node pruned
        child = s.exec(select(Node).where(Node.title == "new child")).one()
        child.status, child.completed_order, child.verification = "evaluated", 500, {"decision": "accept"}
        pruned = s.get(Node, other.id)
        assert pruned is not None
        pruned.status = "pruned"
        retried = s.get(Node, third.id)
        assert retried is not None
        retried.attempts = 3  # a failed node's attempts move it to another retry group
        s.add_all([child, pruned, retried])
    again = cached_read()
    assert again == cached_read()  # nothing changed: the same list, the same groups


def test_a_study_id_taken_over_by_another_study_is_read_afresh(settings: Settings, tiny_repo: Path) -> None:
    from sqlmodel import select

    from backend.services.recordcache import RecordCache

    with db.session(settings.db_url) as s:
        study = create_study(s, settings, tiny_files()["grove.toml"], str(tiny_repo))
        sid, root = study.id or 0, study.trunk_node_id or 0
        grow(s, sid, root, 3)
    cache = RecordCache(margin=timedelta(0))
    with db.session(settings.db_url) as s:
        assert len(cache.refresh(s, sid)) == 4
    # The study's rows go and others take its id (as a discarded study's may on SQLite).
    with db.session(settings.db_url) as s:
        for model in (ReceiptRow, InsightVersion, Trajectory, Job):
            for row in s.exec(select(model).where(model.study_id == sid)):  # type: ignore[attr-defined]
                s.delete(row)
        s.flush()
        for n in sorted(s.exec(select(Node).where(Node.study_id == sid)), key=lambda n: -(n.id or 0)):
            s.delete(n)
            s.flush()
        s.add(Node(study_id=sid, depth=0, status="merged", title="another root"))
    with db.session(settings.db_url) as s:
        records = cache.refresh(s, sid)
    assert [r.evidence.title for r in records] == ["another root"]


def test_a_coordinator_process_keeps_the_records_of_a_bounded_number_of_studies() -> None:
    from backend.services import recordcache

    url, cap = "sqlite://bound", recordcache.CACHED_STUDIES
    first = recordcache.cache_of(url, 1)
    for study_id in range(2, cap + 1):
        recordcache.cache_of(url, study_id)
    assert recordcache.cache_of(url, 1) is first  # used again: now the most recent
    recordcache.cache_of(url, cap + 1)  # one too many: the least recently used (study 2) goes
    mine = [key[1] for key in recordcache._CACHES if key[0] == url]
    assert len(mine) == cap and 2 not in mine and 1 in mine and cap + 1 in mine
    assert recordcache.cache_of(url, 1) is first


def test_a_step_reads_the_study_once_until_something_writes(settings: Settings, tiny_repo: Path) -> None:
    sid, root = new_study(settings, tiny_repo)
    storage = SqlStorage(settings.db_url)
    first, records = storage.study(sid), storage.nodes(sid)
    with counting(settings.db_url) as seen:
        again, same = storage.study(sid), storage.nodes(sid)
    assert seen == [] and again is first and same is records
    # Its own writes are read back: a new node, a new job, a new improvement state.
    [nid] = storage.add_proposals(
        sid, 1, [Proposal(parent_id=root, title="try", hypothesis={}, prior=0.5, edits={})]
    )
    assert nid in {r.evidence.id for r in storage.nodes(sid)}
    before = storage.study(sid).experiments_used
    storage.enqueue(sid, nid)
    assert storage.study(sid).experiments_used == before + 1
    storage.save_state(sid, {"plan": "next"}, 0)
    assert storage.study(sid).improvement_state == {"plan": "next"}
    assert {r.evidence.id: r.evidence.title for r in storage.nodes(sid)}[nid] == "try"
    # Another process's write is seen once the step ends (`forget`).
    with db.session(settings.db_url) as s:
        node = s.get(Node, nid)
        assert node is not None
        node.title = "renamed elsewhere"
        s.add(node)
    assert {r.evidence.id: r.evidence.title for r in storage.nodes(sid)}[nid] == "try"
    storage.forget()
    assert {r.evidence.id: r.evidence.title for r in storage.nodes(sid)}[nid] == "renamed elsewhere"


def test_after_its_own_writes_a_step_reads_back_only_the_rows_it_wrote(
    settings: Settings, tiny_repo: Path
) -> None:
    sid, root = new_study(settings, tiny_repo, grown=6)
    storage = SqlStorage(settings.db_url)
    first = storage.nodes(sid)
    done = first[3].evidence.id
    [nid] = storage.add_proposals(
        sid, 1, [Proposal(parent_id=done, title="next", hypothesis={}, prior=0.5, edits={})]
    )
    storage.enqueue(sid, nid)
    storage.record(
        sid,
        Integration(
            node_id=done, status="evaluated", gain=0.5, gain_lcb=0.1, constraints=[],
            verification={"decision": "accept"}, summary="it helped",
        ),
    )  # fmt: skip
    storage.add_insights(sid, [InsightUpdate(node_id=root, text="the root learned", cites=(done,))])
    with counting(settings.db_url) as seen:
        records = storage.nodes(sid)
    # By key, and only the tables written: no look at receipts or reports, none at the other nodes.
    assert len(seen) <= 3 and not [q for q in seen if "receipt" in q or "trajectory" in q], seen
    assert list(records) == node_records_of(settings, sid)  # what a full read says
    by_id = {r.evidence.id: r.evidence for r in records}
    assert by_id[nid].status == "queued" and by_id[nid].parent_id == done
    assert by_id[done].gain == 0.5 and by_id[done].insight == "it helped"
    assert by_id[root].insight == "the root learned"


def test_a_dispatch_replayed_after_a_crash_gets_the_job_it_made_even_once_it_ended(
    settings: Settings, tiny_repo: Path
) -> None:
    sid, root = new_study(settings, tiny_repo)
    storage = SqlStorage(settings.db_url)
    made = {}
    for x, title in enumerate(("evaluated", "failed"), start=1):
        proposal = Proposal(parent_id=root, title=title, hypothesis={}, prior=0.5, edits={})
        [nid] = storage.add_proposals(sid, x, [proposal])  # one round each
        made[title] = (nid, storage.enqueue(sid, nid))
    # The coordinator died before its dispatch was checkpointed; the jobs ran to their end meanwhile.
    with db.session(settings.db_url) as s:
        for title, (nid, job_id) in made.items():
            node, job = s.get(Node, nid), s.get(Job, job_id)
            assert node is not None and job is not None
            node.status, job.status = title, "done" if title == "evaluated" else "failed"
            s.add(node)
            s.add(job)
    storage.forget()
    for nid, job_id in made.values():
        assert storage.enqueue(sid, nid) == job_id  # not a second attempt, nor an illegal transition
    with db.session(settings.db_url) as s:
        assert len(list(s.exec(select(Job).where(Job.study_id == sid, Job.kind == "experiment")))) == 2
        failed = s.get(Node, made["failed"][0])
        assert failed is not None and failed.status == "failed" and failed.attempts == 1
        failed.completed_order = 7  # its failure integrated: now a retry is a new attempt
        s.add(failed)
    storage.forget()
    retry = storage.enqueue(sid, made["failed"][0])
    assert retry != made["failed"][1]
    with db.session(settings.db_url) as s:
        node = s.get(Node, made["failed"][0])
        assert node is not None and node.status == "queued" and node.attempts == 2


def test_the_studies_list_reads_its_counters_in_a_fixed_number_of_queries(settings: Settings) -> None:
    from backend.api.serializers import study_publics
    from backend.core.models import Approval, LlmCall, Study

    def make(s: Session, i: int) -> Study:
        spec = tiny_files(name=f"s{i}", experiments=9)["grove.toml"]
        st = Study(name=f"s{i}", spec_toml=spec, source="test", status="running")
        s.add(st)
        s.flush()
        sid = st.id or 0
        root = Node(study_id=sid, depth=0, title="root", status="merged", dev_mean=1.0 + i)
        s.add(root)
        s.flush()
        for k in range(i):  # study i: i children, i experiment jobs, one of them running
            n = Node(study_id=sid, parent_id=root.id, depth=1, title=f"c{k}", status="evaluated",
                     dev_mean=2.0 + i + k, verification={"decision": "accept" if k % 2 == 0 else "refine"})  # fmt: skip
            s.add(n)
            s.flush()
            s.add(Job(study_id=sid, node_id=n.id or 0, attempt=1, status="running" if k == 0 else "done",
                      extra_runs=2 if k == 1 else 0))  # fmt: skip
            if k == 0:
                s.add(Approval(study_id=sid, node_id=n.id or 0))
                s.add(LlmCall(study_id=sid, role="ideator", model="m", tokens_in=10, tokens_out=5, usd=0.5))
        return st

    with db.session(settings.db_url) as s:
        studies = [make(s, i) for i in range(12)]
        s.commit()
        few, many = studies[:3], studies
        with counting(settings.db_url) as small:
            study_publics(s, few)
        with counting(settings.db_url) as large:
            listed = study_publics(s, many)
    assert len(small) == len(large) <= 6, (len(small), len(large))
    by_name = {p.name: p for p in listed}
    for i in range(12):
        p = by_name[f"s{i}"]
        assert p.nodes == 1 + i and p.experiments_run == i and p.extra_dev_runs == (2 if i > 1 else 0)
        assert p.experiments_used == i + (1 if i > 1 else 0)  # 2 extra runs are one unit at repeats = 2
        assert p.running_jobs == (1 if i else 0) and p.pending_approvals == (1 if i else 0)
        # The best admissible dev: the root's, or an accepted child's (the even-numbered ones).
        assert p.best_dev == (2.0 + i + max(range(0, i, 2)) if i else 1.0 + i)
        assert (p.llm_calls, p.llm_tokens, p.llm_usd) == ((1, 15, 0.5) if i else (0, 0, 0.0))
