"""A worker on another machine: records and repository through the API, nothing shared on disk.

Started with `GROVE_API_URL`, `GROVE_WORKER_TOKEN` (a token with the `worker` role) and
`GROVE_REDIS_URL` only. It fetches a study's repository by git over HTTP from the API into its
own data directory, runs the job there, and hands back through the API what the job made: its
records (`ApiStore`, the same calls `DbStore` makes), receipts' full outputs, and its commits as
a git bundle.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx

from backend.core.config import Settings
from backend.core.gitops import GitError, Repo, git, git_env, run_captured
from backend.core.models import Job, LearningJob, Node, Study
from backend.engine import jobstore, learning
from backend.engine.jobstore import JobStore, Refused, Superseded, Unreachable

WORKER_PREFIX = "/api/v1/worker"
logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per call would drown the worker's log


class RemoteError(Unreachable):
    """The API refused or failed a worker's call, or could not be reached (the message says which)."""


class Api:
    """The API's worker endpoints, with the worker's token."""

    def __init__(self, settings: Settings) -> None:
        if not settings.api_url or not settings.worker_token:
            raise RemoteError("a remote worker needs GROVE_API_URL and GROVE_WORKER_TOKEN")
        # The same GROVE_API_URL as the CLI's and the dashboard's (".../api/v1") is accepted too.
        self.base = settings.api_url.rstrip("/").removesuffix("/api/v1")
        self.token = settings.worker_token
        self.http = httpx.Client(
            base_url=self.base + WORKER_PREFIX,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=httpx.Timeout(300.0, connect=30.0),
        )

    def ping(self) -> str:
        """Check the API's URL and the worker token; return the token's name or raise RemoteError."""
        try:
            r = self.http.get("/ping", timeout=10)
        except httpx.HTTPError as exc:
            raise RemoteError(f"cannot reach the API at {self.base}: {exc}") from None
        if r.status_code in (401, 403):
            raise RemoteError(f"the API at {self.base} refused GROVE_WORKER_TOKEN: {_detail(r)}")
        return str(self._answer(r)["worker"])

    def ping_roles(self) -> tuple[str, bool]:
        """Return the token's name and whether it may take sealed jobs (raise RemoteError if refused)."""
        self.ping()
        got = self._answer(self.http.get("/ping", timeout=10))
        return str(got["worker"]), bool(got.get("sealed"))

    def post(self, path: str, **kwargs: Any) -> Any:
        """POST to a worker endpoint; map 409 to Superseded and other refusals to RemoteError."""
        return self._send("POST", path, **kwargs)

    def put(self, path: str, **kwargs: Any) -> Any:
        """PUT to a worker endpoint."""
        return self._send("PUT", path, **kwargs)

    def _send(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            r = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise RemoteError(f"{method} {path}: cannot reach the API at {self.base}: {exc}") from None
        return self._answer(r)

    @staticmethod
    def _answer(r: httpx.Response) -> Any:
        if r.status_code == 409:
            raise Superseded(_detail(r))
        if r.status_code == 422:
            raise Refused(_detail(r))
        if r.status_code >= 400:
            raise RemoteError(f"{r.request.method} {r.request.url.path}: {r.status_code} {_detail(r)}")
        return r.json()

    def git(self, *args: str, cwd: Path, job: tuple[int, str]) -> str:
        """Run git for a job with the worker's and the job's tokens sent to the API (in git's environment)."""
        # Grove's git allows only https and ssh remotes; the API on a private network may be plain http.
        env = git_env(
            (
                ("http.extraHeader", f"Authorization: Bearer {self.token}"),
                ("http.extraHeader", f"X-Grove-Job: {job[0]}:{job[1]}"),
                ("protocol.http.allow", "always"),
            )
        )
        env["GIT_TERMINAL_PROMPT"] = "0"
        proc = run_captured(["git", *args], cwd=cwd, env=env, timeout=600)
        if proc.returncode != 0:
            raise GitError(list(args), proc.returncode, proc.stderr)
        return proc.stdout


def _detail(r: httpx.Response) -> str:
    try:
        detail = r.json().get("detail", r.text)
    except ValueError:
        return r.text[:500]
    return str(detail.get("message", detail) if isinstance(detail, dict) else detail)


_SITES: dict[tuple[str, str], RemoteSite] = {}


def site(settings: Settings) -> RemoteSite:
    """Return this process's remote site for these settings (one HTTP client, reused by every task)."""
    key = (settings.api_url or "", settings.worker_token or "")
    if key not in _SITES:
        _SITES[key] = RemoteSite(settings)
    return _SITES[key]


class RemoteSite:
    """Runs jobs with a local mirror of each study's repository and the API for every record."""

    def __init__(self, settings: Settings) -> None:
        if "worktrees_dir" not in settings.model_fields_set:
            settings = settings.model_copy(update={"worktrees_dir": settings.data_dir / "worktrees"})
        self.settings = settings
        self.api = Api(settings)
        for d in (settings.data_dir / "repos", settings.worktrees_dir):
            d.mkdir(parents=True, exist_ok=True)

    def claim_experiment(self, job_id: int, token: str) -> tuple[Job, Node, Study, JobStore]:
        """Mark an experiment running and return its rows and store; raise Superseded if not ours."""
        name, pid = jobstore.host()
        got = self.api.post(f"/jobs/{job_id}/claim", json={"token": token, "host": name, "pid": pid})
        job, node, study = Job(**got["job"]), Node(**got["node"]), Study(**got["study"])
        return job, node, study, ApiStore(self, job_id, token, study)

    def claim_sealed(self, job_id: int, token: str) -> tuple[Job, JobStore] | None:
        """Mark a sealed job running (one more try) and return it with its store; None if not ours."""
        try:
            got = self.api.post(f"/jobs/{job_id}/claim-sealed", json={"token": token})
        except Superseded:
            return None
        job, study = Job(**got["job"]), Study(**got["study"])
        return job, ApiStore(self, job_id, token, study)

    def repo(self, study: Study, job_id: int, token: str, sealed: bool = False) -> Repo:
        """Return this worker's mirror of the study's repository, fetched up to date for the job.

        A sealed job also fetches the repository's base that holds the sealed files.
        """
        path = (self.settings.data_dir / "repos" / study.name).resolve()
        if not (path / ".git").exists():
            path.mkdir(parents=True, exist_ok=True)
            git("init", "-q", str(path))
        repo = Repo(path)
        with repo.lock():
            self.api.git(
                "fetch", "--quiet", "--no-tags", "--prune", f"{self.api.base}{WORKER_PREFIX}/git/{study.id}",
                f"+refs/heads/grove/{study.name}/*:refs/remotes/grove/*",
                *([f"+refs/grove/sealed/{study.name}:refs/grove/sealed/{study.name}"] if sealed and study.sealed_commit else []),
                cwd=path, job=(job_id, token),
            )  # fmt: skip
        return repo

    def forget_ended(self, names: list[str] | None = None) -> list[Path]:
        """Remove this machine's copies (repository, worktrees, outputs, environments) of studies that ended."""
        data = self.settings.data_dir
        places = [data / "repos", self.settings.worktrees_dir, data / "outputs", data / "envs"]
        held = sorted(
            {p.name for d in places if d.is_dir() for p in d.iterdir()} if names is None else set(names)
        )
        if not held:
            return []
        ended = self.api.post("/studies/ended", json={"names": held})["ended"]
        removed = []
        for name in ended:
            for d in places:
                path = d / name
                if path.is_relative_to(d) and path.parent == d and (path.exists() or path.is_symlink()):
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)
                    removed.append(path)
        return removed

    def crash(self, job_id: int, token: str, reason: str) -> None:
        """Fail an experiment whose run ended without finishing (killed, out of time)."""
        with contextlib.suppress(Superseded):
            self.api.post(f"/jobs/{job_id}/call/crash", json={"token": token, "args": {"reason": reason}})


