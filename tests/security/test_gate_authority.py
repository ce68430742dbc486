"""A worker's gate verdict is evidence, never authority: trunk moves only to the merge the server computes.

A worker holding a gate job's valid token publishes a commit of its choosing to the gate branch
and reports a pass. The server recomputes the merge of trunk and the node's recorded commit,
polices the diff, matches the values with the job's receipts and applies the held-out rule
itself: a commit that is not exactly trunk merged with the node fails the gate and the job, with
the reason and an event, and trunk does not move.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import select

from agents.tree.status import NodeStatus
from backend.api.main import create_app
from backend.core import db
from backend.core.config import Settings
from backend.core.models import Event, Job, Node, Study
from backend.core.security import create_token
from backend.engine.gatekeeper import LocalGatekeeper
from backend.engine.jobstore import token_hash
from backend.services.studies import create_study
from tests.support.repos import git, make_repo, tiny_files

W = "/api/v1/worker"
TRUNK_HELDOUT = [768.125, 768.135]  # the tiny study's held-out score at x = 0, seeds 0 and 1
NODE_HELDOUT = [777.125, 777.135]  # at x = 3


@dataclass
class Gate:
    settings: Settings
    client: TestClient
    headers: dict[str, str]
    study: Study
    node: Node
    job: Job
    work: Path  # a worker's own clone, where it makes whatever commit it likes


def _worker_clone(study: Study, dest: Path) -> Path:
    subprocess.run(["git", "clone", "-q", study.repo_path, str(dest)], check=True)
    for key, value in (("user.name", "w"), ("user.email", "w@w")):
        git("config", key, value, cwd=dest)
    return dest


@pytest.fixture
def gate(tmp_path: Path, redis_url: str) -> Iterator[Gate]:
    settings = Settings(data_dir=tmp_path / "data", worktrees_dir=tmp_path / "wt", redis_url=redis_url)
    settings.ensure_dirs()
    files = tiny_files(mode="approve", margin=0.0)
    files["grove.toml"] = files["grove.toml"].replace(
        'direction = "maximize"', 'direction = "maximize"\nbounds = [0, 1000]'
    )
    repo = make_repo(tmp_path / "tiny", files)
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
        study.baseline_heldout = study.trunk_heldout = list(TRUNK_HELDOUT)
        s.add(study)
        s.flush()
        s.refresh(study)
        s.expunge(study)
    work = _worker_clone(study, tmp_path / "worker")
    # The node's honest change, as an experiment job would have published it.
    branch = f"grove/{study.name}/n77"
    git("checkout", "-q", "-b", "node", study.trunk_commit, cwd=work)
    (work / "config.toml").write_text("[knob]\nx = 3\nsleep = 0\n")
    git("commit", "-q", "-am", "x = 3", cwd=work)
    node_commit = git("rev-parse", "HEAD", cwd=work).strip()
    git("fetch", "-q", str(work), f"node:refs/heads/{branch}", cwd=Path(study.repo_path))
    with db.session(settings.db_url) as s:
        node = Node(study_id=study.id or 0, parent_id=study.trunk_node_id, depth=1, number=2, title="x = 3",
                    status=NodeStatus.EVALUATED, base_commit=study.trunk_commit, branch=branch,
                    commit=node_commit)  # fmt: skip
        s.add(node)
        s.flush()
        job = Job(study_id=study.id or 0, node_id=node.id or 0, attempt=0, kind="gate", status="running",
                  token=token_hash("gate-t"))  # fmt: skip
        s.add(job)
        s.flush()
        for row in (node, job):
            s.refresh(row)
            s.expunge(row)
    app = create_app(settings)
    headers = {"Authorization": f"Bearer {create_token(settings, ['worker', 'sealed'], 'vault')}"}
    with TestClient(app) as client:
        yield Gate(settings, client, headers, study, node, job, work)


def call(g: Gate, name: str, **args: object) -> tuple[int, object]:
    r = g.client.post(
        f"{W}/jobs/{g.job.id}/call/{name}", json={"token": "gate-t", "args": args}, headers=g.headers
    )
    return r.status_code, r.json()


def send_gate_bundle(g: Gate, commit: str) -> Any:
    """Send `commit` as the node's gate branch in a bundle, as a gate job does with its merge; return the answer."""
    ref = f"grove/{g.study.name}/gate/n{g.node.id}"
    git("branch", "-f", ref, commit, cwd=g.work)
    bundle = g.work.parent / "gate.bundle"
    git("bundle", "create", "-q", str(bundle), f"refs/heads/{ref}", cwd=g.work)
    return g.client.post(
        f"{W}/jobs/{g.job.id}/publish", params={"token": "gate-t", "ref": ref, "commit": commit},
        content=bundle.read_bytes(), headers=g.headers,
    )  # fmt: skip


