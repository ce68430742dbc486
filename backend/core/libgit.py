"""git in-process (libgit2) for the steps on every node's path: its worktree, its commit, its diff.

Each of these took three or four git processes of a millisecond or more apiece; libgit2 does the
same work within the worker. It writes git's own formats, so the git CLI (`gitops`) goes on
reading and changing the same repositories. libgit2 runs no hooks, no fsmonitor and no filter
program, and reads no configuration but the repository's own: Grove's clone, which no study
writes.
"""

from __future__ import annotations

import datetime
import re
import secrets
from pathlib import Path

import pygit2
from pygit2.enums import ConfigLevel, DeltaStatus, DiffFind, FileMode

for _level in (ConfigLevel.SYSTEM, ConfigLevel.XDG, ConfigLevel.GLOBAL, ConfigLevel.PROGRAMDATA):
    pygit2.settings.search_path[_level] = ""  # like the CLI's GIT_CONFIG_NOSYSTEM and GIT_CONFIG_GLOBAL


class LibGitError(RuntimeError):
    """libgit2 refused an operation; the message says which and why."""


def add_worktree(repo_path: Path, path: Path, branch: str, commit: str, reason: str) -> None:
    """Point `branch` at `commit` and check it out in a new locked worktree at `path` (absent now).

    Like `git worktree add --lock -B`: a branch checked out in another worktree is refused.
    """
    repo = pygit2.Repository(str(repo_path))
    try:
        held = repo.branches.local.get(branch)
        if held is not None and held.is_checked_out():
            raise LibGitError(f"branch {branch!r} is already checked out in another worktree")
        admin = repo_path / ".git" / "worktrees"
        name = path.name if not (admin / path.name).exists() else f"{path.name}-{secrets.token_hex(4)}"
        ref = repo.branches.local.create(branch, repo[commit].peel(pygit2.Commit), force=True)
        repo.add_worktree(name, str(path), ref)
        (admin / name / "locked").write_text(reason)
    except (pygit2.GitError, OSError, KeyError, ValueError) as exc:
        raise LibGitError(f"worktree {path} on {branch} at {commit[:12]}: {exc}") from exc
    finally:
        repo.free()


def commit_staged(worktree: Path, message: str) -> str | None:
    """Commit a worktree's index on its branch; return the commit, or None if only nested repositories changed.

    Like `git commit` after `git diff --cached --quiet --ignore-submodules=all HEAD`; the message
    is cleaned as `git commit -m` cleans it.
    """
    repo = pygit2.Repository(str(worktree))
    try:
        head = None if repo.head_is_unborn else repo.head.peel(pygit2.Commit)
        tree = repo[repo.index.write_tree()].peel(pygit2.Tree)
        diff = head.tree.diff_to_tree(tree) if head is not None else tree.diff_to_tree(swap=True)
        if not any(FileMode.COMMIT not in (d.old_file.mode, d.new_file.mode) for d in diff.deltas):
            return None
        who = _signature()
        return str(
            repo.create_commit("HEAD", who, who, clean_message(message), tree.id, [head.id] if head else [])
        )
    except (pygit2.GitError, OSError, KeyError, ValueError) as exc:
        raise LibGitError(f"commit in {worktree}: {exc}") from exc
    finally:
        repo.free()


def set_branch(repo_path: Path, branch: str, commit: str) -> None:
    """Point `branch` at `commit`, creating it if needed; like `git branch -f`, not one a worktree has out."""
    repo = pygit2.Repository(str(repo_path))
    try:
        held = repo.branches.local.get(branch)
        if held is not None and held.is_checked_out():
            raise LibGitError(f"branch {branch!r} is checked out in a worktree")
        repo.branches.local.create(branch, repo.revparse_single(commit).peel(pygit2.Commit), force=True)
    except (pygit2.GitError, OSError, KeyError, ValueError) as exc:
        raise LibGitError(f"branch {branch} at {commit[:12]}: {exc}") from exc
    finally:
        repo.free()


def is_ancestor(repo_path: Path, commit: str, of: str) -> bool:
    """Return whether `commit` is `of` or one of its ancestors; False if either is unknown."""
    repo = pygit2.Repository(str(repo_path))
    try:
        a, b = (
            repo.revparse_single(commit).peel(pygit2.Commit).id,
            repo.revparse_single(of).peel(pygit2.Commit).id,
        )
        return a == b or repo.descendant_of(b, a)
    except (pygit2.GitError, OSError, KeyError, ValueError):
        return False
    finally:
        repo.free()