class ApiStore:
    """A `JobStore` whose calls the API runs on the database, scoped to the job that claimed it."""

    def __init__(self, site: RemoteSite, job_id: int, token: str, study: Study) -> None:
        self.site, self.api, self.job_id, self.token = site, site.api, job_id, token
        self.outputs = (site.settings.data_dir / "outputs" / study.name).resolve()

    def _call(self, name: str, **args: Any) -> Any:
        return self.api.post(f"/jobs/{self.job_id}/call/{name}", json={"token": self.token, "args": args})

    def study(self) -> Study:
        """Return the study as it is now."""
        return Study(**self._call("study"))

    def node(self, node_id: int) -> Node:
        """Return one of the study's nodes as it is now."""
        return Node(**self._call("node", node_id=node_id))

    def event(self, kind: str, node_id: int | None, payload: dict[str, Any]) -> None:
        """Append an event of the study."""
        self._call("event", kind=kind, node_id=node_id, payload=payload)

    def finish(self, status: str, extra_runs: int, fields: dict[str, Any]) -> None:
        """End the experiment job with its node's new status and fields."""
        self._call("finish", status=status, extra_runs=extra_runs, fields=fields)

    def crash(self, reason: str) -> None:
        """Mark the experiment failed because its run died."""
        self._call("crash", reason=reason)

    def finish_sealed(self, status: str, outcome: dict[str, Any]) -> str:
        """Record the sealed job's end; 'superseded' if someone else ended it."""
        try:
            return str(self._call("finish_sealed", status=status, outcome=outcome))
        except Superseded:
            return "superseded"

    def gate_crashed(self, reason: str) -> None:
        """Fail the gate of the job's node."""
        self._call("gate_crashed", reason=reason)

    def insights(self) -> list[str]:
        """Return the newest insight of each ancestor of the job's node."""
        return list(self._call("insights"))

    def reflections(self) -> list[str]:
        """Return the reflections of failed attempts on related nodes."""
        return list(self._call("reflections"))

    def save_trajectory(self, trajectory: dict[str, Any]) -> None:
        """Keep the executor's transcript of this attempt."""
        self._call("save_trajectory", trajectory=trajectory)

    def relabel(self, old: str, new: str) -> None:
        """Give the job's node the title of its real diff."""
        self._call("relabel", old=old, new=new)

    def add_receipts(self, node_id: int | None, receipts: list[dict[str, Any]]) -> None:
        """Upload each receipt's full output, then store the receipts with where the API keeps it."""
        rows = []
        for r in receipts:
            row = dict(r)
            for key in ("stdout_path", "stderr_path"):
                row[key] = self._upload(Path(r[key])) if r.get(key) else ""
            rows.append(row)
        self._call("add_receipts", node_id=node_id, receipts=rows)

    def _upload(self, path: Path) -> str:
        """Send one output file (up to the output cap) and return the API's path for it."""
        try:
            rel = path.resolve().relative_to(self.outputs)
            data = path.read_bytes()[: self.site.settings.output_cap_bytes]
        except (ValueError, OSError):
            return ""
        got = self.api.put(
            f"/jobs/{self.job_id}/outputs/{rel.as_posix()}", params={"token": self.token}, content=data
        )
        return str(got["path"])

    def not_worth_it(self, mean: float, spent: int, more: int) -> str:
        """Return why more dev seeds are not worth running now, or ''."""
        return str(self._call("not_worth_it", mean=mean, spent=spent, more=more))

    def keep_trunk_dev(self, base_commit: str, have: int, values: list[float]) -> None:
        """Keep trunk's extra dev values."""
        self._call("keep_trunk_dev", base_commit=base_commit, have=have, values=values)

    def claim_trunk_seeds(self, base_commit: str, upto: int) -> bool:
        """Claim the running of trunk's dev seeds up to `upto`; False if a sibling has."""
        return bool(self._call("claim_trunk_seeds", base_commit=base_commit, upto=upto))

    def baseline_running(self) -> bool:
        """Return whether the study's baseline dev job is running now."""
        return bool(self._call("baseline_running"))

    def baseline_dev(self, values: list[float]) -> None:
        """Record the unchanged repository's dev values."""
        self._call("baseline_dev", values=values)

    def not_deterministic(self) -> None:
        """Record that two seeds of the job's node differ: the study's dev evaluation is noisy after all."""
        self._call("not_deterministic")

    def baseline_heldout(self, values: list[float]) -> None:
        """Record the unchanged repository's held-out values."""
        self._call("baseline_heldout", values=values)

    def test_query(self) -> None:
        """Count one query of the sealed split."""
        self._call("test_query")

    def verdict(
        self, passed: bool, reason: str, commit: str, values: list[float], gain: float | None
    ) -> None:
        """Record the gate verdict of the job's node."""
        self._call("verdict", passed=passed, reason=reason, commit=commit, values=values, gain=gain)

    def keep_trunk_heldout(self, trunk_commit: str, values: list[float]) -> None:
        """Keep trunk's longer held-out values."""
        self._call("keep_trunk_heldout", trunk_commit=trunk_commit, values=values)

    def llm_reserve(self, usd: float, tokens: int) -> dict[str, Any]:
        """Hold a call's worst case against the study's budgets."""
        return dict(self._call("llm_reserve", usd=usd, tokens=tokens))

    def llm_release(self, hold: int) -> None:
        """Drop a failed call's hold."""
        self._call("llm_release", hold=hold)

    def llm_record(self, call: dict[str, Any], hold: int | None = None) -> int:
        """Store one LLM call, charge it and drop its hold."""
        return int(self._call("llm_record", call=call, hold=hold))

    def mark_unsandboxed(self) -> None:
        """Record that the study's code ran without the sandbox."""
        self._call("mark_unsandboxed")

    def publish(self, repo: Repo, ref: str, commit: str) -> None:
        """Send the commits of `ref` that the API lacks as a bundle; it stores them under the same ref."""
        with tempfile.TemporaryDirectory(prefix="grove-bundle-") as tmp:
            bundle = Path(tmp) / "push.bundle"
            repo.git("bundle", "create", "-q", str(bundle), f"refs/heads/{ref}", "--not", "--remotes=grove")
            self.api.post(
                f"/jobs/{self.job_id}/publish",
                params={"token": self.token, "ref": ref, "commit": commit},
                content=bundle.read_bytes(),
            )


