"""Experiment jobs: one node attempt in its own worktree (docs/architecture.md, "How a change gets in").

Run as `python -m backend.engine.experiment JOB_ID TOKEN` by the local pool, and by the `cpu`/`gpu`
Celery tasks. Its records go through the site's `JobStore` (the database here, or the API on a
remote worker); a job finalises only while its token is current, so a superseded duplicate
changes nothing.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from agents import configfiles, globs
from agents.executor.tools import Observation
from agents.failures import Blame, blame_of
from agents.llm.model import BudgetExhausted, ModelError
from agents.policies.base import ImplementationError, ImplementInput
from agents.policies.registry import make_policy
from agents.policies.space import fmt
from agents.spec import Constraint, Judge, Spec
from agents.tree.stats import summarize
from agents.tree.status import NodeStatus, Origin
from backend.core import gitops
from backend.core.config import Settings, get_settings
from backend.core.gitops import GitError
from backend.core.models import Job, Node, Study
from backend.engine import environment, evaluation, policing, repeats, sandbox, workspace
from backend.engine.jobstore import JobStore, Superseded
from backend.engine.site import LocalSite, Site
from backend.services.ledger import StoreLedger
from backend.services.records import spec_of


def run_experiment(site: Site, job_id: int, token: str, stored: Callable[[], None] | None = None) -> str:
    """Implement, commit, police and dev-evaluate one node attempt; return the node's new status.

    `stored` is called once an evaluated or rejected outcome is stored, before the worktree is
    removed.
    """
    try:
        return _run_experiment(site, job_id, token, stored)
    finally:
        environment.release()  # the builds it used may go once the disk needs room


def _run_experiment(site: Site, job_id: int, token: str, stored: Callable[[], None] | None) -> str:
    settings = site.settings
    job, node, study, store = site.claim_experiment(job_id, token)
    spec = spec_of(study)
    label = f"n{node.id}-a{job.attempt}"
    path = workspace.worktree_path(settings, study, label)
    repo: gitops.Repo | None = None

    inp: ImplementInput | None = None
    policy: object = None

    def done(status: str, extra_runs: int, fields: dict[str, object]) -> str:
        store.finish(status, extra_runs, {"blame": Blame.IDEA, **fields})
        # Not a failed attempt: its retry may start at once on the node's branch, which this
        # worktree holds until it is removed.
        if stored is not None and status != NodeStatus.FAILED:
            stored()
        return status

    def finish(status: str, extra_runs: int = 0, blame: Blame = Blame.IDEA, **fields: object) -> str:
        return done(status, extra_runs, {**fields, "blame": blame})

    def reflection(failure: str, tail: str = "") -> str:
        return _reflection(node, job.attempt, policy, inp, failure, tail)

    try:
        if not workspace.isolation_of(settings).boxed:
            store.mark_unsandboxed()
        sandbox.check(workspace.isolation_of(settings))
        repo = site.repo(study, job_id, token)
        # A child builds on its parent's change where the policy does (`storage.inherit`): it starts
        # from the merge of trunk and its parent's commit, and is measured against trunk.
        start = str(node.inherited.get("commit") or node.base_commit)
        workspace.prepare(repo, path, node.branch, start, sealed=spec.files.sealed, reason=f"job {job_id}")
        policy = make_policy(spec, ledger=StoreLedger(store, node.id))
        runtime = SandboxRuntime(settings, study, path, label, repo, node.base_commit)
        inp = _implement_input(spec, study, node, store, runtime)
        # A human's own words stay; a generated title is rewritten from the real change.
        edits = dict(node.edits) if node.origin != Origin.HUMAN else {}
        before = key_values(spec, path, edits)  # the worktree is still at the base commit
        merged, held = _revisit(spec, node, repo, start)
        if held:
            return finish(
                NodeStatus.REJECTED, failure="nothing to measure again: trunk already holds the change"
            )
        try:
            account = "" if merged and job.attempt == 1 else policy.implement(path, inp)
        finally:
            if inp.trajectory:
                store.save_trajectory(inp.trajectory)
        title = diff_title(before, key_values(spec, path, edits)) or node.title
        commit = repo.commit_all(path, f"Grove n{node.number}: {title}\n\n{account}") or (
            start if merged else None
        )
        if title != node.title:
            store.relabel(node.title, title)
        if commit is None:
            return finish(NodeStatus.FAILED, failure="the change is empty")
        store.publish(repo, node.branch, commit)
        status, extra_runs, fields, tail = _measure(
            settings, store, repo, study, spec, node, job, label, commit
        )
        if status == NodeStatus.FAILED:
            fields["reflection"] = reflection(str(fields["failure"]), tail)
        return done(status, extra_runs, fields)
    except Superseded:
        raise
    except (
        ImplementationError, ModelError, BudgetExhausted, GitError, OSError, ValueError, sandbox.SandboxUnavailable,
        environment.SetupFailed,
    ) as exc:  # fmt: skip
        failure = f"{type(exc).__name__}: {exc}"[:2000]
        return finish(NodeStatus.FAILED, failure=failure, blame=blame_of(exc), reflection=reflection(failure))
    finally:
        try:
            if repo is not None:
                repo.remove_worktree(path)
                repo.maintain()  # deferred by the commit: the outcome is stored by now
        except GitError:
            traceback.print_exc()


def _reflection(
    node: Node, attempt: int, policy: object, inp: ImplementInput | None, failure: str, tail: str
) -> str:
    """Return the node's reflections with this attempt's: the model's own words where it gave any."""
    text = f"Attempt {attempt} failed: {failure}." + (f" {tail}" if tail else "")
    reflect = getattr(policy, "reflect", None)
    written = ""
    if reflect is not None and inp is not None and inp.trajectory:  # no executor ran: nothing to reflect on
        written = reflect(inp, f"{failure}\n{tail}")
    text += f" Reflection: {written}" if written else ""
    return (f"{node.reflection}\n{text}" if node.reflection else text)[-4000:]


