"""git in-process (libgit2) for the steps on every node's path: its worktree, commit, diffs, a gate's merge.

Each of these took one to four git processes of a millisecond or more apiece; libgit2 does the
same work within the worker. It writes git's own formats, so the git CLI (`gitops`) goes on
reading and changing the same repositories. libgit2 runs no hooks, no fsmonitor, no filter or
merge-driver program, and reads no configuration but the repository's own: Grove's clone, which
no study writes. Where it would not read a repository as git does (SHA-256 objects; files that
git re-encodes at checkout) it raises `Unsupported`, and `gitops` runs git itself.
"""

from __future__ import annotations

import datetime
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pygit2
from pygit2.enums import ConfigLevel, DeltaStatus, DiffFind, DiffOption, FileMode, Option

for _level in (ConfigLevel.SYSTEM, ConfigLevel.XDG, ConfigLevel.GLOBAL, ConfigLevel.PROGRAMDATA):
    pygit2.settings.search_path[_level] = ""  # like the CLI's GIT_CONFIG_NOSYSTEM and GIT_CONFIG_GLOBAL
# libgit2 acts on no repository config, and opens only the clones and worktrees Grove made: a data
# folder owned by another user (a volume; the operator's `safe.directory`) is git's check to make.
pygit2.option(Option.SET_OWNER_VALIDATION, 0)
_ENCODED: dict[str, bool] = {}  # root tree id -> whether a .gitattributes in it names working-tree-encoding


class LibGitError(RuntimeError):
    """libgit2 refused an operation; the message says which and why."""


class Unsupported(LibGitError):
    """libgit2 would not read this repository as git does: the caller runs git itself."""


class Conflict(LibGitError):
    """A merge would leave conflicts; nothing was written."""


@contextmanager
def _opened(path: Path, what: str) -> Iterator[pygit2.Repository]:
    """Open a repository (or worktree) for one operation; its failures become `LibGitError` naming `what`."""
    try:
        repo = pygit2.Repository(str(path))
    except (pygit2.GitError, OSError, KeyError, ValueError) as exc:
        if "object format" in str(exc):  # SHA-256: libgit2 is built without it
            raise Unsupported(f"{what}: {exc}") from exc
        raise LibGitError(f"{what}: {exc}") from exc
    try:
        yield repo
    except LibGitError:
        raise
    except (pygit2.GitError, OSError, KeyError, ValueError) as exc:
        raise LibGitError(f"{what}: {exc}") from exc
    finally:
        repo.free()


def add_worktree(repo_path: Path, path: Path, branch: str, commit: str, reason: str) -> None:
    """Point `branch` at `commit` and check it out in a new locked worktree at `path` (absent now).

    Like `git worktree add --lock -B`: a branch checked out in another worktree is refused.
    """
    with _opened(repo_path, f"worktree {path} on {branch} at {commit[:12]}") as repo:
        target = repo.revparse_single(commit).peel(pygit2.Commit)
        if _encodes(repo, repo_path, target.tree):
            raise Unsupported("a .gitattributes names working-tree-encoding, which libgit2 does not apply")
        admin = repo_path / ".git" / "worktrees"
        name = path.name if not (admin / path.name).exists() else f"{path.name}-{secrets.token_hex(4)}"
        repo.add_worktree(name, str(path), _force_branch(repo, branch, target))
        (admin / name / "locked").write_text(reason)


def _force_branch(repo: pygit2.Repository, branch: str, commit: pygit2.Commit) -> pygit2.Branch:
    """Point `branch` at `commit` like `git branch -f`: never one a worktree has checked out."""
    held = repo.branches.local.get(branch)
    if held is not None and held.is_checked_out():
        raise LibGitError(f"branch {branch!r} is already checked out in a worktree")
    return repo.branches.local.create(branch, commit, force=True)


def _encodes(repo: pygit2.Repository, repo_path: Path, root: pygit2.Tree) -> bool:
    """Return whether git would re-encode files of this tree at checkout (`working-tree-encoding`)."""
    info = repo_path / ".git" / "info" / "attributes"
    if info.is_file() and b"working-tree-encoding" in info.read_bytes():
        return True
    key = str(root.id)
    if key not in _ENCODED:
        found, todo = False, [root]
        while todo and not found:
            for entry in todo.pop():
                if entry.type_str == "tree":
                    todo.append(repo[entry.id].peel(pygit2.Tree))
                elif entry.name == ".gitattributes" and entry.type_str == "blob":
                    found = found or b"working-tree-encoding" in repo[entry.id].peel(pygit2.Blob).data
        _ENCODED[key] = found
        while len(_ENCODED) > 256:
            _ENCODED.pop(next(iter(_ENCODED)))
    return _ENCODED[key]


def commit_staged(worktree: Path, message: str) -> str | None:
    """Commit a worktree's index on its branch; return the commit, or None if only nested repositories changed.

    Like `git commit` after `git diff --cached --quiet --ignore-submodules=all HEAD`; the message
    is cleaned as `git commit -m` cleans it.
    """
    with _opened(worktree, f"commit in {worktree}") as repo:
        head = None if repo.head_is_unborn else repo.head.peel(pygit2.Commit)
        tree = repo[repo.index.write_tree()].peel(pygit2.Tree)
        diff = head.tree.diff_to_tree(tree) if head is not None else tree.diff_to_tree(swap=True)
        if not any(FileMode.COMMIT not in (d.old_file.mode, d.new_file.mode) for d in diff.deltas):
            return None
        who = _signature()
        parents = [head.id] if head is not None else []
        return str(repo.create_commit("HEAD", who, who, clean_message(message), tree.id, parents))