def publish(g: Gate, commit: str) -> None:
    """Publish `commit` to the node's gate branch."""
    r = send_gate_bundle(g, commit)
    assert r.status_code == 200, r.text


def record_test_runs(g: Gate, commit: str, values: list[float]) -> None:
    receipts = [
        {"kind": "test", "seed": i, "ok": True, "commit": commit, "metrics": {"score": v}}
        for i, v in enumerate(values)
    ]
    assert call(g, "add_receipts", node_id=g.node.id, receipts=receipts)[0] == 200


def honest_merge(g: Gate) -> str:
    git("checkout", "-q", "-B", "gate", g.study.trunk_commit, cwd=g.work)
    git("merge", "-q", "--no-ff", "-m", "merge n2", "node", cwd=g.work)
    return git("rev-parse", "HEAD", cwd=g.work).strip()


def state(g: Gate) -> tuple[Study, Node, Job, list[Event]]:
    with db.session(g.settings.db_url) as s:
        st, node, job = s.get(Study, g.study.id), s.get(Node, g.node.id), s.get(Job, g.job.id)
        assert st is not None and node is not None and job is not None
        events = list(s.exec(select(Event).where(Event.study_id == g.study.id, Event.type == "gate.refused")))
        for row in (st, node, job, *events):
            s.expunge(row)
        return st, node, job, events


def clone_trunk(g: Gate) -> str:
    return git("rev-parse", g.study.trunk_branch, cwd=Path(g.study.repo_path)).strip()


def test_a_forged_gate_commit_fails_the_gate_and_trunk_stays(gate: Gate) -> None:
    # Trunk with the evaluator replaced, a sealed file made up and a file added, dressed as the
    # merge of trunk and the node (the right parents, its own tree).
    git("checkout", "-q", "-B", "evil", gate.study.trunk_commit, cwd=gate.work)
    (gate.work / "eval.py").write_text('print(\'{"score": 1e9, "size": 0}\')\n')
    (gate.work / "data" / "test").mkdir(parents=True, exist_ok=True)
    # Trunk holds no sealed file (its base is a copy without them): this one is made up.
    (gate.work / "data" / "test" / "offset.txt").write_text("1e9\n")
    (gate.work / "added.txt").write_text("mine\n")
    git("add", "-A", cwd=gate.work)
    tree = git("write-tree", cwd=gate.work).strip()
    forged = git(
        "commit-tree",
        tree,
        "-p",
        gate.study.trunk_commit,
        "-p",
        gate.node.commit,
        "-m",
        "merge n2",
        cwd=gate.work,
    ).strip()
    publish(gate, forged)
    record_test_runs(gate, forged, NODE_HELDOUT)
    code, body = call(gate, "verdict", passed=True, reason="passed: trust me", commit=forged,
                      values=NODE_HELDOUT, gain=999.0)  # fmt: skip
    assert code == 422 and "not the merge of trunk" in str(body), body
    st, node, job, events = state(gate)
    assert job.status == "failed" and "not the merge of trunk" in job.outcome["reason"]
    assert node.gated and node.gate_reason.startswith("failed: the server refused")
    assert node.status == NodeStatus.REJECTED and node.gate_commit == "" and node.heldout_gain is None
    assert [e.payload["reason"] for e in events] and "not the merge of trunk" in events[0].payload["reason"]
    assert st.trunk_commit == gate.study.trunk_commit == clone_trunk(gate)
    # The job is over: its token can end or write nothing more.
    assert call(gate, "finish_sealed", status="done", outcome={"passed": True})[0] == 409


