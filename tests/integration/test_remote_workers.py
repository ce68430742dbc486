"""Workers on other machines: no database, no shared data directory, only the API, a token and Redis."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlmodel import select

from backend.core import db, security
from backend.core.config import PROJECT_ROOT
from backend.core.models import Event, Job, Node, Study, Trajectory
from backend.services.studies import create_study
from backend.worker.celery_app import make_app
from tests.support.learning import records, tiny_model_dir
from tests.support.repos import make_repo, tiny_files
from tests.support.services import Service, sqlite_service
from tests.support.waiting import free_port, wait_for

FAST = {"GROVE_LEASE_SECONDS": "4", "GROVE_RECONCILE_SECONDS": "2"}


class Stack:
    """An API process and a coordinator over one data directory; workers elsewhere."""

    def __init__(self, root: Path, redis_url: str) -> None:
        self.svc = sqlite_service(root / "api", redis_url, db_number=11)
        self.svc.env.update(FAST)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log = open(self.svc.logs / "api.log", "ab")  # noqa: SIM115
        self.api = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "backend.api.app:app", "--host", "127.0.0.1", "--port", str(self.port)],
            env=self.svc.env, stdout=log, stderr=log, cwd=PROJECT_ROOT,
        )  # fmt: skip
        wait_for(self._healthy, timeout=60)
        self.token = security.create_token(self.svc.settings, ["worker"], "fleet")
        self.svc.start_worker("coord", "coordinator", 2, beat=True)
        # The server's own worker runs the sealed jobs: the remote ones never get held-out data.
        self.svc.start_worker("sealed", "sealed", 1)
        self.workers: dict[str, Service] = {}

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/api/v1/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def add_worker(self, name: str, root: Path, api: str = "", queues: str = "cpu") -> Path:
        """Start a worker that knows only the API's URL, its token and Redis; return its data directory."""
        data = root / name
        data.mkdir(parents=True)
        env = {
            "PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8",
            "GROVE_API_URL": api or self.url, "GROVE_WORKER_TOKEN": self.token,
            "GROVE_REDIS_URL": self.svc.settings.redis_url, "GROVE_DATA_DIR": str(data), **FAST,
        }  # fmt: skip
        worker = Service(self.svc.settings.model_copy(update={"data_dir": data / "_test"}), env)
        worker.start_worker(name, queues, 1)
        self.workers[name] = worker
        return data

    def stop(self) -> None:
        for w in self.workers.values():
            w.stop()
        self.svc.stop()
        self.api.terminate()
        self.api.wait(timeout=30)


@pytest.fixture
def stack(tmp_path: Path, redis_url: str) -> Iterator[Stack]:
    import redis as redis_lib

    redis_lib.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/11").flushdb()
    s = Stack(tmp_path, redis_url)
    yield s
    s.stop()


def rows(stack: Stack, model: type, *where: object) -> list:  # type: ignore[type-arg]
    with db.session(stack.svc.settings.db_url) as s:
        return list(s.exec(select(model).where(*where)))  # type: ignore[call-overload]


def worker_of(pid: int, stack: Stack) -> str:
    """Return the name of the worker whose pool process has this pid."""
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return next(n for n, w in stack.workers.items() if w.procs[n].pid in (pid, ppid))


