"""What a change may touch, and whether a gate's commit is the merge the server would make.

A worker's word is evidence, never authority: before a gate's verdict is kept, and again before
trunk moves, the server recomputes the merge of trunk and the node's recorded commit itself.
"""

from __future__ import annotations

from agents import globs
from agents.spec import Spec
from backend.core.gitops import GitError, Repo


def violation_of(paths: list[str], spec: Spec) -> str:
    """Return why a change to these paths may not be kept (protected, sealed or non-editable), or ''."""
    for path in paths:
        if globs.match_any(spec.files.protected, path):
            return f"changed protected file {path}"
        if globs.match_any(spec.files.sealed, path):
            return f"changed sealed file {path}"
        if not globs.match_any(spec.files.editable, path):
            return f"changed {path}, which is outside files.editable"
    return ""


def diff_violation(repo: Repo, base: str, commit: str, spec: Spec) -> str:
    """Return why a change may not be kept (protected, sealed or non-editable path), or ''."""
    return violation_of(repo.changed_files(base, commit), spec)


def gate_mismatch(repo: Repo, spec: Spec, commit: str, trunk: str, node_commit: str) -> str:
    """Return why `commit` may not become trunk: not trunk merged with the node's commit, or a forbidden path; ''."""
    if not node_commit:
        return "the node has no recorded commit"
    try:
        why = repo.merge_mismatch(commit, trunk, node_commit)
        return why or diff_violation(repo, trunk, commit, spec)
    except GitError as exc:
        return f"cannot check {commit[:12]}: {str(exc)[:300]}"