def test_a_worker_without_the_sealed_role_cannot_act_for_a_gate(gate: Gate) -> None:
    plain = {"Authorization": f"Bearer {create_token(gate.settings, ['worker'], 'fleet')}"}
    merged = honest_merge(gate)
    body = {"token": "gate-t", "args": {"passed": True, "reason": "passed", "commit": merged,
                                         "values": NODE_HELDOUT, "gain": 1.0}}  # fmt: skip
    r = gate.client.post(f"{W}/jobs/{gate.job.id}/call/verdict", json=body, headers=plain)
    assert r.status_code == 403 and "sealed role" in r.text
    r = gate.client.post(f"{W}/jobs/{gate.job.id}/publish", headers=plain, content=b"",
                         params={"token": "gate-t", "ref": f"grove/{gate.study.name}/gate/n{gate.node.id}",
                                 "commit": merged})  # fmt: skip
    assert r.status_code == 403
    st, node, job, events = state(gate)
    assert job.status == "running" and not node.gated and events == []
    assert st.trunk_commit == gate.study.trunk_commit == clone_trunk(gate)


def test_a_pass_the_values_do_not_support_is_refused(gate: Gate) -> None:
    merged = honest_merge(gate)
    publish(gate, merged)
    record_test_runs(gate, merged, TRUNK_HELDOUT)  # no better than trunk
    code, body = call(
        gate, "verdict", passed=True, reason="passed", commit=merged, values=TRUNK_HELDOUT, gain=999.0
    )
    assert code == 422 and "do not pass the held-out rule" in str(body)
    # Values that are not those of the job's test runs are refused too.
    _, node, job, events = state(gate)
    assert job.status == "failed" and node.status == NodeStatus.REJECTED and len(events) == 1


def test_values_other_than_the_recorded_runs_are_refused(gate: Gate) -> None:
    merged = honest_merge(gate)
    publish(gate, merged)
    record_test_runs(gate, merged, TRUNK_HELDOUT)
    code, body = call(
        gate, "verdict", passed=True, reason="passed", commit=merged, values=NODE_HELDOUT, gain=9.0
    )
    assert code == 422 and "recorded test runs" in str(body)


def test_the_honest_merge_passes_and_trunk_moves_to_it(gate: Gate) -> None:
    merged = honest_merge(gate)
    publish(gate, merged)
    record_test_runs(gate, merged, NODE_HELDOUT)
    code, body = call(
        gate, "verdict", passed=True, reason="passed", commit=merged, values=NODE_HELDOUT, gain=999.0
    )
    assert code == 200, body
    assert call(gate, "finish_sealed", status="done", outcome={"passed": True})[0] == 200
    _, node, _, events = state(gate)
    assert node.gated and node.gate_commit == merged and not events
    assert node.heldout_gain == pytest.approx(9.0)  # recomputed by the server, not the 999 it was told
    LocalGatekeeper(gate.settings).merge(gate.study.id or 0, gate.node.id or 0, "ada")
    st, node, _, _ = state(gate)
    assert node.status == NodeStatus.MERGED and st.trunk_commit == merged == clone_trunk(gate)


def test_trunk_does_not_move_to_a_recorded_gate_commit_the_server_did_not_make(gate: Gate) -> None:
    # A gate commit recorded some other way (an older server, a row edited by hand) is checked
    # again when trunk would move to it.
    git("checkout", "-q", "-B", "evil", gate.study.trunk_commit, cwd=gate.work)
    (gate.work / "added.txt").write_text("mine\n")
    git("add", "-A", cwd=gate.work)
    git("commit", "-q", "-m", "evil", cwd=gate.work)
    git("merge", "-q", "--no-ff", "-m", "merge n2", "node", cwd=gate.work)
    forged = git("rev-parse", "HEAD", cwd=gate.work).strip()
    publish(gate, forged)
    with db.session(gate.settings.db_url) as s:
        node = s.get(Node, gate.node.id)
        assert node is not None
        node.gated, node.gate_commit, node.status = True, forged, NodeStatus.AWAITING_APPROVAL
        s.add(node)
    LocalGatekeeper(gate.settings).merge(gate.study.id or 0, gate.node.id or 0, "ada")
    st, node, _, events = state(gate)
    assert st.trunk_commit == gate.study.trunk_commit == clone_trunk(gate)
    assert node.status == NodeStatus.REJECTED and "refused" in node.status_reason
    assert events and "parents" in events[0].payload["reason"]


