"""The coordinator's storage contract (`agents/coordinator/ports.py` `Storage`), held by every implementation.

One list of cases runs on the database's `SqlStorage` and on the in-memory double the coordinator's
unit tests drive (`tests/support/memory.py`): what the graph may rely on, it relies on in both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agents.coordinator.ports import Integration, NodeRecord, Storage
from agents.failures import Blame
from agents.policies.base import Proposal
from agents.tree.insights import InsightUpdate
from agents.tree.status import NodeStatus, StudyStatus
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Job, Node
from backend.services import lifecycle
from backend.services.storage import SqlStorage
from backend.services.studies import create_study
from tests.support.memory import Memory
from tests.support.repos import make_repo, tiny_files


@dataclass
class Stored:
    storage: Storage
    study_id: int
    root: int
    evaluate: Callable[[int, list[float]], None]  # play a node's job ending with these dev values


def _sql(settings: Settings, tmp_path: Path) -> Stored:
    repo = make_repo(tmp_path / "r", tiny_files(name="contract"))
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
        sid, root = study.id or 0, study.trunk_node_id or 0
        lifecycle.start(s, sid)
    storage = SqlStorage(settings.db_url)

    def evaluate(job_id: int, dev: list[float]) -> None:
        with db.session(settings.db_url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            node = s.get(Node, job.node_id)
            assert node is not None
            node.status, node.dev_values, node.dev_n = NodeStatus.EVALUATED, dev, len(dev)
            job.status = "done"
            s.add_all([node, job])
        storage.forget()

    return Stored(storage, sid, root, evaluate)


def _memory() -> Stored:
    mem = Memory()

    def evaluate(job_id: int, dev: list[float]) -> None:
        n = mem.rows[mem.jobs[job_id]]
        n["status"], n["dev"] = "evaluated", dev

    return Stored(mem, 1, mem.trunk_node, evaluate)


@pytest.fixture(params=["sql", "memory"])
def stored(request: pytest.FixtureRequest, settings: Settings, tmp_path: Path) -> Iterator[Stored]:
    yield _sql(settings, tmp_path) if request.param == "sql" else _memory()


def _idea(parent: int, x: int) -> Proposal:
    return Proposal(parent, f"x = {x}", {"mechanism": "m"}, 0.5, {"config.toml:knob.x": x})


def _by_id(st: Stored) -> dict[int, NodeRecord]:
    return {r.evidence.id: r for r in st.storage.nodes(st.study_id)}


def test_proposals_become_proposed_children_once_per_round(stored: Stored) -> None:
    ids = stored.storage.add_proposals(stored.study_id, 1, [_idea(stored.root, 2), _idea(stored.root, 4)])
    assert len(ids) == 2 and len(set(ids)) == 2
    nodes = _by_id(stored)
    assert [nodes[i].evidence.title for i in ids] == ["x = 2", "x = 4"]
    assert all(nodes[i].evidence.status == NodeStatus.PROPOSED and nodes[i].evidence.parent_id == stored.root
               for i in ids)  # fmt: skip
    # A replayed round (a step that crashed after writing) adds nothing and answers the same ids.
    assert (
        stored.storage.add_proposals(stored.study_id, 1, [_idea(stored.root, 2), _idea(stored.root, 4)])
        == ids
    )
    assert len(stored.storage.nodes(stored.study_id)) == len(nodes)


def test_an_enqueued_node_is_queued_under_one_job_however_often_it_is_asked(stored: Stored) -> None:
    (nid,) = stored.storage.add_proposals(stored.study_id, 1, [_idea(stored.root, 3)])
    job = stored.storage.enqueue(stored.study_id, nid)
    again = stored.storage.enqueue(stored.study_id, nid)
    assert again == job and stored.storage.job_nodes([job]) == {job: nid}
    rec = _by_id(stored)[nid]
    assert rec.evidence.status == NodeStatus.QUEUED and rec.attempts == 1


def test_a_recorded_integration_is_what_the_next_step_reads(stored: Stored) -> None:
    a, b = stored.storage.add_proposals(stored.study_id, 1, [_idea(stored.root, 3), _idea(stored.root, 5)])
    for nid, dev in ((a, [9.0, 9.1]), (b, [5.0, 5.1])):
        stored.evaluate(stored.storage.enqueue(stored.study_id, nid), dev)
    verification = {"decision": "accept", "reason": "improves"}
    stored.storage.record(
        stored.study_id, Integration(a, NodeStatus.EVALUATED, 0.5, 0.2, [], verification, "x = 3 helps")
    )
    stored.storage.record(
        stored.study_id, Integration(b, NodeStatus.REJECTED, -0.5, -0.9, [], {"decision": "reject"}, "no")
    )
    nodes = _by_id(stored)
    first, second = nodes[a], nodes[b]
    assert first.evidence.status == NodeStatus.EVALUATED and (
        first.evidence.gain,
        first.evidence.gain_lcb,
    ) == (0.5, 0.2)
    assert first.verification["decision"] == "accept" and first.evidence.insight == "x = 3 helps"
    assert second.evidence.status == NodeStatus.REJECTED and second.dev_values == [5.0, 5.1]
    assert 0 < first.completed_order < second.completed_order


def test_insights_and_the_improvement_state_are_read_back(stored: Stored) -> None:
    (nid,) = stored.storage.add_proposals(stored.study_id, 1, [_idea(stored.root, 3)])
    stored.storage.add_insights(stored.study_id, [InsightUpdate(nid, "x near 3 is best", [nid])])
    assert _by_id(stored)[nid].evidence.insight == "x near 3 is best"
    state = {"verified_findings": [{"text": "x near 3", "node_ids": [nid]}], "concerns": ["noise"]}
    stored.storage.save_state(stored.study_id, state, 0)
    assert stored.storage.study(stored.study_id).improvement_state == state


def test_a_pruned_node_keeps_its_lesson(stored: Stored) -> None:
    (nid,) = stored.storage.add_proposals(stored.study_id, 1, [_idea(stored.root, 9)])
    stored.evaluate(stored.storage.enqueue(stored.study_id, nid), [1.0, 1.1])
    stored.storage.prune(stored.study_id, nid, "no gain", "x far from 3 hurts")
    rec = _by_id(stored)[nid]
    assert rec.evidence.status == NodeStatus.PRUNED and rec.evidence.lesson.endswith(
        "Lesson: x far from 3 hurts"
    )


def test_cancelling_ends_what_has_not_run_and_keeps_what_has(stored: Stored) -> None:
    waiting, queued, done = stored.storage.add_proposals(
        stored.study_id, 1, [_idea(stored.root, 1), _idea(stored.root, 2), _idea(stored.root, 3)]
    )
    stored.storage.enqueue(stored.study_id, queued)
    stored.evaluate(stored.storage.enqueue(stored.study_id, done), [9.0, 9.1])
    stored.storage.cancel_active(stored.study_id)
    nodes = _by_id(stored)
    assert [nodes[i].evidence.status for i in (waiting, queued, done)] == [
        NodeStatus.CANCELLED,
        NodeStatus.CANCELLED,
        NodeStatus.EVALUATED,
    ]
    assert nodes[stored.root].evidence.status == NodeStatus.MERGED


def test_a_spent_budget_pauses_a_running_study(stored: Stored) -> None:
    assert stored.storage.study(stored.study_id).status == StudyStatus.RUNNING
    stored.storage.pause(stored.study_id, "LLM budget spent: $5 of $5", Blame.USD)
    assert stored.storage.study(stored.study_id).status == StudyStatus.PAUSED


def test_an_event_once_written_for_a_node_is_said(stored: Stored) -> None:
    (nid,) = stored.storage.add_proposals(stored.study_id, 1, [_idea(stored.root, 3)])
    assert not stored.storage.said(stored.study_id, "search.widened", nid)
    stored.storage.event(
        stored.study_id, "search.widened", nid, {"key": "config.toml:knob.x", "side": "high"}
    )
    assert stored.storage.said(stored.study_id, "search.widened", nid)
    assert not stored.storage.said(stored.study_id, "search.widened", stored.root)
    assert not stored.storage.said(stored.study_id, "node.merged", nid)