def _revisit(spec: Spec, node: Node, repo: gitops.Repo, start: str) -> tuple[bool, bool]:
    """Return whether a node runs its source's change as merged, and whether trunk already holds it.

    A revisit measures its source's change merged onto the current trunk: its first attempt runs it
    as merged, a retry (or a merge that conflicted) asks the executor to make it work.
    """
    revisit = node.origin == Origin.REVISIT and not spec.capabilities.whole_assignments
    merged = revisit and bool(node.inherited.get("commit"))
    held = (
        revisit
        and not node.inherited.get("conflict")
        and not (merged and repo.changed_files(node.base_commit, start))
    )
    return merged, held


def _implement_input(
    spec: Spec, study: Study, node: Node, store: JobStore, runtime: SandboxRuntime
) -> ImplementInput:
    """Return what the policy's executor is given to implement a node: its idea and the study's context."""
    reads = spec.capabilities.reads_context
    return ImplementInput(
        node_id=node.id or 0,
        number=node.number,
        title=node.title,
        hypothesis=dict(node.hypothesis),
        edits=dict(node.edits),
        reflection=node.reflection,
        editable=list(spec.files.editable),
        targets=spec.target_map(),
        formats=dict(spec.files.formats),
        context={
            "goal": spec.study.goal,
            "metric": spec.objective.metric,
            "direction": spec.objective.direction,
            "insights": store.insights() if reads else [],
            "trunk_dev": summary_of(study.trunk_dev),
            "constraints": [constraint_text(c) for c in spec.constraints],
            "reflections": store.reflections() if reads else [],
            "parent": {k: v for k, v in node.inherited.items() if k != "commit"},
        },
        runtime=runtime,
    )


def _measure(
    settings: Settings,
    store: JobStore,
    repo: gitops.Repo,
    study: Study,
    spec: Spec,
    node: Node,
    job: Job,
    label: str,
    commit: str,
) -> tuple[NodeStatus, int, dict[str, object], str]:
    """Police a node's committed change and run its dev evaluations.

    Returns the node's new status, the extra dev runs spent, its fields, and (for a failed run) the
    last lines of the failing run's stderr.
    """  # fmt: skip
    change = repo.change(node.base_commit, commit)
    violation, stats = policing.violation_of(change.paths, spec), change.stats
    if violation:
        return NodeStatus.REJECTED, 0, {"commit": commit, "diff_stats": stats, "failure": violation}, ""
    runs = repeats.dev_runs(
        settings, store, repo, study, spec, node, job, worktree_label=label, commit=commit
    )
    bad = [r for r in runs.receipts if not r.ok]
    if bad:
        failure = f"dev evaluation seed {bad[0].seed}: {bad[0].reason}"
        tail = " | ".join(bad[0].stderr_tail.strip().splitlines()[-3:])
        return (
            NodeStatus.FAILED,
            runs.extra_runs,
            {"commit": commit, "diff_stats": stats, "failure": failure},
            tail,
        )
    values = [r.objective(spec.objective.metric) or 0.0 for r in runs.receipts]
    summ = summarize(values)
    fields: dict[str, object] = {"commit": commit, "diff_stats": stats, "dev_values": values, "dev_mean": summ.mean,
                                 "dev_std": summ.std, "dev_n": summ.n, "failure": ""}  # fmt: skip
    return NodeStatus.EVALUATED, runs.extra_runs, fields, ""