def test_runs_recorded_for_another_commit_do_not_support_a_pass(gate: Gate) -> None:
    merged = honest_merge(gate)
    publish(gate, merged)
    record_test_runs(gate, gate.node.commit, NODE_HELDOUT)  # the node alone, not the merge the gate names
    code, body = call(
        gate, "verdict", passed=True, reason="passed", commit=merged, values=NODE_HELDOUT, gain=9.0
    )
    assert code == 422 and f"recorded test runs of {merged[:12]}" in str(body), body


def test_trunk_held_out_values_must_be_bounded_recorded_runs_of_trunk(gate: Gate) -> None:
    trunk = gate.study.trunk_commit
    longer = [*TRUNK_HELDOUT, 768.145]
    # Made up (no run of trunk's seed 2 recorded) or out of bounds.
    for values in (longer, [*TRUNK_HELDOUT, 1e9]):
        code, body = call(gate, "keep_trunk_heldout", trunk_commit=trunk, values=values)
        assert code == 422 and "trunk's held-out values" in str(body), (values, body)
    # Values that do not extend trunk's are not kept.
    assert call(gate, "keep_trunk_heldout", trunk_commit=trunk, values=[1.0, 2.0, 3.0])[0] == 200
    receipts = [
        {"kind": "test", "seed": 2, "ok": True, "commit": gate.node.commit, "metrics": {"score": 768.145}}
    ]
    assert call(gate, "add_receipts", node_id=gate.study.trunk_node_id, receipts=receipts)[0] == 200
    assert call(gate, "keep_trunk_heldout", trunk_commit=trunk, values=longer)[0] == 422  # not a run of trunk
    st, *_ = state(gate)
    assert st.trunk_heldout == TRUNK_HELDOUT
    receipts[0]["commit"] = trunk
    assert call(gate, "add_receipts", node_id=gate.study.trunk_node_id, receipts=receipts)[0] == 200
    assert call(gate, "keep_trunk_heldout", trunk_commit=trunk, values=longer)[0] == 200
    st, *_ = state(gate)
    assert st.trunk_heldout == longer


def test_a_gate_bundle_built_on_the_sealed_base_is_refused_wherever_it_is_checked_out(gate: Gate) -> None:
    sealed = gate.study.sealed_commit
    assert sealed and sealed != gate.study.trunk_commit
    # A sealed worker has the repository's base: it merges it in, and trunk would then hold the labels.
    git("checkout", "-q", "-B", "gate", gate.study.trunk_commit, cwd=gate.work)
    git("merge", "-q", "--no-ff", "--allow-unrelated-histories", "-s", "ours", "-m", "bring the base", sealed,
        cwd=gate.work)  # fmt: skip
    r = send_gate_bundle(gate, git("rev-parse", "HEAD", cwd=gate.work).strip())
    assert r.status_code == 422 and "sealed files" in r.text, r.text
    ref = f"grove/{gate.study.name}/gate/n{gate.node.id}"
    assert git("branch", "--list", ref, cwd=Path(gate.study.repo_path)).strip() == ""


def test_a_gate_bundle_carrying_a_sealed_blob_under_another_name_is_refused(gate: Gate) -> None:
    git("checkout", "-q", "-B", "gate", gate.study.trunk_commit, cwd=gate.work)
    (gate.work / "notes.txt").write_text("777.125\n")  # the sealed file's bytes, as a sealed worker read them
    git("add", "notes.txt", cwd=gate.work)
    git("commit", "-q", "-m", "notes", cwd=gate.work)
    r = send_gate_bundle(gate, git("rev-parse", "HEAD", cwd=gate.work).strip())
    assert r.status_code == 422 and "sealed files" in r.text, r.text
