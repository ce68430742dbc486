"""The worker data plane: claims, a job's record calls, its uploads, and git over HTTP.

Every route needs a token with the `worker` role; a job's calls also need the job's current
token (the task id Celery delivered), so a worker can touch only the study of a job it holds.
Fetching a study's repository needs one too, in the `X-Grove-Job: <job id>:<token>` header: a
worker token alone reads no repository.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, ValidationError, validate_call
from sqlmodel import col, select
from starlette.concurrency import run_in_threadpool

from agents import globs
from agents.tree.status import StudyStatus
from backend.api.deps import MAX_ID, SettingsDep, Worker
from backend.core import db, gitops
from backend.core.models import Node, Study
from backend.core.security import SEALED_ROLE
from backend.core.states import SEALED_KINDS, JobKind
from backend.engine import jobstore
from backend.engine.jobstore import CALLS, DbStore, Refused, Superseded
from backend.services.records import spec_of

router = APIRouter(prefix="/worker", tags=["worker"])
FINAL_STUDY = {StudyStatus.FINISHED, StudyStatus.FAILED}
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Claim(BaseModel):
    token: str
    host: str = ""
    pid: int = 0


class Call(BaseModel):
    token: str
    args: dict[str, Any] = {}


@dataclass(frozen=True)
class Held:
    id: int
    study_id: int
    node_id: int
    kind: str
    attempt: int
    node_branch: str

    def labels(self) -> set[str]:
        """Return the output folders this job's runs write (see `workspace.output_dir`)."""
        if self.kind == JobKind.EXPERIMENT:
            own = f"n{self.node_id}-a{self.attempt}"
            return {own, f"{own}-trunk"}
        if self.kind == JobKind.GATE:
            return {f"gate-n{self.node_id}", f"gate-n{self.node_id}-trunk"}
        return {"baseline-test"} if self.kind == JobKind.HELDOUT else {"baseline"}


def _dump(row: Any) -> dict[str, Any]:
    return dict(row.model_dump(mode="json"))


def _held(settings: Any, job_id: int, token: str) -> Held:
    job = jobstore.job_of(settings, job_id, token)
    if job is None:
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is not running under this token")
    with db.session(settings.db_url) as s:
        node = s.get(Node, job.node_id)
        return Held(
            job.id or 0, job.study_id, job.node_id, job.kind, job.attempt, node.branch if node else ""
        )


def _study(settings: Any, study_id: int) -> Study:
    with db.session(settings.db_url) as s:
        st = s.get(Study, study_id)
        if st is None or not st.repo_path:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"study {study_id} has no repository")
        s.expunge(st)
        return st


@router.get("/ping")
def ping(who: Worker) -> dict[str, Any]:
    """Answer a worker checking its URL and token before it takes jobs (and whether it may take sealed ones)."""
    return {"worker": who.name, "sealed": SEALED_ROLE in who.roles}


def _trusted(who: Any, kind: str) -> None:
    """Refuse a sealed job's work to a worker whose token is not trusted with held-out data."""
    if kind in SEALED_KINDS and SEALED_ROLE not in who.roles:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"a {kind} job reads held-out data: it needs a token with the sealed role",
        )


# What a job that is not sealed never reads: where the sealed files are (the repository's own
# commits, which name them) and every held-out number.
_STUDY_SEALED: dict[str, Any] = {
    "sealed_commit": "",
    "repository_key": "",
    "baseline_heldout": [],
    "trunk_heldout": [],
}
_NODE_SEALED: dict[str, Any] = {
    "heldout_values": [],
    "heldout_gain": None,
    "heldout_lcb": None,
    "heldout_level": None,
    "gate_reason": "",
    "gate_passed": False,
}


def _public(study: Study, kind: str) -> dict[str, Any]:
    """Return a study's row as a job of this kind may see it (sealed commits and held-out numbers only to sealed jobs)."""
    out = _dump(study)
    return out if kind in SEALED_KINDS else out | _STUDY_SEALED