class SandboxRuntime:
    """The executor's `run` and `evaluate_dev` tools, through the sandbox, inside one worktree."""

    def __init__(
        self, settings: Settings, study: Study, worktree: Path, label: str, repo: gitops.Repo, commit: str
    ) -> None:
        self.settings, self.study, self.worktree = settings, study, worktree
        self.spec = spec_of(study)
        self.out = workspace.output_dir(settings, study, label) / "tools"
        self.calls = 0
        # `disk_mb` bounds what the whole attempt adds to its tree, not each command alone.
        self.disk_base = sandbox.usage(worktree)
        self.repo, self.commit = repo, commit
        self._iso: sandbox.Isolation | None = None

    def isolation(self) -> sandbox.Isolation:
        """Return the box of this attempt's commands, with the study's environment (built on first use)."""
        if self._iso is None:
            base = workspace.isolation_of(self.settings)
            self._iso = environment.ensure(self.settings, self.study, self.spec, self.repo, self.commit, base)
        return self._iso

    def run(self, command: str, timeout: float) -> tuple[int | None, str]:
        """Run a command in the sandbox; return its exit code (None on timeout) and output tail."""
        self.calls += 1
        limits = replace(workspace.limits_of(self.spec), timeout=timeout)
        res = sandbox.run(
            command, cwd=self.worktree, output_dir=self.out, name=f"run{self.calls}", limits=limits,
            isolation=self.isolation(), output_cap=self.settings.output_cap_bytes,
            disk_base=self.disk_base,
        )  # fmt: skip
        text = res.stdout_tail + ("\n[stderr]\n" + res.stderr_tail if res.stderr_tail.strip() else "")
        return res.exit_code, text[-6000:]

    def diff(self) -> str:
        """Return the change so far as a diff of the editable files, naming any other changed file."""
        gitops.git("add", "-A", cwd=self.worktree)
        listed = gitops.git("diff", "--cached", "--name-only", "--no-renames", "-z", cwd=self.worktree)
        names = [n for n in listed.split("\0") if n]
        mine = [n for n in names if globs.match_any(self.spec.files.editable, n)]
        flags = ("--cached", "--no-ext-diff", "--no-textconv", "--no-color")
        text = gitops.git("diff", *flags, "--", *mine, cwd=self.worktree) if mine else ""
        others = sorted(set(names) - set(mine))
        if others:
            text += (
                f"\nAlso changed, outside files.editable (the change will be rejected): {', '.join(others)}"
            )
        return text

    def evaluate_dev(self) -> Observation:
        """Run the dev evaluation once (seed 0) and describe the result."""
        self.calls += 1
        r = evaluation.evaluate(
            kind="dev", command=self.spec.evaluate.dev, worktree=self.worktree, output_dir=self.out,
            seed=0, metric=self.spec.objective.metric, commit="working tree", limits=workspace.limits_of(self.spec),
            evaluator_fingerprint="", isolation=self.isolation(),
            disk_base=self.disk_base,
        )  # fmt: skip
        if r.ok:
            return Observation(f"dev evaluation ok: {json.dumps(r.metrics)}")
        return Observation(f"dev evaluation failed: {r.reason}\n{r.stderr_tail[-2000:]}", ok=False)


def summary_of(values: list[float]) -> str:
    """Describe dev values as a mean with its spread and count, or "" when there are none."""
    if not values:
        return ""
    summ = summarize(values)
    return f"{summ.mean:.6g} ± {summ.std:.2g} (n = {summ.n})"


def constraint_text(c: Constraint) -> str:
    """Describe one of the spec's constraints for the executor."""
    if c.judge == Judge.LLM:
        return f"{c.name} (soft, judged by a reviewer from your report and diff): {c.description}"
    bounds = " and ".join(
        [*([f"`{c.metric}` >= {c.min:g}"] if c.min is not None else []),
         *([f"`{c.metric}` <= {c.max:g}"] if c.max is not None else [])]
    )  # fmt: skip
    return f"{c.name} (hard, measured): {bounds}" + (f"; {c.description}" if c.description else "")


def key_values(spec: Spec, worktree: Path, keys: Iterable[str]) -> dict[str, Any] | None:
    """Return the values of `[search]` keys in a worktree's files; None if one is not a key or cannot be read."""
    root = worktree.resolve()

    def read(file: str) -> str:
        path = Path(os.path.realpath(worktree / file))  # a link loop is left for the read (ELOOP)
        if not path.is_relative_to(root):
            raise ValueError(f"{file} resolves outside the worktree")
        return path.read_text("utf-8")

    values = {}
    for key in keys:
        if key not in spec.search:
            return None
        try:
            values[key] = spec.value_at(key, read)
        except (configfiles.ConfigKeyError, OSError, ValueError):
            return None
    return values


def diff_title(old: dict[str, Any] | None, new: dict[str, Any] | None) -> str:
    """Describe a config-edit node by its real change: `key old → new, ...` ("" when unknown)."""
    if not old or not new:
        return ""
    return ", ".join(f"{k} {fmt(old[k])} → {fmt(new[k])}" for k in sorted(old) if fmt(old[k]) != fmt(new[k]))


def _die_with_parent() -> None:
    """Ask the kernel for SIGTERM when the parent exits, and clean up sandboxed children then."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return

    def bye(signum: int, frame: object) -> None:
        sandbox.kill_all()
        gitops.kill_all()
        os._exit(143)

    signal.signal(signal.SIGTERM, bye)


def main(argv: list[str]) -> int:
    """Entry point of a job process."""
    _die_with_parent()
    if os.getppid() == 1:
        return 143
    job_id, token = int(argv[0]), argv[1]
    try:
        run_experiment(LocalSite(get_settings()), job_id, token)
    except Superseded as exc:
        print(exc, file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
