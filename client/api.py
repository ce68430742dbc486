"""Grove's REST API as Python calls: the one client of the CLI (`grove submit`, `grove learn`) and the dashboard.

Exceptions::

    GroveError              anything this client raises
    ├── Unreachable         the API did not answer: it is down, the URL is wrong, or it timed out
    └── ApiError            the API answered with an error status; `.errors` names the fields
        ├── Unauthorized    401: no token, or a wrong or revoked one
        ├── Forbidden       403: the token lacks the role the action needs
        ├── NotFound        404: no such study, node, approval or job
        ├── Conflict        409: the action does not fit the current state (a paused study paused again)
        └── Invalid         422: the request was refused; `.errors` holds `{"key", "message"}` per field
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, cast

import httpx

from client import models

DEFAULT_API = "http://127.0.0.1:8000/api/v1"


class GroveError(Exception):
    """Something went wrong talking to Grove."""


class Unreachable(GroveError):
    """The API did not answer."""


@dataclass
class ApiError(GroveError):
    """The API answered with an error status."""

    status: int
    message: str
    errors: list[dict[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        return f"HTTP {self.status}: {self.message}"

    def for_field(self, prefix: str) -> list[str]:
        """Return the messages about field `prefix` and its sub-keys, each led by the sub-key."""
        out = []
        for e in self.errors:
            key = e.get("key", "")
            if key == prefix:
                out.append(e["message"])
            elif key.startswith(prefix + "."):
                out.append(f"{key[len(prefix) + 1 :]}: {e['message']}")
        return out


class Unauthorized(ApiError):
    """401: the token is missing, wrong or revoked."""


class Forbidden(ApiError):
    """403: the token lacks a role."""


class NotFound(ApiError):
    """404: the thing asked for does not exist."""


class Conflict(ApiError):
    """409: the action does not fit the current state."""


class Invalid(ApiError):
    """422: the request was refused; `errors` names the fields."""


KINDS: dict[int, type[ApiError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    422: Invalid,
}


def from_env() -> tuple[str, str]:
    """Return the API URL and token from GROVE_API_URL and GROVE_TOKEN (token may be empty)."""
    return os.environ.get("GROVE_API_URL") or DEFAULT_API, os.environ.get("GROVE_TOKEN", "")


def _error(resp: httpx.Response) -> ApiError:
    try:
        detail = resp.json().get("detail", resp.text)
    except ValueError:
        detail = resp.text
    if isinstance(detail, dict):
        message, errors = str(detail.get("message", "")), list(detail.get("errors") or [])
    else:
        message, errors = str(detail), []
    return KINDS.get(resp.status_code, ApiError)(resp.status_code, message or resp.reason_phrase, errors)


class Grove:
    """Grove's REST API at `api` (the `/api/v1` URL), called with a bearer `token`."""

    def __init__(self, api: str, token: str = "", timeout: float = 30.0) -> None:
        self.api = api.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.api, headers=headers, timeout=timeout)

    def close(self) -> None:
        """Close the connection pool."""
        self.http.close()

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = self.http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise Unreachable(
                f"the Grove API at {self.api} did not answer ({type(exc).__name__}: {exc})"
            ) from None
        if resp.status_code >= 400:
            raise _error(resp)
        return resp

    def _get(self, path: str, **params: Any) -> Any:
        clean = {k: v for k, v in params.items() if v is not None}
        return self._call("GET", path, params=clean).json()

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self._call("POST", path, json=body if body is not None else {}).json()

    def health(self) -> dict[str, str]:
        """Return the API's health (no token needed)."""
        return cast(dict[str, str], self._get("/health"))

    def whoami(self) -> dict[str, Any]:
        """Return the name and roles of this client's token."""
        return cast(dict[str, Any], self._get("/whoami"))

    def check(self) -> int:
        """Check that the token may read; return the number of studies."""
        return int(self._get("/studies", limit=1)["count"])

    def studies(self, limit: int = 200) -> list[models.Study]:
        """Return studies, newest first."""
        return cast(list[models.Study], self._get("/studies", limit=limit)["data"])

    def study(self, study_id: int) -> models.Study:
        """Return one study."""
        return cast(models.Study, self._get(f"/studies/{study_id}"))

    def study_id(self, name: str) -> int:
        """Return the id of the study with this name, or raise `NotFound`."""
        for st in self.studies():
            if st["name"] == name:
                return st["id"]
        raise NotFound(404, f"no study named {name!r}")

    def draft(self, repository: str, goal: str, use_model: bool = True) -> dict[str, Any]:
        """Draft a commented grove.toml for a repository and a goal in words; return spec, notes, model."""
        body = {"repository": repository, "goal": goal, "use_model": use_model}
        return cast(dict[str, Any], self._post("/studies/draft", body))

    def validate(self, spec: str, repository: str) -> str:
        """Check a spec against a repository; return the API's message or raise `Invalid`."""
        return str(self._post("/studies/validate", {"spec": spec, "repository": repository})["message"])

    def create(self, spec: str, repository: str) -> models.Study:
        """Create and start a study."""
        return cast(models.Study, self._post("/studies", {"spec": spec, "repository": repository}))

    def control(self, study_id: int, action: str) -> models.Study:
        """Pause, resume or stop a study; return it."""
        if action not in ("pause", "resume", "stop"):
            raise ValueError(f"unknown action {action!r}")
        return cast(models.Study, self._post(f"/studies/{study_id}/{action}"))

    def promote(self, study_id: int) -> str:
        """Push trunk to the origin; return the API's message."""
        return str(self._post(f"/studies/{study_id}/promote")["message"])

    def search_space(self, study_id: int) -> dict[str, Any]:
        """Return each measured node's `[search]` values with its dev score."""
        return cast(dict[str, Any], self._get(f"/studies/{study_id}/search"))

    def importance(self, study_id: int) -> dict[str, Any]:
        """Return how much each `[search]` key sets the best nodes apart (PED-ANOVA), most important first."""
        return cast(dict[str, Any], self._get(f"/studies/{study_id}/importance"))

    def memory(self, study_id: int) -> list[models.MemoryEntry]:
        """Return what Grove already knew for a study: the lab-memory entries its ideator is given."""
        return cast(list[models.MemoryEntry], self._get(f"/studies/{study_id}/memory"))

    def memory_entries(self, study: str | None = None) -> list[models.MemoryEntry]:
        """List lab-memory entries, newest first (of one study's, by name, when given)."""
        params = {"study": study} if study else {}
        return cast(list[models.MemoryEntry], self._get("/memory", **params))

    def forget(self, entry_id: int) -> None:
        """Delete one lab-memory entry."""
        self._call("DELETE", f"/memory/{entry_id}")

    def report(self, study_id: int) -> str:
        """Return REPORT.md."""
        return self._call("GET", f"/studies/{study_id}/report").text

    def progress(self, study_id: int) -> models.Progress:
        """Return the per-experiment dev scores and trunk's scores over time."""
        return cast(models.Progress, self._get(f"/studies/{study_id}/progress"))

    def tree(self, study_id: int) -> models.Tree:
        """Return the tree: every node's summary."""
        return cast(models.Tree, self._get(f"/studies/{study_id}/tree"))

    def node(self, study_id: int, node_id: int) -> models.NodeDetail:
        """Return a node with its evidence."""
        return cast(models.NodeDetail, self._get(f"/studies/{study_id}/nodes/{node_id}"))

    def curves(self, study_id: int, node_id: int) -> dict[str, Any]:
        """Return the per-step records each dev run of a node printed (`{"step": ..., ...}` lines)."""
        return cast(dict[str, Any], self._get(f"/studies/{study_id}/nodes/{node_id}/curves"))

    def receipt_output(self, study_id: int, receipt_id: int, stream: str = "stdout") -> str:
        """Return a receipt's full stored output."""
        return self._call(
            "GET", f"/studies/{study_id}/receipts/{receipt_id}/output", params={"stream": stream}
        ).text

    def events(self, study_id: int, after: int = 0, tail: int | None = None) -> list[models.Event]:
        """Return events after an id (or only the newest `tail`), oldest first."""
        path = f"/studies/{study_id}/events/log"
        return cast(list[models.Event], self._get(path, after=after, limit=1000, tail=tail))

    def add_hypothesis(self, study_id: int, node_id: int, body: dict[str, Any]) -> models.NodeSummary:
        """Add a human hypothesis under a node."""
        return cast(models.NodeSummary, self._post(f"/studies/{study_id}/nodes/{node_id}/hypotheses", body))

    def prune(self, study_id: int, node_id: int, reason: str = "") -> str:
        """Prune a node and its subtree."""
        return str(self._post(f"/studies/{study_id}/nodes/{node_id}/prune", {"reason": reason})["message"])

    def approvals(self, study_id: int | None = None, state: str = "pending") -> list[models.Approval]:
        """Return approvals (pending by default)."""
        page = self._get("/approvals", study_id=study_id, state=state, limit=200)
        return cast(list[models.Approval], page["data"])

    def live(self, study_id: int, node_id: int, stream: str = "stdout") -> dict[str, Any]:
        """Return the tail of a node's newest output (while it runs, and after)."""
        return cast(dict[str, Any], self._get(f"/studies/{study_id}/nodes/{node_id}/live", stream=stream))

    def approvals_waiting(self) -> int:
        """Return how many approvals are pending across every study."""
        return int(self._get("/approvals", state="pending", limit=1)["count"])

    def approve(self, study_id: int, node_id: int) -> models.Approval:
        """Approve a gate-passed node."""
        return cast(models.Approval, self._post(f"/studies/{study_id}/nodes/{node_id}/approve"))

    def reject(self, study_id: int, node_id: int, reason: str) -> models.Approval:
        """Reject a gate-passed node with a reason."""
        return cast(
            models.Approval, self._post(f"/studies/{study_id}/nodes/{node_id}/reject", {"reason": reason})
        )

    def learn(self, kind: str, params: dict[str, Any], study_id: int | None = None) -> models.LearningJob:
        """Queue a learning job on the gpu queue."""
        body = {"kind": kind, "params": params, "study_id": study_id}
        return cast(models.LearningJob, self._post("/learning/jobs", body))

    def learning_job(self, job_id: int) -> models.LearningJob:
        """Return a learning job with its events."""
        return cast(models.LearningJob, self._get(f"/learning/jobs/{job_id}"))