def test_two_workers_without_shared_storage_run_a_study_and_survive_a_kill(
    stack: Stack, tmp_path: Path
) -> None:
    w1 = stack.add_worker("w1", tmp_path / "m1")
    w2 = stack.add_worker("w2", tmp_path / "m2", api=f"{stack.url}/api/v1")  # either form of the URL
    repo = make_repo(tmp_path / "src", tiny_files(name="remote", experiments=4, sleep=2.0))
    with db.session(stack.svc.settings.db_url) as s:
        study = create_study(s, stack.svc.settings, (repo / "grove.toml").read_text(), str(repo))
    sid = study.id or 0
    make_app(stack.svc.settings).send_task("coordinator.advance", args=[sid])

    # Kill the worker running the first experiment: the other one takes the same job over.
    experiment = Job.kind == "experiment"
    wait_for(lambda: rows(stack, Job, Job.study_id == sid, experiment, Job.status == "running"), timeout=120)
    victim = rows(stack, Job, Job.study_id == sid, experiment, Job.status == "running")[0]
    killed = worker_of(victim.pid, stack)
    held = {"w1": w1, "w2": w2}[killed] / "repos" / "remote" / ".git"
    wait_for(held.is_dir, timeout=60)  # it has fetched the study's repository
    stack.workers[killed].stop_worker(killed, sig=9)
    wait_for(lambda: rows(stack, Study, Study.id == sid)[0].status == "finished", timeout=300)

    st = rows(stack, Study, Study.id == sid)[0]
    jobs = rows(stack, Job, Job.study_id == sid)
    merged = [n for n in rows(stack, Node, Node.study_id == sid, Node.status == "merged") if n.parent_id]
    assert merged and st.trunk_commit == merged[-1].gate_commit
    again = rows(stack, Job, Job.id == victim.id)[0]
    assert again.status == "done" and again.attempt == victim.attempt
    starts = rows(stack, Event, Event.node_id == victim.node_id, Event.type == "job.started")
    assert len({e.payload["pid"] for e in starts}) >= 2, "the killed job was not taken over"
    # The sealed runs were jobs on the server's own sealed worker, never on a remote one.
    sealed = [j for j in jobs if j.kind != "experiment"]
    assert {j.kind for j in sealed} == {"baseline", "heldout", "gate"} and all(
        j.status == "done" for j in sealed
    )
    logs = "".join((w.logs / f"{n}.log").read_text() for n, w in stack.workers.items())
    own = (stack.svc.logs / "sealed.log").read_text()
    assert all(f"cpu.sealed[{j.task_id}]" in own and f"cpu.sealed[{j.task_id}]" not in logs for j in sealed)
    assert "cpu.experiment[" in logs and "cpu.experiment[" not in own
    # Each worker kept what it needed in its own directory and never opened a database.
    for data in (w1, w2):
        assert not (data / "grove.db").exists()
    # Full outputs came back to the API's data directory, and the node's commits to Grove's clone.
    receipts_dir = stack.svc.settings.data_dir / "outputs" / "remote"
    assert any(receipts_dir.rglob("dev-seed0.stdout"))
    for node in merged:
        assert (
            subprocess.run(
                ["git", "cat-file", "-e", f"{node.commit}^{{commit}}"], cwd=st.repo_path, check=False
            ).returncode
            == 0
        )
    assert "Traceback" not in logs
    # Neither remote worker ever held a sealed byte, in its files or its git objects; and once the
    # study ended, each dropped everything it kept of it: the survivor when told, the killed one
    # when it starts again.
    secret = b"777.125"  # the tiny study's sealed data/test/offset.txt
    for data in (w1, w2):
        assert not sealed_bytes(data, secret), data
    assert held.is_dir()  # killed mid-study: nobody told it yet
    stack.workers[killed].start_worker(killed, "cpu", 1)
    wait_for(lambda: not any((d / sub / "remote").exists() for d in (w1, w2) for sub in ("repos", "outputs", "worktrees")),
             timeout=60)  # fmt: skip


def sealed_bytes(root: Path, secret: bytes) -> list[str]:
    """Return where `secret` lies under `root`: in a file as it is, or inside a git repository's objects.

    A worker may be deleting a study's folders meanwhile: what vanishes under the walk is skipped.
    """
    found: list[str] = []
    for here, dirs, files in os.walk(root):
        for name in files:
            path = Path(here) / name
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                if not path.is_symlink() and secret in path.read_bytes():
                    found.append(str(path))
        if ".git" in dirs and (Path(here) / ".git").is_dir():
            objects = subprocess.run(
                ["git", "cat-file", "--batch-all-objects", "--batch"],
                cwd=here,
                capture_output=True,
                check=False,
            ).stdout
            if secret in objects:
                found.append(f"{here}/.git objects")
    return found