class Conflict(LibGitError):
    """A merge would leave conflicts; nothing was written."""


def merge(repo_path: Path, branch: str, onto: str, theirs: str, message: str) -> str:
    """Merge `theirs` into `onto` as a new commit with both as parents, point `branch` at it, return it.

    Like `git merge --no-ff` in a worktree of `onto` on `branch`, without a worktree: the merge is
    made in memory, and a conflict raises `Conflict` before anything is written.
    """
    repo = pygit2.Repository(str(repo_path))
    try:
        ours, other = repo[onto].peel(pygit2.Commit), repo.revparse_single(theirs).peel(pygit2.Commit)
        index = repo.merge_commits(ours, other)
        if index.conflicts is not None:
            paths = sorted({e.path for entry in index.conflicts for e in entry if e is not None})
            raise Conflict(f"merging {theirs} into {onto[:12]}: conflicts in {', '.join(paths)}")
        tree = index.write_tree(repo)
        who = _signature()
        commit = repo.create_commit(None, who, who, clean_message(message), tree, [ours.id, other.id])
        held = repo.branches.local.get(branch)
        if held is not None and held.is_checked_out():
            raise LibGitError(f"branch {branch!r} is checked out in a worktree")
        repo.branches.local.create(branch, repo[commit].peel(pygit2.Commit), force=True)
        return str(commit)
    except (pygit2.GitError, OSError, KeyError, ValueError) as exc:
        raise LibGitError(f"merge {theirs} into {onto[:12]}: {exc}") from exc
    finally:
        repo.free()


def _signature() -> pygit2.Signature:
    now = datetime.datetime.now().astimezone()
    offset = int((now.utcoffset() or datetime.timedelta()).total_seconds() // 60)
    return pygit2.Signature("Grove", "grove@localhost", int(now.timestamp()), offset)


def clean_message(message: str) -> str:
    """Return a commit message as `git commit -m` stores it (trailing spaces, extra blank lines gone)."""
    lines = [line.rstrip() for line in message.splitlines()]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")
    return text + "\n" if text else ""


def head(worktree: Path) -> str:
    """Return the commit a worktree's HEAD is at."""
    repo = pygit2.Repository(str(worktree))
    try:
        return str(repo.head.peel(pygit2.Commit).id)
    except (pygit2.GitError, OSError, KeyError, ValueError) as exc:
        raise LibGitError(f"HEAD of {worktree}: {exc}") from exc
    finally:
        repo.free()


def changed_files(repo_path: Path, old: str, new: str) -> list[str]:
    """Return the paths two commits' trees differ in, a rename as its two paths (`git diff --no-renames`)."""
    repo = pygit2.Repository(str(repo_path))
    try:
        diff = repo.diff(repo[old].peel(pygit2.Commit), repo[new].peel(pygit2.Commit))
        return [_text(d.new_file.raw_path) for d in diff.deltas]
    except (pygit2.GitError, OSError, KeyError, ValueError) as exc:
        raise LibGitError(f"diff {old[:12]}..{new[:12]} in {repo_path}: {exc}") from exc
    finally:
        repo.free()


def change(repo_path: Path, old: str, new: str) -> tuple[list[str], dict[str, int]]:
    """Return every path two commits' trees differ in (both sides of a rename) and the diff's sizes.

    Like `git diff --numstat` with git's default rename detection; a binary file counts no lines.
    """
    repo = pygit2.Repository(str(repo_path))
    try:
        diff = repo.diff(repo[old].peel(pygit2.Commit), repo[new].peel(pygit2.Commit))
        diff.find_similar(DiffFind.FIND_RENAMES)
        paths: list[str] = []
        for d in diff.deltas:
            if d.status in (DeltaStatus.RENAMED, DeltaStatus.COPIED):
                paths += [_text(d.old_file.raw_path), _text(d.new_file.raw_path)]
            else:
                paths.append(_text(d.new_file.raw_path))
        stats = diff.stats
        sizes = {"files": stats.files_changed, "insertions": stats.insertions, "deletions": stats.deletions}
        return paths, sizes
    except (pygit2.GitError, OSError, KeyError, ValueError) as exc:
        raise LibGitError(f"diff {old[:12]}..{new[:12]} in {repo_path}: {exc}") from exc
    finally:
        repo.free()


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")
