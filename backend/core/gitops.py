"""The one adapter to git: clones, worktrees, commits, diffs and merges.

The git CLI does most of it; a node's worktree, commit, diffs and a gate's merge go through
libgit2 in-process (`libgit`), on the same repositories, and through the CLI where libgit2 would
not read a repository as git does. Worktree and merge operations on a repository are serialised
by a file lock in its git directory, since concurrent `git worktree add` calls race on shared
metadata.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import posixpath
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from backend.core import libgit
from backend.core.gitrun import FOREIGN_CONFIG, either
from backend.core.gitrun import GitError as GitError
from backend.core.gitrun import MergeConflict as MergeConflict
from backend.core.gitrun import TooManyObjects as TooManyObjects
from backend.core.gitrun import foreign_program as foreign_program
from backend.core.gitrun import git as git
from backend.core.gitrun import git_data_folders as git_data_folders
from backend.core.gitrun import git_env as git_env
from backend.core.gitrun import is_url as is_url
from backend.core.gitrun import kill_all as kill_all
from backend.core.gitrun import run_captured as run_captured
from backend.core.gitrun import run_git as run_git
from backend.core.gitrun import toplevel as toplevel

_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_FILES: dict[tuple[str, str], tuple[str, ...]] = {}  # (repository, commit) -> its files, newest last


@dataclass(frozen=True)
class Change:
    """What a diff touched: every path (both sides of a rename), and files, insertions and deletions."""

    paths: list[str]
    stats: dict[str, int]


@dataclass(frozen=True)
class Repo:
    """Grove's own clone of a target repository (`foreign`: a repository Grove did not make, read only)."""

    path: Path
    foreign: bool = False

    def __post_init__(self) -> None:
        # An empty path (a study not yet cloned) would be "." : some other repository entirely.
        if self.path == Path():
            raise GitError([], -1, f"no repository at {str(self.path)!r} (the study has no clone yet)")

    def git(self, *args: str, check: bool = True) -> str:
        """Run git in this repository."""
        return git(*args, cwd=self.path, check=check, foreign=self.foreign)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the per-repository lock for worktree and merge operations."""
        lock_path = self.path / ".git" / "grove.lock"
        with open(lock_path, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def rev(self, ref: str) -> str:
        """Return the commit id a ref points at."""
        return self.git("rev-parse", "--verify", f"{ref}^{{commit}}").strip()

    def branches(self) -> list[str]:
        """Return the names of the local branches, Grove's own (`grove/...`) left out."""
        out = self.git("for-each-ref", "--format=%(refname:short)", "refs/heads")
        return [b for b in out.split() if not b.startswith("grove/")]

    def branch_exists(self, branch: str) -> bool:
        """Return whether a local branch exists."""
        return bool(self.git("branch", "--list", branch).strip())

    def set_branch(self, branch: str, commit: str) -> None:
        """Point a branch at a commit, creating it if needed."""
        with self.lock():
            either(
                ["branch", "-f", branch, commit],
                lambda: libgit.set_branch(self.path, branch, commit),
                lambda: self.git("branch", "-f", branch, commit),
            )

    def files_at(self, ref: str) -> list[str]:
        """Return every file path at a commit."""
        key = (str(self.path), ref)
        if key in _FILES:
            return list(_FILES[key])
        files = [p for p in self.git("ls-tree", "-r", "--name-only", "-z", ref).split("\0") if p]
        if _SHA.fullmatch(ref):  # a commit id names the same tree forever; a branch does not
            _FILES[key] = tuple(files)
            while len(_FILES) > 64:
                _FILES.pop(next(iter(_FILES)))
        return files

    def read_at(self, ref: str, path: str) -> str:
        """Return a file's text at a commit."""
        return self.git("show", f"{ref}:{path}")

    def read_followed(self, ref: str, path: str) -> str:
        """Return a file's text at a commit, following symbolic links that stay inside the repository."""
        return self.read_at(ref, self.resolve_at(ref, path))

    def resolve_at(self, ref: str, path: str) -> str:
        """Return the path a file's symbolic links lead to at a commit (itself if none); never outside."""
        for _ in range(8):
            entry = self.git("ls-tree", "-z", ref, "--", path)
            if not entry.startswith("120000 "):
                return path
            target = self.read_at(ref, path)
            new = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
            if target.startswith("/") or new == ".." or new.startswith("../"):
                raise ValueError(f"{path} is a link to {target!r}, outside the repository")
            path = new
        raise ValueError(f"{path}: too many levels of symbolic links")

    def changed_files(self, old: str, new: str) -> list[str]:
        """Return paths that differ between two commits (renames as delete + add)."""
        args = ["diff", "--no-ext-diff", "--no-textconv", "--name-only", "--no-renames", "-z", old, new]
        return either(
            args,
            lambda: libgit.changed_files(self.path, old, new),
            lambda: [p for p in self.git(*args).split("\0") if p],
        )

    def diff(self, old: str, new: str) -> str:
        """Return the unified diff between two commits."""
        return self.git("diff", "--no-ext-diff", "--no-textconv", "--no-color", old, new)

    def change(self, old: str, new: str) -> Change:
        """Return what changed between two commits: every path touched, and the diff's sizes."""
        args = ["diff", "--no-ext-diff", "--no-textconv", "--numstat", "-z", old, new]
        return either(
            args, lambda: Change(*libgit.change(self.path, old, new)), lambda: _numstat(self.git(*args))
        )

    def is_ancestor(self, commit: str, of: str) -> bool:
        """Return whether `commit` is an ancestor of (or equal to) `of`."""
        args = ["merge-base", "--is-ancestor", commit, of]
        return either(
            args,
            lambda: libgit.is_ancestor(self.path, commit, of),
            lambda: run_git(*args, cwd=self.path).returncode == 0,
        )

    def merge_mismatch(self, commit: str, onto: str, theirs: str) -> str:
        """Return how `commit` differs from the merge `merge_onto` makes of `theirs` into `onto`, or ''."""
        args = ["merge-tree", "--write-tree", onto, theirs]
        return either(
            args,
            lambda: libgit.merge_mismatch(self.path, commit, onto, theirs),
            lambda: self._merge_mismatch_cli(commit, onto, theirs),
        )

    def _merge_mismatch_cli(self, commit: str, onto: str, theirs: str) -> str:
        """Check a merge as `merge_mismatch` does, with git itself (`git merge-tree --write-tree`)."""
        got = run_git(
            "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}", cwd=self.path
        ).stdout.strip()
        if not got:
            return f"commit {commit} is not in Grove's clone"
        ours, other = self.rev(onto), self.rev(theirs)
        if self.is_ancestor(other, ours):
            return (
                "" if got == ours else f"{commit[:12]} is not trunk {onto[:12]}, which already holds the node"
            )
        if self.git("rev-list", "--parents", "-n", "1", got).split()[1:] != [ours, other]:
            return (
                f"the parents of {commit[:12]} are not trunk {onto[:12]} and the node's commit {theirs[:12]}"
            )
        proc = run_git("merge-tree", "--write-tree", "--no-messages", ours, other, cwd=self.path)
        if proc.returncode != 0:
            return f"trunk {onto[:12]} and the node's commit {theirs[:12]} do not merge cleanly"
        if self.git("rev-parse", f"{got}^{{tree}}").strip() != proc.stdout.split()[0]:
            return f"the files of {commit[:12]} are not the merge of trunk {onto[:12]} and the node's commit {theirs[:12]}"
        return ""

    # sealed files kept out of history -------------------------------------------

    def _with_index(self, *args: str, index: Path) -> str:
        """Run git on a private index file (the repository's own index is never touched)."""
        env = {**git_env(), "GIT_INDEX_FILE": str(index)}
        proc = run_captured(["git", *args], cwd=self.path, env=env, timeout=300)
        if proc.returncode != 0:
            raise GitError(list(args), proc.returncode, proc.stderr)
        return proc.stdout

    def without(self, commit: str, paths: list[str], message: str) -> str:
        """Return a new parentless commit of `commit`'s files but `paths` (its author kept)."""
        with tempfile.TemporaryDirectory(prefix="grove-index-") as tmp:
            index = Path(tmp) / "index"
            self._with_index("read-tree", commit, index=index)
            for chunk in range(0, len(paths), 200):
                self._with_index("rm", "-q", "--cached", "--", *paths[chunk : chunk + 200], index=index)
            tree = self._with_index("write-tree", index=index).strip()
        fmt = "%an%x00%ae%x00%ad"
        name, email, date = self.git("log", "-1", f"--format={fmt}", "--date=raw", commit).strip().split("\0")
        env = {**git_env(), "GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": date}
        env.update(GIT_COMMITTER_NAME="Grove", GIT_COMMITTER_EMAIL="grove@localhost")
        proc = run_captured(["git", "commit-tree", tree, "-m", message], cwd=self.path, env=env, timeout=60)
        if proc.returncode != 0:
            raise GitError(["commit-tree", tree], proc.returncode, proc.stderr)
        return proc.stdout.strip()

    def with_files(self, commit: str, source: str, paths: list[str], parent: str, message: str) -> str:
        """Return a commit of `commit`'s files plus `paths` as `source` has them, on `parent`."""
        with tempfile.TemporaryDirectory(prefix="grove-index-") as tmp:
            index = Path(tmp) / "index"
            self._with_index("read-tree", commit, index=index)
            listing = self.git("ls-tree", "-z", source, "--", *paths) if paths else ""
            info = "".join(f"{e}\n" for e in listing.split("\0") if e)
            if info:
                env = {**git_env(), "GIT_INDEX_FILE": str(index)}
                with subprocess.Popen(
                    ["git", "update-index", "--index-info"], cwd=self.path, env=env, stdin=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True,
                ) as proc:  # fmt: skip
                    _, err = proc.communicate(info, timeout=300)
                if proc.returncode != 0:
                    raise GitError(["update-index", "--index-info"], proc.returncode, err)
            tree = self._with_index("write-tree", index=index).strip()
        env = {**git_env(), "GIT_AUTHOR_NAME": "Grove", "GIT_AUTHOR_EMAIL": "grove@localhost"}
        env.update(GIT_COMMITTER_NAME="Grove", GIT_COMMITTER_EMAIL="grove@localhost")
        argv = ["git", "commit-tree", tree, "-p", parent, "-m", message]
        proc2 = run_captured(argv, cwd=self.path, env=env, timeout=60)
        if proc2.returncode != 0:
            raise GitError(argv[1:], proc2.returncode, proc2.stderr)
        return proc2.stdout.strip()

    def write_files(self, commit: str, paths: list[str], dest: Path) -> None:
        """Write `paths` as `commit` holds them into the folder `dest` (a worktree), links as links."""
        if not paths:
            return
        with tempfile.TemporaryDirectory(prefix="grove-index-") as tmp:
            index = Path(tmp) / "index"
            self._with_index("read-tree", commit, index=index)
            for chunk in range(0, len(paths), 200):
                self._with_index(
                    "checkout-index",
                    "-f",
                    f"--prefix={dest}/",
                    "--",
                    *paths[chunk : chunk + 200],
                    index=index,
                )

    # worktrees ---------------------------------------------------------------

    def add_worktree(self, path: Path, branch: str, commit: str, reason: str = "grove") -> Path:
        """Create (or recreate) a locked worktree at `path` on `branch`, reset to `commit`."""
        with self.lock():
            self._remove_worktree_locked(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            args = [
                "worktree", "add", "--no-track", "--lock", "--reason", reason, "-B", branch, str(path), commit,
            ]  # fmt: skip
            either(
                args,
                lambda: libgit.add_worktree(self.path, path, branch, commit, reason),
                lambda: self.git(*args),
            )
        return path

    def remove_worktree(self, path: Path) -> None:
        """Remove a worktree and its metadata; the branch stays."""
        with self.lock():
            self._remove_worktree_locked(path)

    def _remove_worktree_locked(self, path: Path) -> None:
        # As `git worktree remove --force --force` does it (locked, dirty or not, it goes with its
        # records), without a git process; what resists is left to `git worktree prune`.
        record = self._record_of(path)
        existed = path.exists()
        if existed:
            shutil.rmtree(path, ignore_errors=True)
        if record is not None and not path.exists():
            shutil.rmtree(record, ignore_errors=True)
        if path.exists() or (record is not None and record.exists()):
            self.git("worktree", "unlock", str(path), check=False)  # a locked record is never pruned
            self.git("worktree", "prune", "--expire=now")
        elif existed and record is None:
            self.git("worktree", "prune", "--expire=now")  # a folder git may know by another path

    def _record_of(self, path: Path) -> Path | None:
        """Return git's record (admin folder) of the worktree at `path`, if it has one (no git process)."""
        admin = self.path / ".git" / "worktrees"
        wanted = {str(path / ".git"), str(path.resolve() / ".git")}
        try:
            entries = list(admin.iterdir())
        except OSError:
            return None
        for entry in entries:
            try:
                recorded = Path((entry / "gitdir").read_text().strip())
            except OSError:
                continue
            if not recorded.is_absolute():  # git's worktree.useRelativePaths
                recorded = Path(os.path.normpath(entry / recorded))
            if str(recorded) in wanted:
                return entry
        return None

    def worktrees(self) -> list[dict[str, str]]:
        """Return `git worktree list --porcelain` as dicts (the main one excluded)."""
        out: list[dict[str, str]] = []
        cur: dict[str, str] = {}
        for line in [*self.git("worktree", "list", "--porcelain").splitlines(), ""]:
            if not line:
                if cur:
                    out.append(cur)
                cur = {}
                continue
            key, _, value = line.partition(" ")
            cur[key] = value
        main = str(self.path.resolve())
        return [w for w in out if w.get("worktree") != main]

    def commit_all(self, worktree: Path, message: str) -> str | None:
        """Stage everything in a worktree and commit; return the new commit or None if clean.

        The commit starts no automatic maintenance (a `git gc --auto` on a job's critical path):
        call `maintain` once the result is stored.
        """
        git("add", "-A", cwd=worktree)  # git's own staging: ignore files, skip-worktree, nested repositories
        return either(
            ["commit", "-m", message],
            lambda: libgit.commit_staged(worktree, message),
            lambda: _commit_staged(worktree, message),
        )

    def maintain(self) -> None:
        """Run git's automatic maintenance if it is due (packs loose objects now and then), unless turned off."""
        auto = self.git("config", "--type=bool", "--default=true", "--get", "maintenance.auto", check=False)
        if auto.strip() != "false":
            self.git("maintenance", "run", "--auto", "--quiet", check=False)

    def merge_onto(self, branch: str, onto: str, theirs: str, message: str) -> str:
        """Merge `theirs` into commit `onto` (`--no-ff`), point `branch` at the merge and return it.

        Made in memory (no worktree); a conflict raises `MergeConflict` and writes nothing.
        """
        with self.lock():
            return either(
                ["merge", "--no-ff", "-m", message, theirs],
                lambda: libgit.merge(self.path, branch, onto, theirs, message),
                lambda: self._merge_in_worktree(branch, onto, theirs, message),
            )

    def _merge_in_worktree(self, branch: str, onto: str, theirs: str, message: str) -> str:
        """Merge as `merge_onto` does, with git itself in a worktree of its own (the repository lock held)."""
        path = Path(tempfile.mkdtemp(prefix="grove-merge-")) / "tree"
        try:
            self.git("worktree", "add", "--no-track", "-B", branch, str(path), onto)
            proc = run_git("merge", "--no-ff", "--no-edit", "-m", message, theirs, cwd=path)
            if proc.returncode != 0:
                git("merge", "--abort", cwd=path, check=False)  # the branch stays at `onto`
                raise MergeConflict(["merge", theirs], proc.returncode, proc.stdout + proc.stderr)
            return git("rev-parse", "HEAD", cwd=path).strip()
        finally:
            self._remove_worktree_locked(path)
            shutil.rmtree(path.parent, ignore_errors=True)


def _numstat(out: str) -> Change:
    """Read `git diff --numstat -z` output: every path (both sides of a rename), files, insertions and deletions."""
    fields = out.split("\0")
    paths: list[str] = []
    files = ins = dels = 0
    i = 0
    while i < len(fields) and fields[i]:
        a, d, path = fields[i].split("\t", 2)
        if path:
            paths.append(path)
            i += 1
        else:  # a rename or copy: its source and destination follow
            paths += fields[i + 1 : i + 3]
            i += 3
        files += 1
        ins += int(a) if a.isdigit() else 0
        dels += int(d) if d.isdigit() else 0
    return Change(paths, {"files": files, "insertions": ins, "deletions": dels})


def _commit_staged(worktree: Path, message: str) -> str | None:
    """Commit the index with git itself; None if nothing, or only nested repositories, changed."""
    proc = run_git("diff", "--cached", "--quiet", "--ignore-submodules=all", "HEAD", "--", cwd=worktree)
    if proc.returncode not in (0, 1):  # no HEAD yet: ask for the status instead
        changed = bool(git("status", "--porcelain", "--ignore-submodules=all", cwd=worktree).strip())
    else:
        changed = proc.returncode == 1
    if not changed:
        return None
    git("-c", "maintenance.auto=false", "commit", "-q", "--no-verify", "-m", message, cwd=worktree)
    return git("rev-parse", "HEAD", cwd=worktree).strip()


def commit_foreign(root: Path, files: list[str], message: str) -> str:
    """Commit `files` of a repository Grove did not make, as they are on disk; return the commit.

    Nothing the repository configures runs: blobs are written with `hash-object --no-filters` (no
    clean or process filter of its `.gitattributes`), the tree is built in a scratch index from
    HEAD, the commit by `commit-tree` (no hooks, no signing) and the branch moved by `update-ref`.
    The repository's own index then records the same blobs, leaving the rest of it as it was, with
    every filter driver it configures emptied (writing an index re-reads racily clean files).
    """
    names = run_git(
        "config", "--name-only", "--get-regexp", r"^filter\.", cwd=root, foreign=True
    ).stdout.split()
    drivers = sorted({key.split(".", 1)[1].rsplit(".", 1)[0] for key in names if key.count(".") >= 2})
    off = [a for d in drivers for v in ("clean=", "smudge=", "process=", "required=false")
           for a in ("-c", f"filter.{d}.{v}")]  # fmt: skip
    head = run_git("rev-parse", "--verify", "-q", "HEAD^{commit}", cwd=root, foreign=True).stdout.strip()
    prefix = git("rev-parse", "--show-prefix", cwd=root, foreign=True).strip()  # `root` may be a subfolder
    entries = []
    for rel in files:
        mode = "100755" if os.access(root / rel, os.X_OK) else "100644"
        blob = git("hash-object", "-w", "--no-filters", "--", rel, cwd=root, foreign=True).strip()
        entries.append(f"{mode},{blob},{prefix}{rel}")
    with tempfile.TemporaryDirectory(prefix="grove-index-") as tmp:
        env = {**git_env(FOREIGN_CONFIG), "GIT_INDEX_FILE": str(Path(tmp) / "index")}

        def scratch(*args: str) -> str:
            done = run_captured(["git", *args], cwd=root, env=env, timeout=300)
            if done.returncode:
                raise GitError(list(args), done.returncode, done.stderr)
            return done.stdout

        if head:
            scratch("read-tree", head)
        for entry in entries:
            scratch("update-index", "--add", "--cacheinfo", entry)
        tree = scratch("write-tree").strip()
    if head and tree == git("rev-parse", f"{head}^{{tree}}", cwd=root, foreign=True).strip():
        return head  # the files are committed as they are already
    commit = git(
        "commit-tree", tree, *(("-p", head) if head else ()), "-m", message, cwd=root, foreign=True
    ).strip()
    git(
        "update-ref",
        "-m",
        f"grove: {message}",
        "HEAD",
        commit,
        head or "0" * len(commit),
        cwd=root,
        foreign=True,
    )
    for entry in entries:
        git(*off, "update-index", "--add", "--cacheinfo", entry, cwd=root, foreign=True)
    return commit


def clone(source: str, dest: Path, timeout: float = 600) -> Repo:
    """Make Grove's own clone of a repository: a URL or git path is cloned, a plain folder imported.

    A folder that is not the top of a git work tree (e.g. an example inside another repository)
    is imported as a snapshot: a fresh repository whose first commit holds its files on `main`.
    """
    if dest.exists() and (dest / ".git").exists():
        return Repo(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if is_url(source):
        git("clone", "--quiet", "--no-local", "--", source, str(tmp), timeout=timeout)
    else:
        src = Path(source).expanduser().resolve()
        if not src.is_dir():
            raise FileNotFoundError(f"repository {source!r} does not exist or is not a directory")
        top = toplevel(src)
        if top == src:
            # The source's upload-pack runs in the source, with its config: no transport (no lazy fetch).
            upload = f"--upload-pack={foreign_program('upload-pack')}"
            git("clone", "--quiet", "--no-local", upload, "--", str(src), str(tmp), timeout=timeout)
            # Local branches of the source become local branches of the clone.
            for ref in git(
                "for-each-ref", "--format=%(refname:short)", "refs/remotes/origin", cwd=tmp
            ).split():
                name = ref.removeprefix("origin/")
                if name != "HEAD" and "/" not in name:
                    git("branch", "-f", name, ref, cwd=tmp, check=False)
        else:
            # Links stay links: a folder's link to another study's clone imports no byte of it.
            shutil.copytree(
                src, tmp, symlinks=True, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.pyc")
            )
            git("init", "--quiet", "-b", "main", cwd=tmp)
            git("add", "-A", cwd=tmp)
            git("commit", "--quiet", "-m", f"Import {src.name}", cwd=tmp)
    git("config", "core.hooksPath", "/dev/null", cwd=tmp)
    tmp.rename(dest)
    return Repo(dest)
