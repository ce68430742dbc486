"""Experiment jobs: one node attempt in its own worktree (docs/architecture.md, "How a change gets in").

Run as `python -m backend.engine.experiment JOB_ID TOKEN` by the local pool (and by Celery tasks later).
A job finalises only while its token is current, so a superseded duplicate changes nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from sqlmodel import select

from agents.policies import configfiles
from agents.policies.base import ImplementationError, ImplementInput
from agents.policies.llm.model import BudgetExhausted, ModelError
from agents.policies.registry import make_policy
from agents.policies.space import fmt
from agents.spec import split_search_key
from agents.tree.stats import summarize
from agents.tree.status import NodeStatus
from backend.core import db, gitops
from backend.core.config import Settings, get_settings
from backend.core.gitops import GitError
from backend.core.models import Job, Node, Study, Trajectory, now
from backend.engine import evaluation, repeats, sandbox, workspace
from backend.services.ledger import SqlLedger
from backend.services.records import add_event, latest_insight, spec_of, transition


class Superseded(RuntimeError):
    """This job's token is no longer current; another run owns it."""


def _claim(settings: Settings, job_id: int, token: str) -> tuple[Job, Node, Study]:
    with db.session(settings.db_url) as s:
        job = s.get(Job, job_id)
        if (
            job is None
            or job.kind != "experiment"
            or job.token != token
            or job.status not in ("queued", "running")
        ):
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


def _finish(
    settings: Settings, job_id: int, token: str, status: str, extra_runs: int = 0, **fields: object
) -> None:
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
        job.outcome = {
            "status": status,
            "reason": str(fields.get("failure", "")),
            "detail": str(fields.get("reflection", "")),
        }
        job.extra_runs = extra_runs
        s.add_all([job, node])


def run_experiment(settings: Settings, job_id: int, token: str) -> str:
    """Implement, commit, police and dev-evaluate one node attempt; return the node's new status."""
    job, node, study = _claim(settings, job_id, token)
    spec = spec_of(study)
    repo = workspace.repo_of(study)
    label = f"n{node.id}-a{job.attempt}"
    path = workspace.worktree_path(settings, study, label)
    try:
        sandbox.check(workspace.isolation_of(settings, study))
        workspace.prepare(
            repo, path, node.branch, node.base_commit, sealed=spec.files.sealed, reason=f"job {job_id}"
        )
        policy = make_policy(spec, ledger=SqlLedger(settings, study.id or 0, node.id))
        inp = ImplementInput(
            node_id=node.id or 0,
            title=node.title,
            hypothesis=dict(node.hypothesis),
            edits=dict(node.edits),
            reflection=node.reflection,
            editable=list(spec.files.editable),
            context={
                "goal": spec.study.goal,
                "metric": spec.objective.metric,
                "direction": spec.objective.direction,
                "insights": ancestor_insights(settings, node),
            },
            runtime=SandboxRuntime(settings, study, path, label),
        )
        try:
            account = policy.implement(path, inp)
        finally:
            _save_trajectory(settings, job, node, inp.trajectory)
        # A human's own words stay; a generated title is rewritten from the real diff.
        title = (
            node.origin != "human" and diff_title(repo, node.base_commit, path, dict(node.edits))
        ) or node.title
        commit = repo.commit_all(path, f"Grove n{node.id}: {title}\n\n{account}")
        if title != node.title:
            _relabel(settings, node.id or 0, node.title, title)
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
        runs = repeats.dev_runs(settings, study, spec, node, job, worktree_label=label, commit=commit)
        receipts = runs.receipts
        bad = [r for r in receipts if not r.ok]
        if bad:
            failure = f"dev evaluation seed {bad[0].seed}: {bad[0].reason}"
            tail = bad[0].stderr_tail.strip().splitlines()[-3:]
            _finish(
                settings, job_id, token, NodeStatus.FAILED, commit=commit, diff_stats=stats, failure=failure,
                reflection=f"Attempt {job.attempt} failed: {failure}. " + " | ".join(tail),
                extra_runs=runs.extra_runs,
            )  # fmt: skip
            return NodeStatus.FAILED
        values = [r.objective(spec.objective.metric) or 0.0 for r in receipts]
        summ = summarize(values)
        _finish(
            settings, job_id, token, NodeStatus.EVALUATED, commit=commit, diff_stats=stats, dev_values=values,
            dev_mean=summ.mean, dev_std=summ.std, dev_n=summ.n, failure="", extra_runs=runs.extra_runs,
        )  # fmt: skip
        return NodeStatus.EVALUATED
    except Superseded:
        raise
    except (
        ImplementationError, ModelError, BudgetExhausted, GitError, OSError, ValueError, sandbox.SandboxUnavailable,
    ) as exc:  # fmt: skip
        failure = f"{type(exc).__name__}: {exc}"[:2000]
        _finish(
            settings, job_id, token, NodeStatus.FAILED, failure=failure,
            reflection=f"Attempt {job.attempt} failed: {failure}",
        )  # fmt: skip
        return NodeStatus.FAILED
    finally:
        try:
            repo.remove_worktree(path)
        except GitError:
            traceback.print_exc()


