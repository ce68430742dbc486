"""The job store's contract (`backend/engine/jobstore.py` `JobStore`), held by every implementation.

One list of cases runs on the store a worker beside the database gets (`DbStore`, through
`LocalSite`) and on the one a worker on another machine gets (`ApiStore`, through `RemoteSite`,
whose every call goes over HTTP to the API's worker routes).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlmodel import col, select

from agents.failures import Blame
from agents.tree.status import NodeStatus
from backend.api.main import create_app
from backend.core import db, security
from backend.core.config import Settings
from backend.core.models import Event, Job, Node, ReceiptRow
from backend.core.states import JobKind, JobStatus, RunKind
from backend.engine.jobstore import JobStore, Refused, Superseded, token_hash
from backend.engine.site import LocalSite, Site
from backend.services.storage import SqlStorage
from backend.services.studies import create_study
from backend.worker.remote import WORKER_PREFIX, RemoteSite
from tests.support.repos import make_repo, tiny_files

TOKEN = "job-contract-0123456789abcdef"


@dataclass
class Claimed:
    settings: Settings
    site: Site
    store: JobStore
    study_id: int
    node_id: int
    job_id: int


def _queued(settings: Settings, tmp_path: Path) -> tuple[int, int, int]:
    repo = make_repo(tmp_path / "r", tiny_files(name="contract"))
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
        node = Node(study_id=study.id or 0, parent_id=study.trunk_node_id, depth=1, title="x = 3",
                    status=NodeStatus.QUEUED, edits={"config.toml:knob.x": 3}, base_commit=study.trunk_commit)  # fmt: skip
        s.add(node)
        s.flush()
        job = Job(
            study_id=study.id or 0,
            node_id=node.id,
            attempt=1,
            kind=JobKind.EXPERIMENT,
            token=token_hash(TOKEN),
        )
        s.add(job)
        s.flush()
        return study.id or 0, node.id or 0, job.id or 0


@pytest.fixture(params=["db", "api"])
def claimed(request: pytest.FixtureRequest, settings: Settings, tmp_path: Path) -> Iterator[Claimed]:
    """Return an experiment job claimed through one implementation's site, with its store."""
    sid, nid, jid = _queued(settings, tmp_path)
    if request.param == "db":
        site: Site = LocalSite(settings)
        _, _, _, store = site.claim_experiment(jid, TOKEN)
        yield Claimed(settings, site, store, sid, nid, jid)
        return
    worker = security.create_token(settings, ["worker"], "contract")
    remote = RemoteSite(settings.model_copy(update={"api_url": "http://testserver", "worker_token": worker}))
    with TestClient(create_app(settings), base_url=f"http://testserver{WORKER_PREFIX}") as client:
        client.headers["Authorization"] = f"Bearer {worker}"
        remote.api.http = client
        _, _, _, store = remote.claim_experiment(jid, TOKEN)
        yield Claimed(settings, remote, store, sid, nid, jid)


def _node(c: Claimed) -> Node:
    with db.session(c.settings.db_url) as s:
        node = s.get(Node, c.node_id)
        assert node is not None
        return node


def _job(c: Claimed) -> Job:
    with db.session(c.settings.db_url) as s:
        job = s.get(Job, c.job_id)
        assert job is not None
        return job


def test_a_claimed_job_reads_its_study_and_node_as_they_are(claimed: Claimed) -> None:
    assert _job(claimed).status == JobStatus.RUNNING and _node(claimed).status == NodeStatus.RUNNING
    assert claimed.store.study().id == claimed.study_id
    node = claimed.store.node(claimed.node_id)
    assert node.title == "x = 3" and node.edits == {"config.toml:knob.x": 3}


