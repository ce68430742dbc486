"""Study workspaces: Grove's clone, node worktrees with sealed paths hidden, diff policing, janitor."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from sqlmodel import select

from agents import globs
from agents.spec import Spec
from backend.core import db
from backend.core.config import Settings
from backend.core.gitops import Repo, git
from backend.core.models import Job, Study
from backend.core.states import JobKind, JobStatus
from backend.engine import sandbox


def repo_of(study: Study) -> Repo:
    """Return Grove's clone of a study's repository."""
    return Repo(Path(study.repo_path))


def worktree_path(settings: Settings, study: Study, label: str) -> Path:
    """Return where a study's worktree with this label lives."""
    return (settings.worktrees_dir / study.name / label).resolve()


def output_dir(settings: Settings, study: Study, label: str) -> Path:
    """Return where the full output of a study's runs with this label is stored."""
    return (settings.data_dir / "outputs" / study.name / label).resolve()


def hide_sealed(worktree: Path, patterns: list[str], keep: list[str] | None = None) -> list[str]:
    """Delete sealed files (but those matching `keep`) from a worktree so that no executor code can read them.

    They are marked skip-worktree first, so that their absence is never committed.
    """
    tracked = [p for p in git("ls-files", "-z", cwd=worktree).split("\0") if p]
    sealed = [p for p in globs.select(patterns, tracked) if not globs.match_any(keep or [], p)]
    for chunk in range(0, len(sealed), 200):
        git("update-index", "--skip-worktree", "--", *sealed[chunk : chunk + 200], cwd=worktree)
    for rel in sealed:
        (worktree / rel).unlink(missing_ok=True)
    for rel in sorted({str(Path(p).parent) for p in sealed}, key=len, reverse=True):
        d = worktree / rel
        while d != worktree and d.is_dir() and not any(d.iterdir()):
            d.rmdir()
            d = d.parent
    return sealed


def prepare(
    repo: Repo,
    path: Path,
    branch: str,
    commit: str,
    *,
    sealed: list[str] | None,
    reason: str,
    keep: list[str] | None = None,
) -> Path:
    """Create a worktree on `branch` at `commit`; hide sealed files (but `keep`) unless `sealed` is None."""
    repo.add_worktree(path, branch, commit, reason=reason)
    if sealed:
        hide_sealed(path, sealed, keep)
    return path


def sealed_paths(repo: Repo, study: Study, spec: Spec) -> list[str]:
    """Return the study's sealed files (as its repository's base holds them)."""
    return globs.select(spec.files.sealed, repo.files_at(study.sealed_commit or study.base_commit))


def prepare_test(
    repo: Repo, path: Path, branch: str, commit: str, study: Study, spec: Spec, reason: str
) -> Path:
    """Create the worktree a sealed test runs on: every sealed file, or for two phases only the test inputs.

    A study whose trunk holds no sealed file gets them written in from its repository's base.
    """
    inputs = spec.evaluate.test_inputs if spec.evaluate.two_phase else None
    if study.sealed_commit:
        repo.add_worktree(path, branch, commit, reason=reason)
        wanted = [p for p in sealed_paths(repo, study, spec) if inputs is None or globs.match_any(inputs, p)]
        repo.write_files(study.sealed_commit, wanted, path)
        return path
    if inputs is not None:
        return prepare(repo, path, branch, commit, sealed=spec.files.sealed, reason=reason, keep=inputs)
    return prepare(repo, path, branch, commit, sealed=None, reason=reason)


def limits_of(spec: Spec) -> sandbox.Limits:
    """Return the sandbox limits of a study's evaluations."""
    return sandbox.Limits(
        timeout=spec.evaluate.timeout,
        cpu_seconds=spec.sandbox.cpu_seconds,
        memory_mb=spec.sandbox.memory_mb,
        file_size_mb=spec.sandbox.file_size_mb,
        processes=spec.sandbox.processes,
        disk_mb=spec.sandbox.disk_mb,
        tmp_mb=spec.sandbox.tmp_mb,
        network=spec.sandbox.network,
    )


def isolation_of(settings: Settings) -> sandbox.Isolation:
    """Return how this machine boxes untrusted commands (Grove's settings, never the spec's)."""

    def items(value: str) -> tuple[str, ...]:
        return tuple(p.strip() for p in value.split(",") if p.strip())

    return sandbox.Isolation(
        mode=sandbox.Boxing(settings.sandbox),
        bwrap=settings.sandbox_bwrap,
        binds=items(settings.sandbox_bind),
        passthrough=items(settings.sandbox_env_passthrough),
        network=settings.sandbox_network,
        uid_base=settings.sandbox_uid_base,
    )


def remove_study_worktrees(settings: Settings, study: Study) -> list[Path]:
    """Remove every worktree of a study (when it has finished nothing may still use one)."""
    base = (settings.worktrees_dir / study.name).resolve()
    removed = []
    if study.repo_path and (Path(study.repo_path) / ".git").exists():
        repo = repo_of(study)
        for wt in repo.worktrees():
            path = Path(wt["worktree"])
            if path.is_relative_to(base):
                repo.remove_worktree(path)
                removed.append(path)
    if base.exists():
        for leftover in base.iterdir():
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover)
    return removed


def janitor(settings: Settings, max_age_hours: float | None = None) -> list[Path]:
    """Remove worktrees whose job is not running, or that are older than the stale age."""
    max_age = (settings.stale_worktree_hours if max_age_hours is None else max_age_hours) * 3600
    removed: list[Path] = []
    with db.session(settings.db_url) as s:
        studies = list(s.exec(select(Study)))
        running = list(s.exec(select(Job).where(Job.status == JobStatus.RUNNING)))
        live = {f"n{j.node_id}-a{j.attempt}{end}" for j in running for end in ("", "-trunk")}
        # A running sealed job's worktrees (the baseline's dev or held-out one, or a gate's tests).
        live |= {
            {"baseline": "baseline-dev", "heldout": "baseline-test"}.get(j.kind, "") for j in running
        } - {""}
        live |= {
            f"gate-n{j.node_id}{end}" for j in running if j.kind == JobKind.GATE for end in ("", "-trunk")
        }
        live |= {f"{name}-score" for name in live}  # a two-phase test's scoring tree
    for st in studies:
        if not st.repo_path or not (Path(st.repo_path) / ".git").exists():
            continue  # not cloned yet (or its clone failed)
        repo = repo_of(st)
        for wt in repo.worktrees():
            path = Path(wt["worktree"])
            if not path.is_relative_to(settings.worktrees_dir.resolve()):
                continue
            age = time.time() - (path.stat().st_mtime if path.exists() else 0)
            if path.name not in live or age > max_age:
                repo.remove_worktree(path)
                removed.append(path)
        repo.git("worktree", "prune", "--expire=now")
    base = settings.worktrees_dir
    if base.exists():
        for study_dir in base.iterdir():
            if study_dir.is_dir():
                for d in study_dir.iterdir():
                    if d.is_dir() and d.name not in live and not (d / ".git").exists():
                        shutil.rmtree(d, ignore_errors=True)
    return removed