def _public_node(node: Node, kind: str) -> dict[str, Any]:
    """Return a node's row as a job of this kind may see it (held-out numbers only to sealed jobs)."""
    out = _dump(node)
    return out if kind in SEALED_KINDS else out | _NODE_SEALED


class Names(BaseModel):
    names: list[str] = Field(max_length=1000)


@router.post("/studies/ended")
def ended(body: Names, settings: SettingsDep, who: Worker) -> dict[str, list[str]]:
    """Return which of these study names a worker may forget: ended (finished, failed) or unknown."""
    with db.session(settings.db_url) as s:
        live = {
            st.name
            for st in s.exec(select(Study).where(col(Study.name).in_(body.names)))
            if st.status not in FINAL_STUDY
        }
    return {"ended": sorted(set(body.names) - live)}


@router.post("/jobs/{job_id}/claim")
def claim(job_id: int, body: Claim, settings: SettingsDep, who: Worker) -> dict[str, Any]:
    """Mark an experiment job running for this worker and return its job, node and study."""
    try:
        job, node, study = jobstore.claim_experiment(settings, job_id, body.token, body.host[:200], body.pid)
    except Superseded as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
    return {"job": _dump(job), "node": _public_node(node, job.kind), "study": _public(study, job.kind)}


@router.post("/jobs/{job_id}/claim-sealed")
def claim_sealed(job_id: int, body: Claim, settings: SettingsDep, who: Worker) -> dict[str, Any]:
    """Mark a sealed (baseline, held-out baseline or gate) job running for this worker; count the try."""
    _trusted(who, "gate")
    job = jobstore.claim_sealed(settings, job_id, body.token)
    if job is None:
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is not ours to run")
    return {"job": _dump(job), "study": _dump(_study(settings, job.study_id))}


@router.post("/jobs/{job_id}/call/{name}")
def call(job_id: int, name: str, body: Call, settings: SettingsDep, who: Worker) -> Any:
    """Run one of a job's record calls (`JobStore`) on the database, scoped to the job's study."""
    job = _held(settings, job_id, body.token)
    _trusted(who, job.kind)
    if name not in CALLS.get(job.kind, frozenset()):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no worker call {name!r} for a {job.kind} job")
    study = _study(settings, job.study_id)
    args = _checked(settings, study, job, name, dict(body.args))
    store = DbStore(settings, job.study_id, job.node_id, job.id, body.token)
    try:
        out = validate_call(getattr(store, name))(**args)
    except ValidationError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"{name}: {exc}") from None
    except Refused as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from None
    except Superseded as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
    if isinstance(out, Study):
        return _public(out, job.kind)
    if isinstance(out, Node):
        return _public_node(out, job.kind)
    return out


def _checked(settings: Any, study: Study, job: Held, name: str, args: dict[str, Any]) -> dict[str, Any]:
    """Hold a remote job's call to what it can have made: its outputs, its own branch's commits."""
    repo = gitops.Repo(Path(study.repo_path))

    def tip(ref: str) -> str:
        try:
            return repo.rev(f"refs/heads/{ref}")
        except gitops.GitError:
            return ""

    if name == "add_receipts" and isinstance(args.get("receipts"), list):
        outputs = (settings.data_dir / "outputs" / study.name).resolve()
        for r in args["receipts"]:
            for key in ("stdout_path", "stderr_path"):
                if isinstance(r, dict) and not Path(str(r.get(key) or "/")).resolve().is_relative_to(outputs):
                    r[key] = ""
    commit = (
        args.get("fields", {}).get("commit")
        if name == "finish" and isinstance(args.get("fields"), dict)
        else None
    )
    if commit and commit != tip(job.node_branch):
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, f"commit {commit} is not the tip of {job.node_branch}"
        )
    gate_branch = f"grove/{study.name}/gate/n{job.node_id}"
    if name == "verdict" and args.get("commit") and args["commit"] != tip(gate_branch):
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, f"commit {args['commit']} is not the tip of {gate_branch}"
        )
    return args


