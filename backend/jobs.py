"""Experiment jobs: one node attempt in its own worktree (DESIGN §8).

Run as `python -m backend.jobs JOB_ID TOKEN` by the local pool (and by Celery tasks later).
A job finalises only while its token is current, so a superseded duplicate changes nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import traceback

from agents.policies.base import ImplementationError, ImplementInput
from agents.policies.registry import make_policy
from agents.tree.stats import summarize
from agents.tree.status import NodeStatus
from backend import db, sandbox, workspace
from backend.core.config import Settings, get_settings
from backend.gitops import GitError
from backend.models import Job, Node, Study, now
from backend.storage import add_event, spec_of, transition


class Superseded(RuntimeError):
    """This job's token is no longer current; another run owns it."""


def _claim(settings: Settings, job_id: int, token: str) -> tuple[Job, Node, Study]:
    with db.session(settings.db_url) as s:
        job = s.get(Job, job_id)
        if job is None or job.token != token or job.status not in ("queued", "running"):
            raise Superseded(f"job {job_id} is not ours to run")
        node = s.get(Node, job.node_id)
        study = s.get(Study, job.study_id)
        assert node is not None and study is not None
        job.status, job.started_at, job.pid = "running", now(), os.getpid()
        s.add(job)
        add_event(
            s,
            job.study_id,
            "job.started",
            job.node_id,
            job_id=job_id,
            attempt=job.attempt,
            pid=os.getpid(),
            host=socket.gethostname(),
        )
        if node.status == NodeStatus.QUEUED:
            transition(s, node, NodeStatus.RUNNING, job_id=job_id, attempt=job.attempt)
        return job, node, study


def _finish(settings: Settings, job_id: int, token: str, status: str, **fields: object) -> None:
    with db.session(settings.db_url) as s:
        job = s.get(Job, job_id)
        assert job is not None
        if job.token != token or job.status != "running":
            raise Superseded(f"job {job_id} was taken over")
        node = s.get(Node, job.node_id)
        assert node is not None
        for k, v in fields.items():
            setattr(node, k, v)
        if node.status != status:
            transition(s, node, status, job_id=job_id, reason=str(fields.get("failure", "")))
        job.status, job.finished_at = ("done" if status == NodeStatus.EVALUATED else "failed"), now()
        job.outcome = {"status": status, "reason": str(fields.get("failure", ""))}
        s.add_all([job, node])


def run_experiment(settings: Settings, job_id: int, token: str) -> str:
    """Implement, commit, police and dev-evaluate one node attempt; return the node's new status."""
    job, node, study = _claim(settings, job_id, token)
    spec = spec_of(study)
    repo = workspace.repo_of(study)
    label = f"n{node.id}-a{job.attempt}"
    path = workspace.worktree_path(settings, study, label)
    try:
        workspace.prepare(
            repo, path, node.branch, node.base_commit, sealed=spec.files.sealed, reason=f"job {job_id}"
        )
        policy = make_policy(spec)
        account = policy.implement(
            path,
            ImplementInput(
                node_id=node.id or 0,
                title=node.title,
                hypothesis=dict(node.hypothesis),
                edits=dict(node.edits),
                reflection=node.reflection,
                editable=list(spec.files.editable),
            ),
        )
        commit = repo.commit_all(path, f"Grove n{node.id}: {node.title}\n\n{account}")
        if commit is None:
            _finish(settings, job_id, token, NodeStatus.FAILED, failure="the change is empty")
            return NodeStatus.FAILED
        violation = workspace.diff_violation(repo, node.base_commit, commit, spec)
        stats = repo.diff_stats(node.base_commit, commit)
        if violation:
            _finish(
                settings,
                job_id,
                token,
                NodeStatus.REJECTED,
                commit=commit,
                diff_stats=stats,
                failure=violation,
            )
            return NodeStatus.REJECTED
        receipts = workspace.run_repeats(
            settings, study, spec, kind="dev", worktree=path, commit=commit, label=label,
            node_id=node.id, job_id=job_id,
        )  # fmt: skip
        bad = [r for r in receipts if not r.ok]
        if bad:
            failure = f"dev evaluation seed {bad[0].seed}: {bad[0].reason}"
            tail = bad[0].stderr_tail.strip().splitlines()[-3:]
            _finish(
                settings, job_id, token, NodeStatus.FAILED, commit=commit, diff_stats=stats, failure=failure,
                reflection=f"Attempt {job.attempt} failed: {failure}. " + " | ".join(tail),
            )  # fmt: skip
            return NodeStatus.FAILED
        values = [r.objective(spec.objective.metric) or 0.0 for r in receipts]
        summ = summarize(values)
        _finish(
            settings, job_id, token, NodeStatus.EVALUATED, commit=commit, diff_stats=stats, dev_values=values,
            dev_mean=summ.mean, dev_std=summ.std, dev_n=summ.n, failure="",
        )  # fmt: skip
        return NodeStatus.EVALUATED
    except Superseded:
        raise
    except (ImplementationError, GitError, OSError, ValueError) as exc:
        _finish(settings, job_id, token, NodeStatus.FAILED, failure=f"{type(exc).__name__}: {exc}"[:2000])
        return NodeStatus.FAILED
    finally:
        try:
            repo.remove_worktree(path)
        except GitError:
            traceback.print_exc()


def record_crash(settings: Settings, job_id: int, token: str, reason: str) -> None:
    """Mark a job whose process died without finishing as failed."""
    with contextlib.suppress(Superseded):
        _finish(settings, job_id, token, NodeStatus.FAILED, failure=reason)
    with db.session(settings.db_url) as s:
        job = s.get(Job, job_id)
        if job is not None:
            add_event(s, job.study_id, "job.crashed", job.node_id, job_id=job_id, reason=reason)


def _die_with_parent() -> None:
    """Ask the kernel for SIGTERM when the parent exits, and clean up sandboxed children then."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return

    def bye(signum: int, frame: object) -> None:
        sandbox.kill_all()
        os._exit(143)

    signal.signal(signal.SIGTERM, bye)


def main(argv: list[str]) -> int:
    """Entry point of a job process."""
    _die_with_parent()
    if os.getppid() == 1:
        return 143
    job_id, token = int(argv[0]), argv[1]
    try:
        run_experiment(get_settings(), job_id, token)
    except Superseded as exc:
        print(exc, file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