class SandboxRuntime:
    """The executor's `run` and `evaluate_dev` tools, through the sandbox, inside one worktree."""

    def __init__(self, settings: Settings, study: Study, worktree: Path, label: str) -> None:
        self.settings, self.study, self.worktree = settings, study, worktree
        self.spec = spec_of(study)
        self.out = workspace.output_dir(settings, study, label) / "tools"
        self.calls = 0
        # `disk_mb` bounds what the whole attempt adds to its tree, not each command alone.
        self.disk_base = sandbox.usage(worktree)

    def run(self, command: str, timeout: float) -> tuple[int | None, str]:
        """Run a command in the sandbox; return its exit code (None on timeout) and output tail."""
        self.calls += 1
        limits = replace(workspace.limits_of(self.spec), timeout=timeout)
        res = sandbox.run(
            command, cwd=self.worktree, output_dir=self.out, name=f"run{self.calls}", limits=limits,
            isolation=workspace.isolation_of(self.settings, self.study), output_cap=self.settings.output_cap_bytes,
            disk_base=self.disk_base,
        )  # fmt: skip
        text = res.stdout_tail + ("\n[stderr]\n" + res.stderr_tail if res.stderr_tail.strip() else "")
        return res.exit_code, text[-6000:]

    def evaluate_dev(self) -> str:
        """Run the dev evaluation once (seed 0) and describe the result."""
        self.calls += 1
        r = evaluation.evaluate(
            kind="dev", command=self.spec.evaluate.dev, worktree=self.worktree, output_dir=self.out,
            seed=0, metric=self.spec.objective.metric, commit="working tree", limits=workspace.limits_of(self.spec),
            evaluator_fingerprint="", isolation=workspace.isolation_of(self.settings, self.study),
            disk_base=self.disk_base,
        )  # fmt: skip
        if r.ok:
            return f"dev evaluation ok: {json.dumps(r.metrics)}"
        return f"dev evaluation failed: {r.reason}\n{r.stderr_tail[-2000:]}"


def diff_title(repo: gitops.Repo, base_commit: str, worktree: Path, edits: dict[str, Any]) -> str:
    """Describe a config-edit node by its real change to the commit it sits on: `key old → new, ...`."""
    changes = []
    for key in sorted(edits):
        file, dotted = split_search_key(key)
        try:
            old = configfiles.get_key(file, repo.read_at(base_commit, file), dotted)
            new = configfiles.get_key(file, (worktree / file).read_text("utf-8"), dotted)
        except (configfiles.ConfigKeyError, GitError, OSError, ValueError):
            return ""
        if fmt(old) != fmt(new):
            changes.append(f"{key} {fmt(old)} → {fmt(new)}")
    return ", ".join(changes)


def _relabel(settings: Settings, node_id: int, old: str, new: str) -> None:
    """Give a node the title of its real diff (trunk may have moved since it was proposed)."""
    with db.session(settings.db_url) as s:
        node = s.get(Node, node_id)
        assert node is not None
        node.title = new
        node.hypothesis = {k: v.replace(old, new) for k, v in node.hypothesis.items()}
        s.add(node)
        add_event(s, node.study_id, "node.relabeled", node_id, old=old, new=new)


def ancestor_insights(settings: Settings, node: Node) -> list[str]:
    """Return the newest insight of each ancestor, root first."""
    out: list[str] = []
    with db.session(settings.db_url) as s:
        parent = node.parent_id
        while parent is not None:
            anc = s.get(Node, parent)
            if anc is None:
                break
            text = latest_insight(s, parent)
            if text:
                out.append(f"n{parent}: {text}")
            parent = anc.parent_id
    return list(reversed(out))


def _save_trajectory(settings: Settings, job: Job, node: Node, trajectory: dict[str, object]) -> None:
    if not trajectory:
        return
    with db.session(settings.db_url) as s:
        if s.exec(select(Trajectory).where(Trajectory.job_id == job.id)).first() is None:
            s.add(
                Trajectory(
                    study_id=job.study_id, node_id=node.id or 0, job_id=job.id or 0, attempt=job.attempt,
                    messages=list(trajectory.get("messages", [])),  # type: ignore[call-overload]
                    feedback=list(trajectory.get("feedback", [])),  # type: ignore[call-overload]
                    report=str(trajectory.get("report", "")),
                )
            )  # fmt: skip


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