def set_branch(repo_path: Path, branch: str, commit: str) -> None:
    """Point `branch` at `commit`, creating it if needed (`git branch -f`)."""
    with _opened(repo_path, f"branch {branch} at {commit[:12]}") as repo:
        _force_branch(repo, branch, repo.revparse_single(commit).peel(pygit2.Commit))


def is_ancestor(repo_path: Path, commit: str, of: str) -> bool:
    """Return whether `commit` is `of` or one of its ancestors; False if either is unknown."""
    with _opened(repo_path, f"ancestry of {commit[:12]}") as repo:
        try:
            a = repo.revparse_single(commit).peel(pygit2.Commit).id
            b = repo.revparse_single(of).peel(pygit2.Commit).id
        except (KeyError, ValueError, pygit2.GitError):
            return False
        return a == b or repo.descendant_of(b, a)


def merge(repo_path: Path, branch: str, onto: str, theirs: str, message: str) -> str:
    """Merge `theirs` into `onto` with `--no-ff`, point `branch` at the result and return it.

    Made in memory, without a worktree: a conflict raises `Conflict` before anything is written.
    Where `theirs` is already in `onto`, the result is `onto` itself, as git leaves it.
    """
    with _opened(repo_path, f"merge {theirs} into {onto[:12]}") as repo:
        ours, other = repo[onto].peel(pygit2.Commit), repo.revparse_single(theirs).peel(pygit2.Commit)
        if ours.id == other.id or repo.descendant_of(ours.id, other.id):
            _force_branch(repo, branch, ours)
            return str(ours.id)
        index = repo.merge_commits(ours, other)
        if index.conflicts is not None:
            paths = sorted({e.path for entry in index.conflicts for e in entry if e is not None})
            raise Conflict(f"merging {theirs} into {onto[:12]}: conflicts in {', '.join(paths)}")
        tree = index.write_tree(repo)
        who = _signature()
        commit = repo.create_commit(None, who, who, clean_message(message), tree, [ours.id, other.id])
        _force_branch(repo, branch, repo[commit].peel(pygit2.Commit))
        return str(commit)


def _signature() -> pygit2.Signature:
    now = datetime.datetime.now().astimezone()
    offset = int((now.utcoffset() or datetime.timedelta()).total_seconds() // 60)
    return pygit2.Signature("Grove", "grove@localhost", int(now.timestamp()), offset)


def clean_message(message: str) -> str:
    """Return a commit message as `git commit -m` stores it (trailing spaces, extra blank lines gone)."""
    lines = [line.rstrip(" \t\r") for line in message.split("\n")]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")
    return text + "\n" if text else ""


def changed_files(repo_path: Path, old: str, new: str) -> list[str]:
    """Return the paths two commits' trees differ in, a rename as its two paths (`git diff --no-renames`)."""
    with _opened(repo_path, f"diff {old[:12]}..{new[:12]}") as repo:
        return [_text(d.new_file.raw_path) for d in _diff(repo, old, new).deltas]


def change(repo_path: Path, old: str, new: str) -> tuple[list[str], dict[str, int]]:
    """Return every path two commits' trees differ in (both sides of a rename) and the diff's sizes.

    Like `git diff --numstat` with git's default rename detection; a binary file counts no lines.
    """
    with _opened(repo_path, f"diff {old[:12]}..{new[:12]}") as repo:
        diff = _diff(repo, old, new)
        diff.find_similar(DiffFind.FIND_RENAMES)
        paths: list[str] = []
        for d in diff.deltas:
            if d.status in (DeltaStatus.RENAMED, DeltaStatus.COPIED):
                paths += [_text(d.old_file.raw_path), _text(d.new_file.raw_path)]
            else:
                paths.append(_text(d.new_file.raw_path))
        stats = diff.stats
        return paths, {
            "files": stats.files_changed,
            "insertions": stats.insertions,
            "deletions": stats.deletions,
        }


def _diff(repo: pygit2.Repository, old: str, new: str) -> pygit2.Diff:
    a, b = repo.revparse_single(old).peel(pygit2.Commit), repo.revparse_single(new).peel(pygit2.Commit)
    return repo.diff(a, b, flags=DiffOption.INCLUDE_TYPECHANGE)  # a file that became a link: one path


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def merge_mismatch(repo_path: Path, commit: str, onto: str, theirs: str) -> str:
    """Return how `commit` differs from the merge `merge` makes of `theirs` into `onto`, or '' if it is that merge.

    Its parents must be `onto` and `theirs` in that order and its tree the in-memory merge of the two
    (or, where `theirs` is already in `onto`, it must be `onto` itself).
    """
    with _opened(repo_path, f"check {commit[:12]} against {onto[:12]} + {theirs[:12]}") as repo:
        try:
            got = repo.revparse_single(commit).peel(pygit2.Commit)
        except (KeyError, ValueError, pygit2.GitError):
            return f"commit {commit} is not in Grove's clone"
        ours, other = repo[onto].peel(pygit2.Commit), repo.revparse_single(theirs).peel(pygit2.Commit)
        if ours.id == other.id or repo.descendant_of(ours.id, other.id):
            return (
                ""
                if got.id == ours.id
                else f"{commit[:12]} is not trunk {onto[:12]}, which already holds the node"
            )
        if list(got.parent_ids) != [ours.id, other.id]:
            return (
                f"the parents of {commit[:12]} are not trunk {onto[:12]} and the node's commit {theirs[:12]}"
            )
        index = repo.merge_commits(ours, other)
        if index.conflicts is not None:
            return f"trunk {onto[:12]} and the node's commit {theirs[:12]} do not merge cleanly"
        if got.tree_id != index.write_tree(repo):
            return f"the files of {commit[:12]} are not the merge of trunk {onto[:12]} and the node's commit {theirs[:12]}"
        return ""
