"""Running git safely: the environment and config Grove's own git runs with, timed captured runs, and what a local repository's git data reads."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from agents.failures import Blame, NoEvidence
from backend.core import libgit

GIT_ENV = {
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_OPTIONAL_LOCKS": "0",
    "GIT_AUTHOR_NAME": "Grove",
    "GIT_AUTHOR_EMAIL": "grove@localhost",
    "GIT_COMMITTER_NAME": "Grove",
    "GIT_COMMITTER_EMAIL": "grove@localhost",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_ATTR_NOSYSTEM": "1",
    "GIT_PAGER": "cat",
}


# Command-line config outranks every config file, nested repositories' included (git passes it on),
# so nothing a repository writes into a config can make Grove's git run a program.
SAFE_CONFIG = (
    ("core.fsmonitor", "false"),
    ("core.splitIndex", "false"),  # an index libgit2 reads too
    ("core.hooksPath", "/dev/null"),
    ("core.sshCommand", "ssh -o BatchMode=yes"),
    ("core.askPass", "/bin/false"),
    ("submodule.recurse", "false"),
    ("commit.gpgSign", "false"),
    ("tag.gpgSign", "false"),
    ("log.showSignature", "false"),
    ("gpg.program", "/bin/false"),
    ("gpg.ssh.program", "/bin/false"),
    ("gpg.x509.program", "/bin/false"),
    ("safe.bareRepository", "explicit"),
    ("protocol.allow", "never"),
    ("protocol.https.allow", "always"),
    ("protocol.ssh.allow", "always"),
    ("protocol.git.allow", "always"),
    ("protocol.file.allow", "always"),
)


# For git commands in a repository Grove did not make: no transport at all, so a partial clone's
# lazy fetch cannot run the `remote.*.uploadpack` program its config names.
FOREIGN_CONFIG = tuple(
    (f"protocol.{p}allow", "never") for p in ("", "file.", "https.", "http.", "ssh.", "git.", "ext.")
)


def foreign_program(program: str) -> str:
    """Return the command that runs `program` (upload-pack, receive-pack) in a repository Grove did not make.

    Git runs it there with that repository's config, not Grove's: this passes Grove's overrides
    (hooks and fsmonitor off, no transport) on its command line, where they win.
    """
    config = (("core.hooksPath", "/dev/null"), ("core.fsmonitor", "false"), *FOREIGN_CONFIG)
    return "git " + " ".join(f"-c {k}={v}" for k, v in config) + f" {program}"


T = TypeVar("T")


# The only variables of Grove's own environment a git command sees: the operator's, for reaching
# remotes (proxies, CA bundles, ssh agent and command).
KEEP_ENV = (
    "PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "SSH_AUTH_SOCK", "GIT_SSH_COMMAND",
    "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy",
    "GIT_SSL_CAINFO", "GIT_SSL_CAPATH", "SSL_CERT_FILE", "SSL_CERT_DIR",
)  # fmt: skip


def git_env(extra: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """Return the minimal environment every git command of Grove's runs with (plus `extra` config)."""
    env = {k: os.environ[k] for k in KEEP_ENV if k in os.environ}
    env.update(GIT_ENV)
    # An operator's git config (credential helpers, url rewrites) may be named; SAFE_CONFIG still wins.
    env["GIT_CONFIG_GLOBAL"] = os.environ.get("GROVE_GIT_CONFIG") or "/dev/null"
    config = (*SAFE_CONFIG, *extra)
    env["GIT_CONFIG_COUNT"] = str(len(config))
    for i, (key, value) in enumerate(config):
        env[f"GIT_CONFIG_KEY_{i}"], env[f"GIT_CONFIG_VALUE_{i}"] = key, value
    return env


class GitError(RuntimeError, NoEvidence):
    """A git command failed; the message carries its stderr."""

    def __init__(self, args: list[str], code: int, stderr: str) -> None:
        self.args_, self.code, self.stderr = args, code, stderr
        super().__init__(f"git {' '.join(args)} failed ({code}): {stderr.strip()[:2000]}")


class MergeConflict(GitError):
    """A merge stopped on conflicts and was aborted: the change does not go on its base (the idea's own failure)."""

    blame = Blame.IDEA


