"""The worker data plane refuses what a worker token, or a stolen one, should not be able to do.

A worker may read the repository of a study whose job it holds, and write only through that job: its own node's
records, its own branch, outputs under the study's folder. It can never push, move trunk, name a
node of another study, or call anything but the job-store calls.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import select

from backend.api.main import create_app
from backend.core import db
from backend.core.config import Settings
from backend.core.gitops import git_env
from backend.core.models import Job, LearningEvent, LearningJob, Node, Study
from backend.core.security import create_token
from backend.engine import learning
from backend.engine.jobstore import token_hash
from backend.services.studies import create_study
from tests.support.repos import make_repo, tiny_files
from tests.support.services import serve
from tests.support.waiting import free_port

W = "/api/v1/worker"


@dataclass
class Plane:
    settings: Settings
    client: TestClient
    url: str
    worker: dict[str, str]
    study: Study
    other: Study
    job: Job


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Plane]:
    root = tmp_path_factory.mktemp("plane")
    settings = Settings(data_dir=root / "data", worktrees_dir=root / "wt", redis_url=redis_url)
    settings.ensure_dirs()
    studies = []
    with db.session(settings.db_url) as s:
        for name in ("mine", "theirs"):
            repo = make_repo(root / name, tiny_files(name=name))
            studies.append(create_study(s, settings, (repo / "grove.toml").read_text(), str(repo)))
        mine = studies[0]
        node = Node(study_id=mine.id or 0, parent_id=mine.trunk_node_id, depth=1, title="x", status="running",
                    base_commit=mine.trunk_commit, branch=f"grove/{mine.name}/n99")  # fmt: skip
        s.add(node)
        s.flush()
        job = Job(
            study_id=mine.id or 0,
            node_id=node.id or 0,
            attempt=1,
            status="running",
            token=token_hash("job-t"),
        )
        s.add(job)
        s.flush()
        for row in (*studies, job):
            s.refresh(row)
            s.expunge(row)
    app = create_app(settings)
    port = free_port()
    server, thread = serve(app, port)
    token = create_token(settings, ["worker"], "fleet")
    with TestClient(app) as client:
        yield Plane(settings, client, f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {token}"},
                    studies[0], studies[1], job)  # fmt: skip
    server.should_exit = True
    thread.join(timeout=10)


def call(p: Plane, name: str, token: str = "job-t", **args: object) -> tuple[int, object]:
    r = p.client.post(
        f"{W}/jobs/{p.job.id}/call/{name}", json={"token": token, "args": args}, headers=p.worker
    )
    return r.status_code, r.json()


def git(
    p: Plane, *args: str, cwd: Path, token: str | None = None, job: str | None = None
) -> subprocess.CompletedProcess[str]:
    extra = [("protocol.http.allow", "always")]
    if token:
        extra.append(("http.extraHeader", f"Authorization: Bearer {token}"))
    if job:
        extra.append(("http.extraHeader", f"X-Grove-Job: {job}"))
    env = {**git_env(tuple(extra)), "GIT_TERMINAL_PROMPT": "0"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_only_worker_tokens_reach_the_plane(plane: Plane) -> None:
    operator = {"Authorization": f"Bearer {create_token(plane.settings, ['operator', 'approver'], 'op')}"}
    for headers, code in (({}, 401), (operator, 403)):
        r = plane.client.post(f"{W}/jobs/{plane.job.id}/call/study", json={"token": "job-t"}, headers=headers)
        assert r.status_code == code
        assert plane.client.get(f"{W}/git/{plane.study.id}/info/refs", headers=headers).status_code == code
    # And a worker token is no operator: it cannot create or stop studies.
    r = plane.client.post(f"/api/v1/studies/{plane.study.id}/stop", headers=plane.worker)
    assert r.status_code == 403


def test_calls_need_the_jobs_current_token_and_stay_in_its_study(plane: Plane) -> None:
    assert call(plane, "study")[0] == 200
    assert call(plane, "study", token="job-stale")[0] == 409
    for name in ("_node", "__init__", "publish", "settings", "missing"):
        assert call(plane, name)[0] == 404, name
    theirs_root = plane.other.trunk_node_id
    code, body = call(plane, "node", node_id=theirs_root)
    assert code == 422 and "not a node of study" in str(body)
    code, _ = call(plane, "add_receipts", node_id=theirs_root, receipts=[])
    assert code == 422
    # A job's finish may set its node's results, not its gate verdict or its place in the tree.
    code, body = call(plane, "finish", status="evaluated", extra_runs=0, fields={"gate_commit": "f" * 40})
    assert code == 422 and "may not set" in str(body)
    assert call(plane, "not_worth_it", mean="lots", spent=0, more=1)[0] == 422  # arguments are validated


def test_outputs_stay_under_the_studys_folder(plane: Plane) -> None:
    put = plane.client.put
    label = f"n{plane.job.node_id}-a1"
    ok = put(f"{W}/jobs/{plane.job.id}/outputs/{label}/dev-seed0.stdout", params={"token": "job-t"},
             content=b"hello", headers=plane.worker)  # fmt: skip
    assert ok.status_code == 200
    assert Path(ok.json()["path"]).read_bytes() == b"hello"
    assert Path(ok.json()["path"]).is_relative_to(plane.settings.data_dir / "outputs" / "mine")
    # Only under this job's own folders: not another job's outputs, nor a sealed run's.
    others = (
        "gate-n1/test-seed0.stdout",
        "baseline-test/test-seed0.stdout",
        f"n{plane.job.node_id}-a2/x.stdout",
    )
    for bad in ("%2e%2e/%2e%2e/grove.db", "..%2fgrove.db", ".hidden", "a/b/c/d", f"{label}/%2e%2e", *others):
        r = put(f"{W}/jobs/{plane.job.id}/outputs/{bad}", params={"token": "job-t"}, content=b"x",
                headers=plane.worker)  # fmt: skip
        assert r.status_code in (404, 422), bad
    assert put(f"{W}/jobs/{plane.job.id}/outputs/x.stdout", params={"token": "nope"}, content=b"x",
               headers=plane.worker).status_code == 409  # fmt: skip


def test_the_repository_is_fetch_only_and_trunk_moves_only_by_the_gate(plane: Plane, tmp_path: Path) -> None:
    token = plane.worker["Authorization"].removeprefix("Bearer ")
    url = f"{plane.url}{W}/git/{plane.study.id}"
    local = tmp_path / "mirror"
    subprocess.run(["git", "init", "-q", str(local)], check=True)
    refs = "+refs/heads/*:refs/remotes/api/*"
    assert git(plane, "fetch", "-q", url, refs, cwd=local).returncode != 0
    # A worker token alone reads no repository: only a job of the study, under its current token.
    job = f"{plane.job.id}:job-t"
    for header in (None, f"{plane.job.id}:job-stale", f"{plane.job.id}", "x:job-t", f"{10**12}:job-t"):
        refused = git(plane, "fetch", "-q", url, refs, cwd=local, token=token, job=header)
        assert refused.returncode != 0 and "403" in refused.stderr, header
    theirs = f"{plane.url}{W}/git/{plane.other.id}"
    assert git(plane, "fetch", "-q", theirs, refs, cwd=local, token=token, job=job).returncode != 0
    assert not git(plane, "for-each-ref", cwd=local).stdout  # nothing of either study came
    fetched = git(plane, "fetch", "-q", url, refs, cwd=local, token=token, job=job)
    assert fetched.returncode == 0, fetched.stderr
    trunk = f"refs/remotes/api/{plane.study.trunk_branch}"
    assert git(plane, "rev-parse", trunk, cwd=local).stdout.strip() == plane.study.trunk_commit
    # Push is refused, with or without a worker token.
    subprocess.run(["git", "checkout", "-q", "-B", "evil", trunk], cwd=local, check=True)
    subprocess.run(["git", "-c", "user.name=x", "-c", "user.email=x@x", "commit", "-q", "--allow-empty", "-m", "evil"],
                   cwd=local, check=True)  # fmt: skip
    evil = git(plane, "rev-parse", "HEAD", cwd=local).stdout.strip()
    pushed = git(
        plane, "push", url, f"HEAD:refs/heads/{plane.study.trunk_branch}", cwd=local, token=token, job=job
    )
    assert pushed.returncode != 0
    r = plane.client.post(f"{W}/git/{plane.study.id}/git-receive-pack", content=b"0000",
                          headers={**plane.worker, "X-Grove-Job": job})  # fmt: skip
    assert r.status_code == 403
    # A bundle may update only the job's own branch, never trunk.
    bundle = tmp_path / "evil.bundle"
    subprocess.run(["git", "branch", "-f", plane.study.trunk_branch, "HEAD"], cwd=local, check=True)
    subprocess.run(["git", "bundle", "create", "-q", str(bundle), f"refs/heads/{plane.study.trunk_branch}"],
                   cwd=local, check=True)  # fmt: skip
    r = plane.client.post(
        f"{W}/jobs/{plane.job.id}/publish", params={"token": "job-t", "ref": plane.study.trunk_branch, "commit": evil},
        content=bundle.read_bytes(), headers=plane.worker,
    )  # fmt: skip
    assert r.status_code == 422
    # Its own branch, but with a commit other than the one the bundle holds.
    mine = f"grove/{plane.study.name}/n99"
    subprocess.run(["git", "branch", "-f", mine, "HEAD"], cwd=local, check=True)
    subprocess.run(
        ["git", "bundle", "create", "-q", str(bundle), f"refs/heads/{mine}"], cwd=local, check=True
    )
    r = plane.client.post(
        f"{W}/jobs/{plane.job.id}/publish", params={"token": "job-t", "ref": mine, "commit": "0" * 40},
        content=bundle.read_bytes(), headers=plane.worker,
    )  # fmt: skip
    assert r.status_code == 422
    r = plane.client.post(
        f"{W}/jobs/{plane.job.id}/publish", params={"token": "job-t", "ref": mine, "commit": evil},
        content=b"not a bundle", headers=plane.worker,
    )  # fmt: skip
    assert r.status_code == 422
    clone = plane.study.repo_path
    head = subprocess.run(
        ["git", "rev-parse", plane.study.trunk_branch], cwd=clone, capture_output=True, text=True
    )
    assert head.stdout.strip() == plane.study.trunk_commit


def test_the_fleet_token_is_a_worker_token_and_must_be_long(plane: Plane) -> None:
    fleet = "f" * 8 + "0123456789abcdef0123456789abcdef"
    with pytest.raises(ValueError, match="GROVE_FLEET_TOKEN"):
        create_app(plane.settings.model_copy(update={"fleet_token": "short-secret"}))
    app = create_app(plane.settings.model_copy(update={"fleet_token": fleet}))
    with TestClient(app) as client:
        assert client.get(f"{W}/ping", headers={"Authorization": f"Bearer {fleet}"}).json() == {
            "worker": "fleet",
            "sealed": False,  # the fleet's workers are not trusted with held-out data
        }
        assert client.get(f"{W}/ping", headers={"Authorization": f"Bearer {fleet}x"}).status_code == 401
        # Only the worker role: the fleet token cannot read studies or act as an operator.
        assert client.get("/api/v1/studies", headers={"Authorization": f"Bearer {fleet}"}).status_code == 403


def test_the_baselines_dev_and_held_out_jobs_make_only_their_own_calls(plane: Plane) -> None:
    with db.session(plane.settings.db_url) as s:
        jobs = [
            Job(study_id=plane.study.id or 0, node_id=plane.study.trunk_node_id or 0, attempt=attempt,
                kind=kind, status="running", token=token_hash(f"job-{kind}"))
            for kind, attempt in (("baseline", 0), ("heldout", -1))
        ]  # fmt: skip
        s.add_all(jobs)
        s.flush()
        ids = {j.kind: j.id for j in jobs}

    trusted = {"Authorization": f"Bearer {create_token(plane.settings, ['worker', 'sealed'], 'vault')}"}

    def sealed_call(kind: str, name: str, headers: dict[str, str] = trusted, **args: object) -> int:
        body = {"token": f"job-{kind}", "args": args}
        r = plane.client.post(f"{W}/jobs/{ids[kind]}/call/{name}", json=body, headers=headers)
        return r.status_code

    try:
        # A worker token without the sealed role holds no sealed job, even with the job's own token.
        for kind in ("baseline", "heldout"):
            assert sealed_call(kind, "study", headers=plane.worker) == 403
            r = plane.client.post(f"{W}/jobs/{ids[kind]}/claim-sealed", headers=plane.worker,
                                  json={"token": f"job-{kind}", "host": "w", "pid": 1})  # fmt: skip
            assert r.status_code == 403 and "sealed role" in r.text
        # Trunk's dev runs only: the held-out numbers and the sealed-query count are the heldout job's.
        assert sealed_call("baseline", "baseline_heldout", values=[123.0]) == 404
        assert sealed_call("baseline", "test_query") == 404
        assert sealed_call("baseline", "study") == 200
        # And the held-out job writes no dev baseline, no verdict and no trunk numbers of a gate.
        assert sealed_call("heldout", "baseline_dev", values=[123.0]) == 404
        verdict = {"passed": True, "reason": "passed", "commit": "", "values": [], "gain": 1.0}
        assert sealed_call("heldout", "verdict", **verdict) == 404
        assert sealed_call("heldout", "keep_trunk_heldout", trunk_commit="c" * 40, values=[1.0]) == 404
        assert sealed_call("heldout", "study") == 200
        with db.session(plane.settings.db_url) as s:
            st = s.get(Study, plane.study.id)
            assert st is not None and st.baseline_heldout == [] and st.baseline_dev == []
            assert st.test_queries == 0
    finally:
        with db.session(plane.settings.db_url) as s:
            for job_id in ids.values():
                row = s.get(Job, job_id)
                if row is not None:
                    s.delete(row)


def test_a_job_makes_only_the_calls_of_its_kind_with_what_it_made(plane: Plane) -> None:
    # An experiment cannot write a gate verdict, a baseline or a sealed ending.
    for name, args in (
        ("verdict", {"passed": True, "reason": "passed: trust me", "commit": "", "values": [], "gain": 9.9}),
        ("baseline_heldout", {"values": [1.0]}),
        ("finish_sealed", {"status": "done", "outcome": {}}),
        ("test_query", {}),
    ):
        assert call(plane, name, **args)[0] == 404, name
    # Nor end in a status of its choosing, or claim a commit its branch does not hold.
    code, body = call(plane, "finish", status="merged", extra_runs=0, fields={})
    assert code == 422 and "evaluated, failed or rejected" in str(body)
    code, body = call(plane, "finish", status="evaluated", extra_runs=0, fields={"commit": "a" * 40})
    assert code == 422 and "is not the tip" in str(body)
    # Events of its own kind only, and LLM calls that cannot refund the budget or borrow a prompt.
    assert call(plane, "event", kind="node.merged", node_id=None, payload={})[0] == 422
    assert call(plane, "event", kind="node.repeated", node_id=None, payload={"study_id": 2})[0] == 422
    llm = {"role": "executor", "model": "m", "messages": [], "response": {}, "tokens_in": 1, "tokens_out": 1}
    assert call(plane, "llm_record", call={**llm, "usd": -5.0})[0] == 422
    assert call(plane, "llm_record", call={**llm, "usd": 0.1, "id": 1})[0] == 422
    assert call(plane, "llm_record", call={**llm, "usd": 0.1, "base_id": 999_999})[0] == 422
    assert call(plane, "llm_record", call={**llm, "usd": 0.1})[0] == 200
    # A receipt's output path outside the study's folder is not kept (the API would serve it).
    receipt = {"kind": "dev", "seed": 0, "ok": True, "metrics": {"score": 1.0},
               "stdout_path": str(plane.settings.data_dir / "grove.db"), "stderr_path": "/proc/self/environ"}  # fmt: skip
    assert call(plane, "add_receipts", node_id=plane.job.node_id, receipts=[receipt])[0] == 200
    with db.session(plane.settings.db_url) as s:
        from sqlmodel import select

        from backend.core.models import ReceiptRow

        rows = list(s.exec(select(ReceiptRow).where(ReceiptRow.job_id == plane.job.id)))
    assert rows and all(r.stdout_path == "" and r.stderr_path == "" for r in rows)


def test_a_jobs_token_cannot_be_guessed_from_its_id_and_attempt(plane: Plane) -> None:
    from backend.core import locks
    from backend.worker.celery_app import make_app
    from backend.worker.dispatch import TOKEN_KEY, CeleryDispatcher

    trusted = {"Authorization": f"Bearer {create_token(plane.settings, ['worker', 'sealed'], 'vault')}"}
    with db.session(plane.settings.db_url) as s:
        node = Node(study_id=plane.other.id or 0, parent_id=plane.other.trunk_node_id, depth=1, title="victim",
                    status="queued", base_commit=plane.other.trunk_commit, branch=f"grove/{plane.other.name}/n98")  # fmt: skip
        s.add(node)
        s.flush()
        job = Job(study_id=plane.other.id or 0, node_id=node.id or 0, attempt=1)
        s.add(job)
        s.flush()
        job_id = job.id or 0
    dispatcher = CeleryDispatcher(plane.settings, make_app(plane.settings))
    dispatcher.submit(job_id)
    # The token travels with the task (the broker's Redis keeps it for a re-send); the row keeps its hash.
    kept = locks.client(plane.settings.redis_url).get(TOKEN_KEY.format(job_id)) or b""
    task_id, token = kept.decode().split(" ")
    with db.session(plane.settings.db_url) as s:
        row = s.get(Job, job_id) or Job(study_id=0, node_id=0)
    assert row.task_id == task_id and task_id.startswith(f"job-{job_id}-a1-") and len(token) == 32
    assert row.token == token_hash(token) and token not in row.token
    dispatcher.submit(job_id)  # sent again (the reconciler): the attempt keeps its task id and token
    with db.session(plane.settings.db_url) as s:
        again = s.get(Job, job_id) or Job(study_id=0, node_id=0)
    assert (again.task_id, again.token) == (task_id, row.token)
    # A worker token with the job's id and attempt, or its task id (no secret), reaches nothing of another study.
    # (A lone surrogate is valid JSON: sent as the escape, it must be refused, not crash the API.)
    for guess in (f"job-{job_id}-a1", f"job-{job_id}-a1-", task_id, row.token, "", token[:-1], "\ud800"):
        body = json.dumps({"token": guess, "host": "thief", "pid": 1})  # ASCII, escapes and all
        for route, headers in (("claim", plane.worker), ("claim-sealed", trusted)):
            r = plane.client.post(
                f"{W}/jobs/{job_id}/{route}", content=body,
                headers={**headers, "Content-Type": "application/json"},
            )  # fmt: skip
            assert r.status_code in (409, 422), (guess, route, r.status_code)
    clone = git(plane, "clone", "-q", f"{plane.url}/api/v1/worker/git/{plane.other.id}", "stolen",
                cwd=plane.settings.data_dir, token=plane.worker["Authorization"].removeprefix("Bearer "),
                job=f"{job_id}:{task_id}")  # fmt: skip
    assert clone.returncode != 0 and not (plane.settings.data_dir / "stolen" / ".git").exists()
    claimed = plane.client.post(f"{W}/jobs/{job_id}/claim", json={"token": token, "host": "w", "pid": 1},
                                headers=plane.worker)  # fmt: skip
    assert claimed.status_code == 200 and claimed.json()["job"]["id"] == job_id


def test_a_worker_touches_a_learning_job_only_with_its_token(plane: Plane) -> None:
    settings = plane.settings
    with db.session(settings.db_url) as s:
        mine = LearningJob(kind="sparse_eval", params={}, token=token_hash("mine-token"))
        theirs = LearningJob(kind="sparse_eval", params={}, token=token_hash("their-token"))
        tokenless = LearningJob(kind="sparse_eval", params={})  # queued before jobs had tokens
        s.add_all([mine, theirs, tokenless])
        s.flush()
        ids = (mine.id, theirs.id, tokenless.id)
    base = f"{W}/learning"

    def post(job_id: int | None, name: str, **body: object) -> Any:
        return plane.client.post(f"{base}/{job_id}/{name}", headers=plane.worker, json=body)

    mine_id, theirs_id, tokenless_id = ids
    for job_id, token in (
        (theirs_id, "mine-token"), (tokenless_id, ""), (tokenless_id, "x"), (mine_id, "x"), (mine_id, "mïne-token"),
    ):  # fmt: skip
        assert post(job_id, "claim", token=token).status_code in (409, 422)
    assert post(mine_id, "progress", token="mine-token", fraction=0.5).status_code == 409  # not claimed yet
    claimed = post(mine_id, "claim", token="mine-token", host="gpu-7", pid=1)
    assert claimed.status_code == 200 and "token" not in claimed.json()["job"]
    assert claimed.json()["job"]["status"] == "running" and claimed.json()["job"]["host"] == "gpu-7"
    # Its token reaches its job only; the worker token alone reaches none; an operator token no route.
    assert post(theirs_id, "progress", token="mine-token", fraction=0.5).status_code == 409
    assert post(theirs_id, "records", token="mine-token").status_code == 409
    operator = {"Authorization": f"Bearer {create_token(settings, ['operator'], 'op')}"}
    assert plane.client.post(f"{base}/{mine_id}/progress", headers=operator,
                             json={"token": "mine-token", "fraction": 0.5}).status_code == 403  # fmt: skip
    assert post(mine_id, "progress", token="mine-token", fraction=1.5).status_code == 422
    big = {"k": "x" * 20_000}
    assert post(mine_id, "progress", token="mine-token", fraction=0.5, payload=big).status_code == 422
    assert post(mine_id, "records", token="mine-token").json() == []  # a job without a study reads none
    ok = post(mine_id, "progress", token="mine-token", fraction=0.5, payload={"progress": 9, "step": 1})
    assert ok.status_code == 200
    assert (
        post(mine_id, "finish", token="mine-token", result={"device": "cpu"}, artifact="/w/x").status_code
        == 200
    )
    # Once it has ended, nothing more is written through it.
    assert post(mine_id, "fail", token="mine-token", reason="late").status_code == 409
    with db.session(settings.db_url) as s:
        row = s.get(LearningJob, mine_id)
        assert row is not None and row.status == "done" and row.host == "gpu-7" and row.artifact == "/w/x"
        events = list(s.exec(select(LearningEvent).where(LearningEvent.job_id == mine_id)))
        others = list(s.exec(select(LearningJob).where(LearningJob.id != mine_id)))
    assert [e.type for e in events] == ["learning.started", "learning.progress", "learning.finished"]
    assert events[1].payload == {"progress": 0.5, "step": 1}  # the worker cannot misstate its progress
    assert all(j.status == "queued" and j.host == "" for j in others)


def test_a_worker_cannot_grow_a_learning_jobs_history_without_bound(plane: Plane) -> None:
    settings = plane.settings
    with db.session(settings.db_url) as s:
        job = LearningJob(kind="distill", params={}, token=token_hash("long-token"))
        s.add(job)
        s.flush()
        job_id = job.id or 0
    assert learning.claim(settings, job_id, "gpu-1", 1, token="long-token") is not None
    steps = 3 * learning.PROGRESS_EVENTS
    for step in range(1, steps + 1):
        learning.progress(settings, job_id, step / steps, {"step": step}, token="long-token")
    with db.session(settings.db_url) as s:
        kept = [e.payload["step"] for e in learning.events(s, job_id) if e.type == "learning.progress"]
        row = s.get(LearningJob, job_id)
    assert row is not None and row.progress == 1.0
    assert len(kept) <= learning.PROGRESS_EVENTS and kept == sorted(kept)
    assert kept[0] == 1 and kept[-1] == steps  # the whole curve, from its first step to its last
    assert any(step < steps // 3 for step in kept[1:]) and any(steps // 3 < step < steps for step in kept)
    viewer = {"Authorization": f"Bearer {create_token(settings, ['viewer'], 'v')}"}
    page = plane.client.get(f"/api/v1/learning/jobs/{job_id}", headers=viewer)
    assert page.status_code == 200 and len(page.json()["events"]) <= learning.PROGRESS_EVENTS + 1


def test_a_remote_learning_store_sends_non_finite_numbers_as_null(plane: Plane, tmp_path: Path) -> None:
    from backend.worker import remote

    with db.session(plane.settings.db_url) as s:
        job = LearningJob(kind="distill", params={}, token=token_hash("nan-token"))
        s.add(job)
        s.flush()
        job_id = job.id or 0
    fleet = plane.worker["Authorization"].removeprefix("Bearer ")
    settings = Settings(data_dir=tmp_path / "w", api_url=plane.url, worker_token=fleet)
    store = remote.ApiLearningStore(remote.RemoteSite(settings), job_id, "nan-token")
    claimed = store.claim("gpu-9", 1)
    assert claimed is not None and claimed.status == "running" and claimed.host == "gpu-9"
    store.progress(0.5, {"loss": float("nan")})  # a diverged step: JSON has no NaN
    store.finish({"first_loss": 1.0, "last_loss": float("inf")}, "/w/learning/job")
    with db.session(plane.settings.db_url) as s:
        row = s.get(LearningJob, job_id)
        events = list(s.exec(select(LearningEvent).where(LearningEvent.job_id == job_id)))
    assert row is not None and row.status == "done" and row.result == {"first_loss": 1.0, "last_loss": None}
    assert events[1].payload == {"loss": None, "progress": 0.5}


def test_an_experiment_job_writes_only_its_own_dev_receipts(plane: Plane) -> None:
    trunk, base = plane.study.trunk_node_id, plane.study.trunk_commit
    with db.session(plane.settings.db_url) as s:
        sibling = Node(study_id=plane.study.id or 0, parent_id=trunk, depth=1, title="y", status="evaluated",
                       base_commit=base, commit="b" * 40, branch=f"grove/{plane.study.name}/n98")  # fmt: skip
        s.add(sibling)
        s.flush()
        other = sibling.id

    def receipt(kind: str, commit: str = base, score: float = 0.0) -> dict[str, object]:
        return {"kind": kind, "seed": 0, "ok": True, "commit": commit, "metrics": {"score": score}}

    # Made-up held-out numbers, on trunk, on a sibling or on itself; dev numbers on a sibling.
    for node_id, r in ((trunk, receipt("test", score=1e6)), (other, receipt("test")),
                       (plane.job.node_id, receipt("test")), (plane.job.node_id, receipt("test-predict")),
                       (other, receipt("dev")), (trunk, receipt("dev", commit="c" * 40)),
                       (None, receipt("test")), (None, receipt("dev"))):  # fmt: skip
        code, body = call(plane, "add_receipts", node_id=node_id, receipts=[r])
        assert code == 422, (node_id, r, body)
    # Its own dev runs, and trunk's extra dev seeds on the trunk it was built on, are kept.
    assert (
        call(plane, "add_receipts", node_id=plane.job.node_id, receipts=[receipt("dev", "a" * 40)])[0] == 200
    )
    assert call(plane, "add_receipts", node_id=trunk, receipts=[receipt("dev")])[0] == 200
    with db.session(plane.settings.db_url) as s:
        from sqlmodel import select

        from backend.core.models import ReceiptRow

        kinds = {
            (r.node_id, r.kind)
            for r in s.exec(select(ReceiptRow).where(ReceiptRow.study_id == plane.study.id))
        }
    assert (trunk, "test") not in kinds and (other, "dev") not in kinds and (other, "test") not in kinds
