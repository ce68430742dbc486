"""Evaluation environments: a study's `[environment] setup`, built once per repository and inputs.

The setup runs in the sandbox with the folder it builds mounted writable at `$GROVE_ENV` (and
the network only if `environment.network` allows it), on a worktree of the commit at hand. Its
temporary folder and `HOME` (pip's download and cache) live in the build folder, under the
setup's `disk_mb`, not in the box's small `/tmp`, and are removed when it ends. The operator's
package-index settings (pip configuration files, `PIP_*`/`UV_*` variables, CA bundles) pass into
the setup box unless `GROVE_SETUP_PACKAGE_SETTINGS=false`; a value or file holding credentials
in a URL never does.

A build is keyed by the repository the study came from, the setup command and the content of
the `inputs` files (requirements, lock files): every study of that repository, whatever its
evaluator or base commit, shares one build until a dependency file changes (on a remote worker,
every job of the study; its copies go when the study ends). Evaluations see it
read-only, its `bin/` first on PATH. The setup's output is kept beside it as a log.

A process that uses a build holds a shared lock on it until its job ends (`release`), and stamps
its last use, so the housekeeping that makes room on a full disk (and `grove janitor
--env-days`) removes only builds nobody is using, least recently used first.
"""

from __future__ import annotations

import configparser
import fcntl
import hashlib
import os
import re
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


SCRATCH = ".grove-tmp"  # the setup's TMPDIR and HOME, inside the build folder while it runs
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

    The key is the setup command and the input files' content, nothing else: a node or another
    study whose dependency files are as at base shares the build. While `commit` has the same
    input files as the study's base, the build runs on the base (the researcher's own code); a
    node that changes them gets a build of its own commit.
    """
    digest = _inputs(spec, repo, commit)
    build = base if base and commit != base and _inputs(spec, repo, base) == digest else commit
    key = hashlib.sha256(f"{spec.environment.setup}\0{digest}".encode()).hexdigest()[:16]
    return key, build


def group_of(settings: Settings, study: Study) -> str:
    """Return the folder under `envs/` holding a study's builds: one per repository it came from.

    A remote worker (one with a worker token) keeps a folder per study instead, removed with the
    rest of its copies when the study ends.
    """
    if not study.source or settings.worker_token:
        return study.name
    source = study.source
    if "://" not in source and Path(source).exists():
        source = str(Path(source).resolve())
    return "repo-" + hashlib.sha256(source.encode()).hexdigest()[:16]


def ensure(
    settings: Settings, study: Study, spec: Spec, repo: Repo, commit: str, iso: sandbox.Isolation
) -> sandbox.Isolation:
    """Return `iso` with the study's environment for `commit` mounted, building it first if needed."""
    if not spec.environment.setup:
        return iso
    key, build = key_of(spec, repo, commit, study.base_commit)
    root = (settings.data_dir / "envs" / group_of(settings, study) / key).resolve()
    ready, env = root / "ready", root / "env"
    if root not in _held:
        _held[root] = _hold(root, lambda: _build(settings, study, spec, repo, build, iso, key, root))
    os.utime(ready)  # its last use, for least-recently-used eviction
    return replace(iso, env_dir=str(env), env_writable=False)


CA_VARS = (
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "PIP_CERT",
    "UV_NATIVE_TLS",
)
PIP_FILES = ("/etc/pip.conf", "/etc/xdg/pip/pip.conf")
USER_PIP_FILES = ("~/.config/pip/pip.conf", "~/.pip/pip.conf")
CREDENTIALS = re.compile(r"://[^/\s@]+@")


def package_settings(
    environ: dict[str, str] | None = None, keep_out: tuple[Path, ...] = ()
) -> tuple[dict[str, str], tuple[str, ...]]:
    """Return the variables and read-only paths that carry the operator's package-index settings.

    Files and folders the settings name (a CA bundle, a constraints file, a wheel folder) come
    along, except `/`, top-level folders and anything holding or inside a `keep_out` folder.
    """
    environ = dict(os.environ if environ is None else environ)
    env: dict[str, str] = {}
    paths: list[str] = []

    def clean(path: str) -> bool:
        try:
            p = Path(path)
            return p.is_dir() or (p.is_file() and not CREDENTIALS.search(p.read_text("utf-8", "replace")))
        except OSError:
            return False

    def named(value: str) -> list[str]:
        out = []
        for word in value.split():
            word = word.removeprefix("file://")
            p = Path(word).resolve() if word.startswith("/") else None
            if p is None or len(p.parts) < 3 or not clean(str(p)):
                continue
            if any(p == k or p in k.parents or k in p.parents for k in keep_out):
                continue
            out.append(str(p))
        return out

    for k, v in sorted(environ.items()):
        if not (k.startswith(("PIP_", "UV_")) or k in CA_VARS) or sandbox.SECRET.search(k):
            continue
        if CREDENTIALS.search(v) or (v.startswith("/") and not clean(v)):
            continue
        env[k] = v
        paths += named(v)
    files = [p for p in PIP_FILES if clean(p)]
    home = environ.get("HOME", "")
    if "PIP_CONFIG_FILE" not in environ and home.startswith("/"):
        # The box's HOME is not the operator's: name their own file instead.
        user = next((f for p in USER_PIP_FILES if clean(f := p.replace("~", home, 1))), None)
        if user:
            env["PIP_CONFIG_FILE"] = user
    files += [env["PIP_CONFIG_FILE"]] if env.get("PIP_CONFIG_FILE") else []
    for f in files:
        paths.append(f)
        parser = configparser.RawConfigParser(strict=False)
        try:
            parser.read(f, encoding="utf-8")
        except (configparser.Error, OSError):
            continue
        for section in parser.sections():
            for value in parser[section].values():
                paths += named(value)
    return env, tuple(dict.fromkeys(paths))


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
    box = replace(iso, env_dir=str(env), env_writable=True)
    keep_out = (settings.data_dir.resolve(), settings.worktrees_dir.resolve())
    extra, paths = package_settings(keep_out=keep_out) if settings.setup_package_settings else ({}, ())
    box = replace(box, binds=(*box.binds, *paths))
    scratch = f"{box.env_path()}/{SCRATCH}"
    (env / SCRATCH).mkdir()
    try:
        res = sandbox.run(
            spec.environment.setup,
            cwd=tree,
            output_dir=root,
            name="setup",
            limits=limits,
            isolation=box,
            env={**extra, "TMPDIR": scratch, "HOME": scratch},
            output_cap=settings.output_cap_bytes,
        )
    finally:
        shutil.rmtree(env / SCRATCH, ignore_errors=True)
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
