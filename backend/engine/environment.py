"""Evaluation environments: a study's `[environment] setup`, built once per clone and inputs.

The setup runs in the sandbox with the folder it builds mounted writable at `$GROVE_ENV` (and
the network only if `environment.network` allows it), on a worktree of the study's base commit
while the `inputs` files (requirements, lock files) are as at base, else of the commit that
changed them. The folder is keyed by the setup command, the inputs' content and that commit, so
every worktree of the study shares one build until a dependency file changes. Evaluations then
see it read-only, its `bin/` first on PATH. The setup's output is kept beside it as a log.

A process that uses a build holds a shared lock on it until its job ends (`release`), and stamps
its last use, so the housekeeping that makes room on a full disk removes only builds nobody is
using, least recently used first.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import IO

from agents import globs
from agents.spec import Spec
from backend.core.config import Settings
from backend.core.gitops import Repo
from backend.core.models import Study
from backend.engine import sandbox


class SetupFailed(RuntimeError):
    """The study's environment setup did not succeed; the message says why and where its log is."""


_held: dict[Path, IO[str]] = {}  # builds this process uses, each under a shared lock until `release`


def release() -> None:
    """Let go of every build this process used (at the end of each job)."""
    while _held:
        _, fh = _held.popitem()
        fh.close()


def _inputs(spec: Spec, repo: Repo, commit: str) -> str:
    """Return a digest of the environment's input files (their content, links followed) at a commit."""
    h = hashlib.sha256()
    for path in globs.select(spec.environment.inputs, repo.files_at(commit)):
        try:
            body = repo.read_followed(commit, path)
        except ValueError:
            body = "(a link outside the repository)"
        h.update(path.encode() + b"\0" + body.encode() + b"\0")
    return h.hexdigest()


def key_of(spec: Spec, repo: Repo, commit: str, base: str) -> tuple[str, str]:
    """Return an environment's cache key and the commit to build it on.

    While `commit` has the same input files as the study's base, the build runs on the base (the
    researcher's own code, whatever a node changed elsewhere); a node that changes them gets a
    build of its own commit. The build commit is part of the key: another repository, or a
    validation of another base, never shares a build.
    """
    digest = _inputs(spec, repo, commit)
    build = base if base and commit != base and _inputs(spec, repo, base) == digest else commit
    key = hashlib.sha256(f"{spec.environment.setup}\0{digest}\0{build}".encode()).hexdigest()[:16]
    return key, build


def ensure(
    settings: Settings, study: Study, spec: Spec, repo: Repo, commit: str, iso: sandbox.Isolation
) -> sandbox.Isolation:
    """Return `iso` with the study's environment for `commit` mounted, building it first if needed."""
    if not spec.environment.setup:
        return iso
    key, build = key_of(spec, repo, commit, study.base_commit)
    root = (settings.data_dir / "envs" / study.name / key).resolve()
    ready, env = root / "ready", root / "env"
    if root not in _held:
        _held[root] = _hold(root, lambda: _build(settings, study, spec, repo, build, iso, key, root))
    os.utime(ready)  # its last use, for least-recently-used eviction
    return replace(iso, env_dir=str(env), env_writable=False)


def _locked(root: Path, how: int) -> IO[str]:
    """Open and lock a build's lock file, again if housekeeping removed the build meanwhile."""
    while True:
        root.mkdir(parents=True, exist_ok=True)
        fh = (root / "lock").open("a")
        fcntl.flock(fh, how)
        try:
            if os.fstat(fh.fileno()).st_ino == os.stat(root / "lock").st_ino:
                return fh
        except FileNotFoundError:
            pass
        fh.close()


def _hold(root: Path, build: Callable[[], None]) -> IO[str]:
    """Return the build's lock file held shared, building it first (under an exclusive lock) if needed."""
    fh = _locked(root, fcntl.LOCK_SH)
    if (root / "ready").exists():
        return fh
    fh.close()
    fh = _locked(root, fcntl.LOCK_EX)
    try:
        if not (root / "ready").exists():
            build()
            (root / "ready").touch()
        fcntl.flock(fh, fcntl.LOCK_SH)
    except BaseException:
        fh.close()
        raise
    return fh


def evict(root: Path) -> bool:
    """Remove a build if no process is using it; return whether it was removed."""
    try:
        fh = (root / "lock").open("a")
    except FileNotFoundError:
        return False
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        (root / "lock").unlink(missing_ok=True)  # a process that opened it before sees it is gone
        shutil.rmtree(root, ignore_errors=True)
    return True


def _build(
    settings: Settings,
    study: Study,
    spec: Spec,
    repo: Repo,
    commit: str,
    iso: sandbox.Isolation,
    key: str,
    root: Path,
) -> None:
    from backend.engine import workspace  # workspace evaluates through this module

    env = root / "env"
    shutil.rmtree(env, ignore_errors=True)
    env.mkdir()
    tree = workspace.worktree_path(settings, study, f"env-{key}")
    branch = f"grove/{study.name}/env/{key}"
    workspace.prepare(repo, tree, branch, commit, sealed=spec.files.sealed, reason="environment setup")
    limits = replace(
        workspace.limits_of(spec),
        timeout=spec.environment.timeout,
        network=spec.environment.network,
        disk_mb=spec.environment.disk_mb,
    )
    try:
        res = sandbox.run(
            spec.environment.setup,
            cwd=tree,
            output_dir=root,
            name="setup",
            limits=limits,
            isolation=replace(iso, env_dir=str(env), env_writable=True),
            output_cap=settings.output_cap_bytes,
        )
    finally:
        repo.remove_worktree(tree)
        repo.git("branch", "-D", branch, check=False)
    if not res.ok:
        why = f"exited with code {res.exit_code}"
        if res.timed_out:
            why = f"timed out after {limits.timeout:g}s"
        elif res.disk_exceeded:
            why = f"wrote more than {limits.disk_mb} MB (environment.disk_mb)"
        tail = (res.stderr_tail or res.stdout_tail).strip()[-1500:]
        raise SetupFailed(f"environment setup {why}; its log: {res.stderr_path}\n{tail}")