@router.put("/jobs/{job_id}/outputs/{rel:path}")
async def upload_output(
    job_id: int,
    rel: str,
    request: Request,
    settings: SettingsDep,
    who: Worker,
    token: Annotated[str, Query()],
) -> dict[str, str]:
    """Store a full output of one of the job's runs under the API's data directory; return its path."""
    job = await run_in_threadpool(_held, settings, job_id, token)
    parts = rel.split("/")
    if not 2 <= len(parts) <= 3 or not all(_PART.match(p) and ".." not in p for p in parts):
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"output name {rel!r} is not allowed")
    if parts[0] not in job.labels():
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, f"job {job_id} does not write {parts[0]!r}"
        )
    study = await run_in_threadpool(_study, settings, job.study_id)
    base = (settings.data_dir / "outputs" / study.name).resolve()
    dest = base.joinpath(*parts)
    data = (await request.body())[: settings.output_cap_bytes]
    await run_in_threadpool(_write, dest, data)
    return {"path": str(dest)}


def _write(dest: Path, data: bytes) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, dest)


@router.post("/jobs/{job_id}/publish")
async def publish(
    job_id: int,
    request: Request,
    settings: SettingsDep,
    who: Worker,
    token: Annotated[str, Query()],
    ref: Annotated[str, Query()],
    commit: Annotated[str, Query(pattern="^[0-9a-f]{40}$")],
) -> dict[str, str]:
    """Take a job's commits as a git bundle into Grove's clone, under the job's own branch only."""
    job = await run_in_threadpool(_held, settings, job_id, token)
    _trusted(who, job.kind)
    study = await run_in_threadpool(_study, settings, job.study_id)
    allowed = {
        "gate": {f"grove/{study.name}/gate/n{job.node_id}"},
        "experiment": {job.node_branch} - {study.trunk_branch, ""},
    }.get(job.kind, set())  # a baseline makes no commit
    if ref not in allowed:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"job {job_id} may not publish {ref!r}")
    data = await request.body()
    await run_in_threadpool(_take_bundle, gitops.Repo(Path(study.repo_path)), data, study, ref, commit)
    return {"ref": ref, "commit": commit}


def _take_bundle(repo: gitops.Repo, data: bytes, study: Study, ref: str, commit: str) -> None:
    """Store a bundle's `ref` in the clone if it needs nothing but the study's own branches and itself.

    It is unpacked first into a scratch repository that holds only what the study's branches reach
    (what the job could fetch): a bundle that names, or deltas against, any other object of the
    clone (the repository's own base holding the sealed files, say) fails there, before the clone
    sees it. A bundle that carries the sealed base itself (a sealed job has it), or any blob of its
    sealed files, is refused: no branch of the study can come to lead to a sealed byte.
    """
    name, sealed = study.name, study.sealed_commit
    secret = _sealed_blobs(repo, study) if sealed else set()
    with tempfile.TemporaryDirectory(prefix="grove-bundle-") as tmp:
        bundle, scratch = Path(tmp) / "in.bundle", Path(tmp) / "scratch"
        bundle.write_bytes(data)
        try:
            gitops.git("init", "--quiet", str(scratch))
            gitops.git("fetch", "--quiet", "--no-tags", str(repo.path),
                       f"+refs/heads/grove/{name}/*:refs/heads/grove/{name}/*", cwd=scratch)  # fmt: skip
            gitops.git("bundle", "verify", "-q", str(bundle), cwd=scratch)
            heads = gitops.git("bundle", "list-heads", str(bundle), f"refs/heads/{ref}", cwd=scratch).split()
            if heads[:1] != [commit]:
                raise HTTPException(
                    status.HTTP_422_UNPROCESSABLE_CONTENT, f"the bundle's {ref} is not {commit}"
                )
            gitops.git(
                "fetch", "--quiet", "--no-tags", str(bundle), f"+refs/heads/{ref}:refs/incoming", cwd=scratch
            )
            if sealed and (_reaches(scratch, sealed) or secret & _new_objects(scratch)):
                raise HTTPException(
                    status.HTTP_422_UNPROCESSABLE_CONTENT,
                    f"the bundle's {ref} holds the repository's base or a blob of its sealed files",
                )
            with repo.lock():
                repo.git("fetch", "--quiet", "--no-tags", str(scratch), f"+refs/incoming:refs/heads/{ref}")
        except gitops.GitError as exc:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                f"bundle (it may need only commits of study {name}'s branches): {exc.stderr[:500]}",
            ) from None