def test_a_finished_experiment_stores_its_evidence_and_ends_its_job(claimed: Claimed) -> None:
    receipt = {"seed": 0, "kind": RunKind.DEV, "commit": "c" * 40, "command": "python eval.py", "exit_code": 0,
               "duration": 0.5, "metrics": {"score": 9.0}, "stdout_sha": "", "stderr_sha": ""}  # fmt: skip
    claimed.store.add_receipts(claimed.node_id, [receipt])
    fields = {"dev_values": [9.0, 9.1], "dev_mean": 9.05, "dev_std": 0.07, "dev_n": 2, "summary_of_it": ""}
    with pytest.raises(Refused):  # a field an experiment does not own
        claimed.store.finish(NodeStatus.EVALUATED, 0, fields)
    del fields["summary_of_it"]
    claimed.store.finish(NodeStatus.EVALUATED, 0, fields)
    node, job = _node(claimed), _job(claimed)
    assert node.status == NodeStatus.EVALUATED and node.dev_values == [9.0, 9.1] and node.dev_n == 2
    assert job.status == JobStatus.DONE
    with db.session(claimed.settings.db_url) as s:
        kept = s.exec(select(ReceiptRow).where(ReceiptRow.node_id == claimed.node_id)).all()
        assert [(r.seed, r.kind, r.metrics) for r in kept] == [(0, RunKind.DEV, {"score": 9.0})]


def test_a_failure_keeps_what_it_says_about_the_idea(claimed: Claimed) -> None:
    claimed.store.finish(NodeStatus.FAILED, 0, {"failure": "GitError: no space", "blame": Blame.MACHINERY})
    node = _node(claimed)
    assert (
        node.status == NodeStatus.FAILED
        and node.blame == Blame.MACHINERY
        and node.failure.startswith("GitError")
    )


def test_a_crash_fails_the_attempt_on_the_ideas_account(claimed: Claimed) -> None:
    claimed.store.crash("the run was killed (time limit)")
    node = _node(claimed)
    assert node.status == NodeStatus.FAILED and node.blame == Blame.IDEA
    assert node.failure == "the run was killed (time limit)" and _job(claimed).status == JobStatus.FAILED


def test_an_experiment_may_set_only_its_own_fields(claimed: Claimed) -> None:
    refused = [
        (NodeStatus.MERGED, {}),
        (NodeStatus.EVALUATED, {"gate_passed": True}),
        (NodeStatus.EVALUATED, {"heldout_values": [1.0]}),
        (NodeStatus.FAILED, {"failure": "x", "blame": "nobody"}),  # a blame the coordinator could not read
    ]
    for status, fields in refused:
        with pytest.raises(Refused):
            claimed.store.finish(status, 0, fields)
    node = _node(claimed)
    assert node.status == NodeStatus.RUNNING and not node.gate_passed and node.heldout_values == []


def test_a_job_writes_only_the_events_it_owns_in_order(claimed: Claimed) -> None:
    claimed.store.event("node.repeated", claimed.node_id, {"seeds": 1})
    claimed.store.event("node.repeated", claimed.node_id, {"seeds": 2})
    for kind, payload in (("node.merged", {}), ("node.repeated", {"study_id": 9})):
        with pytest.raises(Refused):
            claimed.store.event(kind, claimed.node_id, payload)
    with db.session(claimed.settings.db_url) as s:
        kept = s.exec(
            select(Event)
            .where(Event.study_id == claimed.study_id, col(Event.type).in_(["node.repeated", "node.merged"]))
            .order_by(col(Event.id))
        ).all()
        assert [e.payload["seeds"] for e in kept] == [1, 2] and {e.node_id for e in kept} == {claimed.node_id}


def test_a_job_whose_study_stopped_writes_nothing_more(claimed: Claimed) -> None:
    SqlStorage(claimed.settings.db_url).cancel_active(claimed.study_id)
    for write in (
        lambda: claimed.store.finish(NodeStatus.EVALUATED, 0, {"dev_values": [1.0]}),
        lambda: claimed.store.add_receipts(claimed.node_id, []),
        lambda: claimed.store.event("node.repeated", claimed.node_id, {"seeds": 1}),
    ):
        with pytest.raises(Superseded):
            write()
    assert _node(claimed).status == NodeStatus.CANCELLED and _node(claimed).dev_values == []


def test_a_job_taken_over_is_no_longer_ours(claimed: Claimed) -> None:
    with db.session(claimed.settings.db_url) as s:
        job = s.get(Job, claimed.job_id)
        assert job is not None
        job.attempt, job.token = job.attempt + 1, token_hash("another-worker-token-0123456789")
        s.add(job)
    with pytest.raises(Superseded):
        claimed.store.finish(NodeStatus.EVALUATED, 0, {"dev_values": [1.0]})
    with pytest.raises(Superseded):
        claimed.site.claim_experiment(claimed.job_id, TOKEN)
