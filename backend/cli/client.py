"""A small client of Grove's REST API, used by `grove submit`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

from backend.core import gitops
from backend.core.config import Settings


class ApiError(RuntimeError):
    """The API answered with an error."""


def connection(settings: Settings, api: str | None, token: str | None) -> tuple[str, str]:
    """Return the API URL and token: options, then GROVE_API_URL/GROVE_TOKEN, then what `grove up` wrote."""
    saved: dict[str, str] = {}
    up = settings.data_dir / "up.json"
    if up.exists():
        saved = json.loads(up.read_text())
    url = api or settings.api_url or saved.get("api")
    tok = token or settings.token or saved.get("token")
    if not url or not tok:
        raise ApiError(
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


class Client:
    def __init__(self, api: str, token: str) -> None:
        self.http = httpx.Client(base_url=api, headers={"Authorization": f"Bearer {token}"}, timeout=60)

    def _check(self, resp: httpx.Response) -> Any:
        if resp.status_code >= 400:
            try:
                detail = resp.json()["detail"]
                message = detail["message"] if isinstance(detail, dict) else str(detail)
            except (ValueError, KeyError, TypeError):
                message = resp.text
            raise ApiError(f"{resp.status_code}: {message}")
        return (
            resp.json() if resp.headers.get("content-type", "").startswith("application/json") else resp.text
        )

    def submit(self, spec: str, repository: str) -> dict[str, Any]:
        """Create a study."""
        return dict(self._check(self.http.post("/studies", json={"spec": spec, "repository": repository})))

    def study(self, study_id: int) -> dict[str, Any]:
        """Return a study."""
        return dict(self._check(self.http.get(f"/studies/{study_id}")))

    def pending(self, study_id: int) -> list[dict[str, Any]]:
        """Return the study's pending approvals."""
        return list(self._check(self.http.get("/approvals", params={"study_id": study_id}))["data"])

    def approve(self, study_id: int, node_id: int) -> None:
        """Approve a node."""
        self._check(self.http.post(f"/studies/{study_id}/nodes/{node_id}/approve"))

    def report(self, study_id: int) -> str:
        """Return REPORT.md."""
        return str(self._check(self.http.get(f"/studies/{study_id}/report")))

    def learn(self, kind: str, params: dict[str, Any], study_id: int | None = None) -> dict[str, Any]:
        """Queue a learning job on the gpu queue."""
        body = {"kind": kind, "params": params, "study_id": study_id}
        return dict(self._check(self.http.post("/learning/jobs", json=body)))

    def learning_job(self, job_id: int) -> dict[str, Any]:
        """Return a learning job with its events."""
        return dict(self._check(self.http.get(f"/learning/jobs/{job_id}")))

    def study_id(self, name: str) -> int:
        """Return the id of the study with this name."""
        for st in self._check(self.http.get("/studies", params={"limit": 200}))["data"]:
            if st["name"] == name:
                return int(st["id"])
        raise ApiError(f"no study named {name!r}")
