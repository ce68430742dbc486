"""Evaluation environments: a study's `[environment] setup`, built once per repository and inputs.

The setup runs in the sandbox with the folder it builds mounted writable at `$GROVE_ENV` (and
the network only if `environment.network` allows it), on a worktree of the commit at hand. Its
temporary folder and `HOME` (pip's download and cache) are a scratch folder beside the build
(mounted at /grove/scratch), under the setup's `disk_mb`, not in the box's small `/tmp`, and
removed when it ends; `$GROVE_ENV` itself starts empty (micromamba and conda want that). The operator's
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
from backend.core import gitops
from backend.core.config import Settings
from backend.core.gitops import Repo
from backend.core.models import Study
from backend.engine import sandbox, workspace


class SetupFailed(RuntimeError):
    """The study's environment setup did not succeed; the message says why and where its log is."""


SCRATCH = "scratch"  # the setup's TMPDIR and HOME, beside the build's env/ while it runs
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


INSTALLS_REPOSITORY = re.compile(
    r"install\s+(?:-[\w-]+\s+)*(?:-e\s+)?[\"']?\.(?:\[[^\]]*\])?[\"']?(?:\s|$|[;&|])|setup\.py|poetry\s+install|uv\s+sync|"
    r"pdm\s+install|hatch\s+env|flit\s+install|conda\s+develop"
)


def key_of(spec: Spec, repo: Repo, commit: str, base: str) -> tuple[str, str]:
    """Return an environment's cache key and the commit to build it on.

    While `commit` has the same input files as the study's base, the build runs on the base (the
    researcher's own code) and is keyed by the setup command and the inputs' content alone, so
    another study of the repository with the same dependency files shares it whatever its
    evaluator. A node that changes the inputs gets a build of its own commit, keyed by that commit
    too: a candidate's build is never shared. So is a setup that installs the repository itself
    (`pip install .`): its build holds that commit's code.
    """
    digest = _inputs(spec, repo, commit)
    build = base if base and commit != base and _inputs(spec, repo, base) == digest else commit
    own = build != base or bool(INSTALLS_REPOSITORY.search(spec.environment.setup))
    key = hashlib.sha256(f"{spec.environment.setup}\0{digest}\0{build if own else ''}".encode()).hexdigest()[
        :16
    ]
    return key, build


def group_of(settings: Settings, study: Study) -> str:
    """Return the folder under `envs/` holding a study's builds: one per repository it came from.

    A repository is named by its URL or absolute path; a study whose source is neither, and every
    study on a remote worker (one with a worker token, whose copies go when the study ends), has
    a folder of its own.
    """
    source = study.source
    if settings.worker_token or not (gitops.is_url(source) or source.startswith("/")):
        return study.name
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


CA_VARS = ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
# The package-index settings that pass, by name: where packages come from and how to reach it.
PACKAGE_VARS = (
    "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST", "PIP_CERT",
    "PIP_CONFIG_FILE", "PIP_CONSTRAINT", "PIP_DEFAULT_TIMEOUT", "PIP_TIMEOUT", "PIP_RETRIES",
    "PIP_NO_CACHE_DIR", "PIP_DISABLE_PIP_VERSION_CHECK", "PIP_PREFER_BINARY", "PIP_ONLY_BINARY",
    "PIP_NO_BINARY", "PIP_PROGRESS_BAR", "PIP_NO_INDEX", "PIP_PROXY",
    "UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_INDEX", "UV_DEFAULT_INDEX", "UV_FIND_LINKS",
    "UV_NATIVE_TLS", "UV_HTTP_TIMEOUT", "UV_INDEX_STRATEGY", "UV_OFFLINE", "UV_NO_CACHE",
)  # fmt: skip
PIP_FILES = ("/etc/pip.conf", "/etc/xdg/pip/pip.conf")
USER_PIP_FILES = ("~/.config/pip/pip.conf", "~/.pip/pip.conf")
# Credentials in a text: a user in a URL, a query parameter named like a secret, or a private key.
CREDENTIALS = re.compile(
    r"://[^/\s@]+@|[?&][^=\s&]*(token|key|secret|passw|auth|sig|credential)[^=\s&]*=|PRIVATE KEY", re.I
)
SENSITIVE = frozenset({
    ".ssh", ".gnupg", ".aws", ".kube", ".docker", ".netrc", ".pypirc", ".git-credentials", ".pgpass",
    ".npmrc", ".vault-token", ".azure", "gcloud",
})  # fmt: skip
KEY_FILE = re.compile(
    r"^id_(rsa|dsa|ecdsa|ed25519)|\.(key|p12|pfx|kdbx|keystore|jks)$|^credentials(\.json)?$", re.I
)
MAX_WALK = 20_000  # entries of a named folder looked at; a larger one is not bound
SMALL = 65_536  # files in a named folder up to this size are read for keys and credentials