class ApiLearningStore:
    """A learning job's records through the API (`LearningStore`), with the job's token."""

    def __init__(self, site: RemoteSite, job_id: int, token: str) -> None:
        self.api, self.job_id, self.token = site.api, job_id, token

    def _call(self, name: str, **body: Any) -> Any:
        return self.api.post(f"/learning/{self.job_id}/{name}", json={"token": self.token, **body})

    def claim(self, host: str, pid: int) -> LearningJob | None:
        """Mark the job running on this machine and return it; an ended job is returned as it is."""
        got = self._call("claim", host=host, pid=pid)["job"]
        return LearningJob(id=got["id"], study_id=got["study_id"], kind=got["kind"], params=got["params"],
                           status=got["status"], host=got["host"])  # fmt: skip

    def progress(self, fraction: float, payload: dict[str, Any]) -> None:
        """Record how far the job is."""
        self._call("progress", fraction=fraction, payload=learning.finite(payload))

    def fail(self, reason: str) -> None:
        """End the job as failed with the reason."""
        self._call("fail", reason=reason[:4000])

    def finish(self, result: dict[str, Any], artifact: str) -> None:
        """End the job as done with its result and its artifact's folder on this machine."""
        self._call("finish", result=learning.finite(result), artifact=artifact)

    def records(self) -> list[dict[str, Any]]:
        """Return the job's study's executor records, oldest first."""
        return list(self._call("records"))
