"""Messages for repository problems met while creating a study."""

from __future__ import annotations

from typing import Any

from backend.core.gitops import GitError


def repository_error(exc: Exception) -> dict[str, Any]:
    """Return an error body that names the `repository` field."""
    if isinstance(exc, GitError):
        text = exc.stderr.strip().splitlines()[-1] if exc.stderr.strip() else str(exc)
        message = f"repository: git could not read it ({text})"
    else:
        message = f"repository: {exc}"
    return {"message": message, "errors": [{"key": "repository", "message": message}]}