def has_credentials(value: str) -> bool:
    """Return whether a setting's value holds credentials: a user in any URL form, a secret query, a key."""
    if CREDENTIALS.search(value):
        return True
    for word in re.split(r"[\s,;=\"'()<>\[\]{}]+", value):
        rest = re.sub(r"^[A-Za-z][A-Za-z0-9+.-]*:(//)?", "", word)  # with or without a scheme
        if "@" in rest.split("/", 1)[0]:
            return True
    return False


def _holds_keys(path: Path) -> bool:
    """Return whether a resolved path is, lies in, or holds (at any depth) a key folder or key file."""
    if any(part in SENSITIVE for part in path.parts) or KEY_FILE.search(path.name):
        return True
    if len(path.parts) < 3 or not path.is_dir():  # `/` and top-level folders are never bound
        return False
    seen = 0
    for top, dirs, files in os.walk(path, followlinks=False):
        seen += len(dirs) + len(files)
        for name in (*dirs, *files):
            where = Path(top) / name
            if name in SENSITIVE or KEY_FILE.search(name):
                return True
            if where.is_symlink() and _holds_keys_target(where):
                return True
        for name in files:  # small text files: a key or a URL with a password in them
            where = Path(top) / name
            try:
                data = b"" if where.is_symlink() or where.stat().st_size > SMALL else where.read_bytes()
            except OSError:
                return True
            if b"\0" not in data and CREDENTIALS.search(data.decode("utf-8", "replace")):
                return True
        if seen > MAX_WALK:
            return True
    return False


def _holds_keys_target(link: Path) -> bool:
    try:
        target = link.resolve()
    except (OSError, RuntimeError):
        return True
    return any(part in SENSITIVE for part in target.parts) or bool(KEY_FILE.search(target.name))


def package_settings(
    environ: dict[str, str] | None = None, keep_out: tuple[Path, ...] = ()
) -> tuple[dict[str, str], tuple[str, ...]]:
    """Return the variables and read-only paths that carry the operator's package-index settings.

    Only the settings named in `PACKAGE_VARS` and `CA_VARS` pass, and none whose value holds
    credentials. Files and folders they name (a CA bundle, a constraints file, a wheel folder) come
    along, except `/`, top-level folders, home folders and what holds them, folders holding keys
    (`.ssh`, `.aws`, ...), files holding credentials or a private key, and anything holding or
    inside a `keep_out` folder.
    """
    environ = dict(os.environ if environ is None else environ)
    env: dict[str, str] = {}
    paths: list[str] = []
    homes = {Path(h).resolve() for h in (environ.get("HOME", ""), "/root") if h.startswith("/")}

    def clean(path: str) -> bool:
        try:
            p = Path(path).resolve()
            if _holds_keys(p):
                return False
            if p.is_dir():
                return True
            return p.is_file() and not has_credentials(p.read_text("utf-8", "replace"))
        except (OSError, RuntimeError):
            return False

    def named(value: str) -> list[str]:
        out = []
        for word in value.split():
            word = word.removeprefix("file://")
            p = Path(word).resolve() if word.startswith("/") else None
            if p is None or len(p.parts) < 3 or not clean(str(p)):
                continue
            if p.parent == Path("/home") or any(p == h or p in h.parents for h in homes):
                continue
            if any(p == k or p in k.parents or k in p.parents for k in keep_out):
                continue
            out.append(str(p))
        return out

    for k, v in sorted(environ.items()):
        if k not in PACKAGE_VARS and k not in CA_VARS:
            continue
        if has_credentials(v) or (v.startswith("/") and len(v.split()) == 1 and not clean(v)):
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
    scratch = root / SCRATCH
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    keep_out = (settings.data_dir.resolve(), settings.worktrees_dir.resolve())
    extra, paths = package_settings(keep_out=keep_out) if settings.setup_package_settings else ({}, ())
    box = replace(
        iso, env_dir=str(env), env_writable=True, scratch_dir=str(scratch), binds=(*iso.binds, *paths)
    )
    try:
        res = sandbox.run(
            spec.environment.setup,
            cwd=tree,
            output_dir=root,
            name="setup",
            limits=limits,
            isolation=box,
            env={**extra, "TMPDIR": box.scratch_path(), "HOME": box.scratch_path()},
            output_cap=settings.output_cap_bytes,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
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