def _sealed_blobs(repo: gitops.Repo, study: Study) -> set[str]:
    """Return the ids of the sealed files' blobs at the study's sealed base."""
    paths = globs.select(spec_of(study).files.sealed, repo.files_at(study.sealed_commit))
    if not paths:
        return set()
    listing = repo.git("ls-tree", "-r", "-z", study.sealed_commit, "--", *paths)
    empty = {
        hashlib.sha1(b"blob 0\0").hexdigest(),
        hashlib.sha256(b"blob 0\0").hexdigest(),
    }  # an empty file tells nothing
    return {entry.split()[2] for entry in listing.split("\0") if entry.count(" ") >= 2} - empty


def _new_objects(scratch: Path) -> set[str]:
    """Return the ids of the objects `refs/incoming` brings beyond the study's branches."""
    out = gitops.git("rev-list", "--objects", "refs/incoming", "--not", "--branches", cwd=scratch)
    return {line.split(" ", 1)[0] for line in out.splitlines() if line}


def _reaches(scratch: Path, sealed: str) -> bool:
    """Return whether `refs/incoming` in the scratch repository has the sealed base among its ancestors."""
    if gitops.run_git("cat-file", "-e", f"{sealed}^{{commit}}", cwd=scratch).returncode:
        return False  # not in the scratch repository at all, so no ancestor of what came in
    return gitops.run_git("merge-base", "--is-ancestor", sealed, "refs/incoming", cwd=scratch).returncode == 0


JOB_HEADER = "X-Grove-Job"


def _fetching_job(settings: Any, study_id: int, header: str) -> Held:
    """Return the running job of this study that the header names; 403 unless there is one."""
    job_id, _, token = header.partition(":")
    held = None
    if job_id.isascii() and job_id.isdecimal() and 0 < int(job_id) <= MAX_ID and token:
        with contextlib.suppress(HTTPException):
            held = _held(settings, int(job_id), token)
    if held is None or held.study_id != study_id:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"fetching study {study_id}'s repository needs a running job of that study "
            f"({JOB_HEADER}: <job id>:<its token>)",
        )
    return held


def _no_sealed_on_trunk(study: Study) -> None:
    """Refuse a study made before trunk left the sealed files out, if its base holds any, to a job that is not sealed."""
    repo = gitops.Repo(Path(study.repo_path))
    if study.base_commit and globs.select(spec_of(study).files.sealed, repo.files_at(study.base_commit)):
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"study {study.name!r} was made before trunk left its sealed files out: its history holds them, "
            "so only workers with the sealed role may fetch it (or run it on the API's own workers)",
        )