def run_git(
    *args: str, cwd: Path | None = None, timeout: float = 300, foreign: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run a git command in Grove's environment and return it, whatever its exit code.

    `foreign`: the repository is not one Grove made, and no transport is allowed (`FOREIGN_CONFIG`).
    """
    env = git_env(FOREIGN_CONFIG) if foreign else git_env()
    try:
        return run_captured(["git", *args], cwd=cwd, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise GitError(list(args), -1, f"timed out after {timeout:g}s") from None


LIVE: set[int] = set()  # process groups of the commands `run_captured` is running now


def run_captured(
    argv: list[str], *, cwd: Path | None, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run a program and capture its output as text; kill it and raise TimeoutExpired after `timeout` s.

    Bytes that are not UTF-8 (a repository's file, a diff of one) become U+FFFD, never an exception.

    Like `subprocess.run(..., timeout=...)` without its wait, which polls for the exit with sleeps
    from a millisecond up (a git command of Grove's takes about that long itself). The program runs
    in a process group of its own, killed whole: a helper it started (a remote transport, an alias's
    shell) cannot keep it hanging by holding its output open. `kill_all` ends every such group of
    this process (a worker told to stop calls it).
    """
    with subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, encoding="utf-8",
        errors="replace", start_new_session=True,
    ) as proc:  # fmt: skip
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        LIVE.add(proc.pid)
        timer = threading.Timer(timeout, expire)
        timer.daemon = True
        try:
            timer.start()
            out, err = proc.communicate()
        except BaseException:  # a worker's time limit, say: the command does not outlive the call
            expire()
            raise
        finally:
            timer.cancel()
            LIVE.discard(proc.pid)
        if expired.is_set():
            raise subprocess.TimeoutExpired(argv, timeout, out, err)
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def kill_all() -> None:
    """Kill the process groups of every command `run_captured` is running in this process."""
    for pgid in list(LIVE):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def either(args: list[str], fast: Callable[[], T], slow: Callable[[], T]) -> T:
    """Return `fast()` (libgit2), or `slow()` (git itself) where libgit2 would not read the repository as git does.

    A libgit2 failure is reported as the git command it stands for (`args`) would have failed.
    """
    try:
        return fast()
    except libgit.Unsupported:
        return slow()
    except libgit.Conflict as exc:
        raise MergeConflict(args, 1, str(exc)) from exc
    except libgit.LibGitError as exc:
        raise GitError(args, -1, str(exc)) from exc


def git(
    *args: str, cwd: Path | None = None, check: bool = True, timeout: float = 300, foreign: bool = False
) -> str:
    """Run a git command and return its stdout (`foreign`: as `run_git`)."""
    proc = run_git(*args, cwd=cwd, timeout=timeout, foreign=foreign)
    if check and proc.returncode != 0:
        raise GitError(list(args), proc.returncode, proc.stderr or proc.stdout)
    return proc.stdout


def is_url(source: str) -> bool:
    """Return whether a repository source is a URL rather than a local path."""
    return "://" in source or (source.count(":") == 1 and "@" in source.split(":")[0])


MAX_OBJECT_ENTRIES = 500_000  # entries of a local source's object folders looked at before it is refused


class TooManyObjects(ValueError):
    """A local repository's object folders hold more entries than Grove looks through."""


def _unquote(text: str) -> str:
    """Return a path git printed C-quoted (`"a\\057b"`) as it is."""
    if not (len(text) >= 2 and text[0] == text[-1] == '"'):
        return text
    escapes = {
        "\\": b"\\",
        '"': b'"',
        "a": b"\a",
        "b": b"\b",
        "f": b"\f",
        "n": b"\n",
        "r": b"\r",
        "t": b"\t",
        "v": b"\v",
    }
    raw = re.sub(
        r"\\([0-7]{3}|.)",
        lambda m: chr(int(m[1], 8)) if len(m[1]) == 3 else escapes.get(m[1], m[1].encode()).decode("latin-1"),
        text[1:-1],
    )
    return raw.encode("latin-1").decode("utf-8", "surrogateescape")


def git_data_folders(path: Path, most: int = MAX_OBJECT_ENTRIES) -> list[Path]:
    """Return, resolved, every folder and linked file git reads a local repository's refs and objects from.

    Git itself says where they are (a gitfile's target, `commondir`, alternates of alternates, in
    its own quoting): its git and common directories, each object folder, and the target of every
    symbolic link inside an object folder (a pack may be one). A folder that is not the top of a
    work tree or a bare repository is imported as files (links stay links): only it is read.
    Raises TooManyObjects past `most` entries, rather than judge a part of them.
    """
    root = path.resolve()
    if not root.is_dir():
        return [root]
    where = run_git("rev-parse", "--path-format=absolute", "--show-toplevel", "--absolute-git-dir",
                    "--git-common-dir", cwd=root, foreign=True)  # fmt: skip
    lines = where.stdout.splitlines()
    if where.returncode or len(lines) != 3 or Path(lines[0]).resolve() != root:
        return [root]
    found = [root, Path(lines[1]).resolve(), Path(lines[2]).resolve()]
    counted = run_git("count-objects", "-v", cwd=root, foreign=True)
    if counted.returncode:
        raise GitError(["count-objects", "-v"], counted.returncode, counted.stderr)
    objects = [Path(lines[2]) / "objects"] + [
        Path(_unquote(line.removeprefix("alternate: "))) for line in counted.stdout.splitlines()
        if line.startswith("alternate: ")
    ]  # fmt: skip
    seen = 0
    for folder in objects:
        found.append(folder.resolve())
        for top, dirs, files in os.walk(folder, followlinks=False):
            seen += len(dirs) + len(files)
            if seen > most:
                raise TooManyObjects(f"{path}: its object folders hold more than {most} entries")
            found += [(Path(top) / n).resolve() for n in (*dirs, *files) if (Path(top) / n).is_symlink()]
    return list(dict.fromkeys(found))


def toplevel(path: Path) -> Path | None:
    """Return the top of the git work tree containing `path`, or None."""
    try:
        out = git("rev-parse", "--show-toplevel", cwd=path, foreign=True)
    except (GitError, NotADirectoryError, FileNotFoundError):
        return None
    return Path(out.strip()).resolve()
