"""Where the CLI finds the API (options, environment, what `grove up` wrote) and what it submits."""

from __future__ import annotations

import json
import time
from pathlib import Path

from backend.core import gitops
from backend.core.config import Settings
from client import GroveError


def connection(settings: Settings, api: str | None, token: str | None) -> tuple[str, str]:
    """Return the API URL and token: options, then GROVE_API_URL/GROVE_TOKEN, then what `grove up` wrote."""
    saved: dict[str, str] = {}
    up = settings.data_dir / "up.json"
    if up.exists():
        saved = json.loads(up.read_text())
    url = api or settings.api_url or saved.get("api")
    tok = token or settings.token or saved.get("token")
    if not url or not tok:
        raise GroveError(
            "no API to talk to: start `grove up`, or pass --api and --token (or GROVE_API_URL, GROVE_TOKEN)"
        )
    return url.rstrip("/"), tok


def git_repository(settings: Settings, folder: Path) -> Path:
    """Return a git repository for a folder: itself, or an imported snapshot of it."""
    folder = folder.resolve()
    if gitops.toplevel(folder) == folder:
        return folder
    dest = settings.data_dir / "imports" / f"{folder.name}-{int(time.time() * 1000)}"
    gitops.clone(str(folder), dest)
    return dest