@router.api_route("/git/{study_id}/{path:path}", methods=["GET", "POST"], include_in_schema=False)
async def git_http(
    study_id: int, path: str, request: Request, settings: SettingsDep, who: Worker
) -> StreamingResponse:
    """Serve a study's repository read-only with git's smart HTTP backend (fetch only, never push)."""
    if study_id < 1 or study_id > MAX_ID:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "no such study")
    _plain_path(path, request.scope.get("raw_path", b""))
    _smart_fetch_only(path, request)
    held = await run_in_threadpool(_fetching_job, settings, study_id, request.headers.get(JOB_HEADER, ""))
    _trusted(who, held.kind)
    study = await run_in_threadpool(_study, settings, study_id)
    if held.kind not in SEALED_KINDS and not study.sealed_commit:
        await run_in_threadpool(_no_sealed_on_trunk, study)
    repo = Path(study.repo_path)
    # Only the study's own branches are served (trunk, nodes, gates: a history without sealed files);
    # the ref to its repository's base, which holds them, only to a sealed job. Protocol v0 (no
    # GIT_PROTOCOL passed on): it takes wants of advertised tips only, where v2 would serve any object.
    shown = [f"!refs/heads/grove/{study.name}/"] + (
        [f"!refs/grove/sealed/{study.name}"] if held.kind in SEALED_KINDS else []
    )
    hide = (
        ("uploadpack.hideRefs", "refs/"),
        ("uploadpack.hideRefs", "HEAD"),
        *(("uploadpack.hideRefs", r) for r in shown),
    )
    served = (("http.receivepack", "false"), ("http.getanyfile", "false"), ("uploadpack.allowFilter", "true"))
    env = gitops.git_env((*served, *hide))
    env.update(
        GIT_PROJECT_ROOT=str(repo.parent),
        GIT_HTTP_EXPORT_ALL="1",
        PATH_INFO=f"/{repo.name}/{path}",
        QUERY_STRING=request.url.query,
        REQUEST_METHOD=request.method,
        CONTENT_TYPE=request.headers.get("content-type", ""),
        REMOTE_USER=who.name,
        REMOTE_ADDR=request.client.host if request.client else "",
        HTTP_CONTENT_ENCODING=request.headers.get("content-encoding", ""),
    )
    body = await request.body()
    proc = await asyncio.create_subprocess_exec(
        "git", "http-backend", env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    stdin = proc.stdin

    async def feed() -> None:
        # The backend may answer (and exit) before it has read the whole request, e.g. on a bad one.
        with contextlib.suppress(ConnectionError):
            stdin.write(body)
            await stdin.drain()
            stdin.close()

    feeding = asyncio.create_task(feed())
    headers: dict[str, str] = {}
    code = 200
    while line := (await proc.stdout.readline()).rstrip(b"\r\n"):
        key, _, value = line.decode("latin-1").partition(":")
        if key.lower() == "status":
            code = int(value.strip().split()[0])
        else:
            headers[key.strip()] = value.strip()
    stdout = proc.stdout

    async def rest() -> AsyncIterator[bytes]:
        while chunk := await stdout.read(65536):
            yield chunk
        await feeding
        await proc.wait()

    media = headers.pop("Content-Type", None)
    return StreamingResponse(rest(), status_code=code, headers=headers, media_type=media)


def _smart_fetch_only(path: str, request: Request) -> None:
    """Refuse (403) anything but git's smart fetch: the ref advertisement and the upload-pack exchange.

    Git's older "dumb" protocol (`info/refs` without a service, `objects/info/packs`, packs and
    loose objects by name) would hand out every object of the clone, the sealed base's included:
    the ref hiding below applies to the smart protocol only.
    """
    query = request.url.query
    if request.method == "GET" and path == "info/refs" and query == "service=git-upload-pack":
        return
    if request.method == "POST" and path == "git-upload-pack" and not query:
        return
    raise HTTPException(
        status.HTTP_403_FORBIDDEN,
        "the study repository is served to workers only by git's smart fetch "
        "(GET info/refs?service=git-upload-pack, POST git-upload-pack)",
    )


GIT_SEGMENT = re.compile(r"[A-Za-z0-9_.-]+")  # what git's smart and dumb HTTP paths are made of


def _plain_path(path: str, raw: bytes) -> None:
    """Refuse (400) a repository path with `.` or `..` parts, empty (absolute) parts or any %-escape.

    The route decodes `%2F` into a slash, and `git http-backend` would then be given
    `<repo>/../<another study>/info/refs`: only plain names reach it.
    """
    parts = path.split("/")
    if b"%" in raw or not all(GIT_SEGMENT.fullmatch(p) and p not in (".", "..") for p in parts):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "not a path in a repository")