def test_grove_worker_checks_its_api_and_token_before_taking_jobs(stack: Stack, tmp_path: Path) -> None:
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8",
            "GROVE_REDIS_URL": stack.svc.settings.redis_url, "GROVE_DATA_DIR": str(tmp_path / "w")}  # fmt: skip
    cases = [
        ({"GROVE_API_URL": stack.url, "GROVE_WORKER_TOKEN": "grove_wrong"}, "cpu", "refused GROVE_WORKER_TOKEN"),
        ({"GROVE_API_URL": f"http://127.0.0.1:{free_port()}", "GROVE_WORKER_TOKEN": stack.token}, "cpu",
         "cannot reach the API"),
        ({"GROVE_WORKER_TOKEN": stack.token}, "cpu", "GROVE_API_URL is not"),
        ({"GROVE_API_URL": stack.url, "GROVE_WORKER_TOKEN": stack.token}, "cpu,coordinator", "needs the database"),
    ]  # fmt: skip
    for extra, queues, message in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "backend.cli.main", "worker", "--queues", queues],
            env={**base, **extra}, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 2 and message in " ".join(proc.stderr.split()), (queues, proc.stderr)


def test_a_learning_job_runs_on_a_gpu_worker_on_another_machine(stack: Stack, tmp_path: Path) -> None:
    gpu = stack.add_worker("g1", tmp_path / "gpu-machine", queues="gpu")
    settings = stack.svc.settings
    # A study whose executor records the distillation reads: they live only in the API's database.
    repo = make_repo(tmp_path / "src", tiny_files(name="distilled"))
    with db.session(settings.db_url) as s:
        study = create_study(s, settings, (repo / "grove.toml").read_text(), str(repo))
        sid = study.id or 0
        for i, rec in enumerate(r for r in records() if isinstance(r["prompt"], list)):
            node = Node(
                study_id=sid, parent_id=study.trunk_node_id, depth=1, title=f"n{i}", status="evaluated"
            )
            s.add(node)
            s.flush()
            job = Job(study_id=sid, node_id=node.id or 0, attempt=1, status="done")
            s.add(job)
            s.flush()
            s.add(Trajectory(study_id=sid, node_id=node.id or 0, job_id=job.id or 0,
                             messages=[*rec["prompt"], *rec["rollout"]], feedback=[rec["feedback"]]))  # fmt: skip
    model = tiny_model_dir(tmp_path / "tiny-lm")  # the same path on both machines here
    operator = {"Authorization": f"Bearer {security.create_token(settings, ['operator'], 'learn')}"}
    params = {"model": str(model), "steps": 2, "batch_size": 1, "support": "full", "save_model": False}
    made = httpx.post(f"{stack.url}/api/v1/learning/jobs", headers=operator,
                      json={"kind": "distill", "params": params, "study_id": sid}, timeout=30)  # fmt: skip
    assert made.status_code == 201, made.text
    job_id = made.json()["id"]

    def ended() -> dict | None:  # type: ignore[type-arg]
        body = httpx.get(f"{stack.url}/api/v1/learning/jobs/{job_id}", headers=operator, timeout=10).json()
        return body if body["status"] in ("done", "failed") else None

    job = wait_for(ended, timeout=240)
    assert job["status"] == "done", job["error"]  # type: ignore[index]
    assert job["result"]["records"] == 1 and job["result"]["steps"] == 2  # type: ignore[index]
    types = [e["type"] for e in job["events"]]  # type: ignore[index]
    assert types == ["learning.queued", "learning.started", "learning.progress", "learning.progress",
                     "learning.finished"]  # fmt: skip
    # It ran on the gpu worker, whose data directory holds the artifact; nothing of it is on the server's.
    artifact = Path(job["artifact"])  # type: ignore[index]
    assert artifact.is_relative_to(gpu) and (artifact / "result.json").is_file()
    assert job["host"] and not (settings.data_dir / "learning").exists()  # type: ignore[index]
    assert not (gpu / "grove.db").exists()
    assert "Traceback" not in (stack.workers["g1"].logs / "g1.log").read_text()
