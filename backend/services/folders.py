"""Which server paths a request over the API may name: the folder rules of repository paths, for any field."""

from __future__ import annotations

from backend.core import gitops
from backend.core.config import Settings
from backend.services.studies import SourceRefused, check_source


def check_local_path(settings: Settings, path: str, field: str) -> None:
    """Refuse a server path given over the API in `field` unless a repository path could name it there.

    The rules are `check_source`'s for local paths (under `GROVE_REPO_ROOTS`, never inside Grove's own
    data or worktree folders), checked before anything looks at the path, so that a refusal says
    nothing about what exists on the server. A URL is no local path. Raises SourceRefused, its
    `key` the field.
    """
    if not path.strip() or gitops.is_url(path) or path.lower().startswith("file:"):
        raise SourceRefused(f"{field}", "must be a local path on the server")
    try:
        check_source(settings, path)
    except SourceRefused as exc:
        raise SourceRefused(field, exc.detail) from None
