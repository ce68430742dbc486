"""Learning-module jobs on the `gpu` queue: self-distillation of a causal LM, sparse-attention evaluation.

Each job is a `learning_job` row with `learning_event` rows for its progress, and a result artifact
folder under the data directory of the machine that ran it (the row's `host`). A job reads and
writes its records through a `LearningStore`: the database beside it (`DbLearningStore`), or the
API from a worker on another machine (`backend.worker.remote.ApiLearningStore`), which presents
the job's token. torch and transformers are imported inside the job, never at module import, so a
worker's parent process never initialises CUDA before it forks.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError
from sqlmodel import Session, col, delete, func, select

from agents.learning.options import Method, Teacher
from backend.core import db
from backend.core.config import Settings
from backend.core.models import LearningEvent, LearningJob, Trajectory, now
from backend.core.states import JobStatus
from backend.engine import jobstore
from backend.engine.checker import Checker, TaskError, load_tasks
from backend.engine.jobstore import Refused, Superseded, Unreachable
from backend.engine.learning_params import PARAMS, PATHS, SparseTrainParams, describe, distill_problem
from backend.engine.learning_params import DistillParams as DistillParams
from backend.engine.learning_params import LearningJobError as LearningJobError
from backend.engine.learning_params import SparseEvalParams as SparseEvalParams
from backend.services.folders import check_local_path
from backend.services.studies import SourceRefused
from backend.services.trajectories import export_records


def submit(
    s: Session,
    kind: str,
    params: dict[str, Any],
    study_id: int | None = None,
    settings: Settings | None = None,
    token: str = "",
) -> LearningJob:
    """Check the parameters and record a queued job (the caller sends the task, with `token`).

    The job keeps the token's hash only; without one it gets a token nobody knows (a worker beside
    the database needs none).

    With the server's `settings` (a job asked for over the API), the files it names must lie where
    a repository path over the API may (`GROVE_REPO_ROOTS`, outside Grove's own folders); they
    are checked before anything looks at them.
    """
    if kind not in PARAMS:
        raise LearningJobError("kind", f"{kind!r} is not one of {', '.join(PARAMS)}")
    try:
        checked = PARAMS[kind].model_validate(params)
    except ValidationError as exc:
        raise describe(kind, exc.errors()[0]) from None
    if isinstance(checked, DistillParams):
        problem = distill_problem(checked)
        if problem is not None:
            raise problem
        if settings is not None:
            for name in PATHS:
                path = getattr(checked, name)
                if path or name == "model":
                    try:
                        check_local_path(settings, path, f"params.{name}")
                    except SourceRefused as exc:
                        raise LearningJobError(exc.key, exc.detail) from None
        if not (Path(checked.model) / "config.json").is_file():
            raise LearningJobError(
                "params.model", f"{checked.model!r} is not a local Hugging Face model folder"
            )
        if checked.trajectories and not Path(checked.trajectories).is_file():
            raise LearningJobError("params.trajectories", f"{checked.trajectories!r} does not exist")
        if checked.tasks:
            try:
                load_tasks(Path(checked.tasks))
            except (OSError, UnicodeDecodeError, TaskError) as exc:
                raise LearningJobError("params.tasks", f"{checked.tasks}: {exc}") from None
        elif not checked.trajectories and study_id is None:
            raise LearningJobError(
                "params.trajectories", "give a JSONL file, or a study whose trajectories to use"
            )
        if checked.method == Method.CANON and not checked.on_policy:
            if checked.trajectories:
                groups = _by_prompt(_read_jsonl(Path(checked.trajectories), "trajectories"))
            else:
                rows = s.exec(select(Trajectory.messages).where(Trajectory.study_id == study_id))
                groups = _by_prompt([{"prompt": messages[:2]} for messages in rows])
            if not any(len(g) > 1 for g in groups):
                raise LearningJobError(
                    "params.method",
                    "CANON needs several rollouts of the same prompt, and every record's "
                    "prompt is different (sample them: on_policy = true)",
                )
    token = token or secrets.token_hex(16)
    job = LearningJob(
        study_id=study_id, kind=kind, params=checked.model_dump(), token=jobstore.token_hash(token)
    )
    s.add(job)
    s.flush()
    s.add(LearningEvent(job_id=job.id or 0, type="learning.queued", payload={"kind": kind}))
    s.refresh(job)
    return job


def events(s: Session, job_id: int) -> list[LearningEvent]:
    """Return a job's events, oldest first."""
    return list(
        s.exec(select(LearningEvent).where(LearningEvent.job_id == job_id).order_by(col(LearningEvent.id)))
    )


class LearningStore(Protocol):
    """Where a running learning job reads its inputs and writes its progress and end."""

    def claim(self, host: str, pid: int) -> LearningJob | None:
        """Mark the job running on this machine and return it; an ended job is returned as it is."""
        ...

    def progress(self, fraction: float, payload: dict[str, Any]) -> None:
        """Record how far the job is (a `learning.progress` event)."""
        ...

    def fail(self, reason: str) -> None:
        """End the job as failed with the reason."""
        ...

    def finish(self, result: dict[str, Any], artifact: str) -> None:
        """End the job as done with its result and where its artifact lies on its host."""
        ...

    def records(self) -> list[dict[str, Any]]:
        """Return the job's study's executor records (`grove export-trajectories`), oldest first."""
        ...


class DbLearningStore:
    """A learning job's records in the database (a worker beside it)."""

    def __init__(self, settings: Settings, job_id: int) -> None:
        self.settings, self.job_id = settings, job_id

    def claim(self, host: str, pid: int) -> LearningJob | None:
        """Mark the job running on this machine and return it; an ended job is returned as it is."""
        return claim(self.settings, self.job_id, host, pid)

    def progress(self, fraction: float, payload: dict[str, Any]) -> None:
        """Record how far the job is (a `learning.progress` event)."""
        progress(self.settings, self.job_id, fraction, finite(payload))

    def fail(self, reason: str) -> None:
        """End the job as failed with the reason."""
        fail(self.settings, self.job_id, reason)

    def finish(self, result: dict[str, Any], artifact: str) -> None:
        """End the job as done with its result and where its artifact lies on its host."""
        finish(self.settings, self.job_id, finite(result), artifact)

    def records(self) -> list[dict[str, Any]]:
        """Return the job's study's executor records, oldest first (none for a job without a study)."""
        with db.session(self.settings.db_url) as s:
            job = s.get(LearningJob, self.job_id)
            study_id = job.study_id if job is not None else None
        return export_records(self.settings, study_id) if study_id is not None else []


def claim(
    settings: Settings, job_id: int, host: str, pid: int, token: str | None = None
) -> LearningJob | None:
    """Mark a queued (or re-delivered running) job running on `host`; None if there is none (or not this token).

    A job that has ended is returned unchanged: its task was delivered again, nothing runs.
    """
    with db.session(settings.db_url) as s:
        job = s.get(LearningJob, job_id)
        if job is None or (token is not None and not jobstore.same_token(job.token, token)):
            return None
        if job.status not in (JobStatus.DONE, JobStatus.FAILED):
            job.status, job.started_at, job.host = "running", now(), host[:255]
            s.add(job)
            s.add(
                LearningEvent(
                    job_id=job_id, type="learning.started", payload={"pid": pid, "host": host[:255]}
                )
            )
            s.flush()
            s.refresh(job)
        s.expunge(job)
        return job


def progress(
    settings: Settings, job_id: int, fraction: float, payload: dict[str, Any], token: str | None = None
) -> None:
    """Record a running job's progress (a fraction from 0 to 1) with what the step reports."""
    _record(
        settings, job_id, "learning.progress", {**payload, "progress": fraction}, token, progress=fraction
    )


def finish(
    settings: Settings, job_id: int, result: dict[str, Any], artifact: str, token: str | None = None
) -> None:
    """End a job as done with its result and its artifact's folder (on the job's host)."""
    _record(
        settings, job_id, "learning.finished", {**result, "artifact": artifact}, token, status="done",
        progress=1.0, device=str(result.get("device", ""))[:64], artifact=artifact, result=result,
        finished_at=now(),
    )  # fmt: skip


def _device(wanted: str) -> str:
    import torch

    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return wanted


def _record(
    settings: Settings,
    job_id: int,
    event: str,
    payload: dict[str, Any],
    token: str | None = None,
    **fields: Any,
) -> None:
    """Change the job's row and append its event in one transaction (only while `token` holds it, if given)."""
    with db.session(settings.db_url) as s:
        job = s.get(LearningJob, job_id)
        if token is not None and (job is None or not holds(job, token)):
            raise Superseded(f"learning job {job_id} is not running under this token")
        assert job is not None
        for k, v in fields.items():
            setattr(job, k, v)
        s.add(job)
        if event == "learning.progress":
            _thin_progress(s, job_id)
        s.add(LearningEvent(job_id=job_id, type=event, payload=payload))


PROGRESS_EVENTS = 512  # the progress history a job keeps at most (the job's row holds the latest)


def _thin_progress(s: Session, job_id: int) -> None:
    """Before one more progress event: at PROGRESS_EVENTS, drop every other one, keeping the first and the last.

    A job of 100,000 steps then keeps its whole curve, denser toward the present, in a bounded
    number of rows; a worker cannot fill the database, nor make the job's page unreadably long.
    """
    progress = (LearningEvent.job_id == job_id, LearningEvent.type == "learning.progress")
    if s.exec(select(func.count()).select_from(LearningEvent).where(*progress)).one() < PROGRESS_EVENTS:
        return
    ids = s.exec(select(LearningEvent.id).where(*progress).order_by(col(LearningEvent.id))).all()
    s.exec(delete(LearningEvent).where(col(LearningEvent.id).in_(ids[1:-1:2])))


def fail(settings: Settings, job_id: int, reason: str, token: str | None = None) -> None:
    """End a job as failed, with the reason on its row and its `learning.failed` event."""
    message = reason[:4000]
    _record(
        settings, job_id, "learning.failed", {"error": message}, token, status="failed", error=message,
        finished_at=now(),
    )  # fmt: skip


def holds(job: LearningJob, token: str) -> bool:
    """Return whether a worker presenting `token` runs this job now."""
    return job.status == JobStatus.RUNNING and jobstore.same_token(job.token, token)


def finite(value: Any) -> Any:
    """Return `value` with every NaN or infinite float made None (JSON has none; a diverged loss does)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def held(settings: Settings, job_id: int, token: str) -> LearningJob | None:
    """Return the job if it is running under `token`, else None."""
    with db.session(settings.db_url) as s:
        job = s.get(LearningJob, job_id)
        return job if job is not None and holds(job, token) else None


def _read_jsonl(path: Path, field: str) -> list[dict[str, Any]]:
    """Return a JSONL file's records; raise LearningJobError naming `field` and the line if it has none."""
    try:
        lines = path.read_text("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise LearningJobError(f"params.{field}", f"{path}: cannot be read as UTF-8 text ({exc})") from None
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:  # JSON's own errors, and a number past the int-string limit
            raise LearningJobError(f"params.{field}", f"{path}: line {n} is not JSON ({exc})") from None
        if not isinstance(record, dict):
            raise LearningJobError(f"params.{field}", f"{path}: line {n} is not a JSON object")
        records.append(record)
    return records


def _by_prompt(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Group records by their prompt, in first-seen order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(json.dumps(r.get("prompt"), sort_keys=True), []).append(r)
    return list(groups.values())


def _records(store: LearningStore, path: str) -> list[dict[str, Any]]:
    return _read_jsonl(Path(path), "trajectories") if path else store.records()


def _distill(settings: Settings, store: LearningStore, job: LearningJob, out: Path) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agents.learning.distillation import DistillConfig
    from agents.learning.distillation.sdpo import SdpoConfig, SelfDistiller, canon_records

    p = DistillParams.model_validate(job.params)
    _files_here(p)
    device = _device(p.device)
    tokenizer = AutoTokenizer.from_pretrained(p.model, local_files_only=True)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(p.model, local_files_only=True, dtype=dtype)
    model = model.to(device)  # type: ignore[arg-type]  # transformers types `to` as a wrapped method
    cfg = SdpoConfig(
        mode=p.method, teacher=p.teacher or (Teacher.FROZEN if p.method == Method.CANON else Teacher.EMA), rate=p.rate,
        max_tokens=p.max_tokens, opsa_weight=p.opsa_weight if p.opsa else 0.0, opsa_fraction=p.opsa_fraction,
        opsa_a_min=p.opsa_a_min, opsa_a_max=p.opsa_a_max,
        distill=DistillConfig(beta=p.beta, support=p.support, topk=p.topk, is_clip=p.is_clip,
                              temperature=p.temperature),
    )  # fmt: skip
    distiller = SelfDistiller(model, tokenizer, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr)
    started = time.monotonic()
    if p.on_policy:
        history, result = _on_policy(settings, store, p, distiller, opt)
    else:
        records = [r for r in _records(store, p.trajectories) if r.get("rollout") and r.get("prompt")]
        if p.method == Method.CANON:
            groups = [g for g in _by_prompt(records) if len(g) > 1]
            if not groups:
                raise LearningJobError("params.method", "CANON needs several rollouts of the same prompt")
            records = canon_records(groups)
        if not records:
            raise LearningJobError("params.trajectories", "no record has both a prompt and a rollout")
        history = []
        steps, size = p.steps, p.batch_size
        for step in range(steps):
            batch = [records[(step * size + i) % len(records)] for i in range(min(size, len(records)))]
            diag = distiller.step(batch, opt)
            history.append({"step": step + 1, **diag})
            store.progress((step + 1) / steps, {"step": step + 1, "loss": diag["loss"]})
        result = {"records": len(records), "steps": steps, "first_loss": history[0]["loss"],
                  "last_loss": history[-1]["loss"]}  # fmt: skip
    result = {"device": device, **result, "seconds": time.monotonic() - started}
    (out / "history.json").write_text(json.dumps(history, indent=1))
    if p.save_model:
        model.save_pretrained(out / "model")
        tokenizer.save_pretrained(out / "model")
    return result


def _files_here(p: DistillParams) -> None:
    """Raise, naming the field, if a file the job names is missing on this machine (not the one it was checked on)."""
    where = jobstore.host()[0]
    if not (Path(p.model) / "config.json").is_file():
        raise LearningJobError(
            "params.model", f"{p.model!r} is not a local Hugging Face model folder on {where}"
        )
    for name in ("trajectories", "tasks"):
        path = getattr(p, name)
        if path and not Path(path).is_file():
            raise LearningJobError(f"params.{name}", f"{path!r} does not exist on {where}")


def _on_policy(
    settings: Settings, store: LearningStore, p: DistillParams, distiller: Any, opt: Any
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the on-policy rounds; return the history (one row per round) and the result."""
    from agents.learning.distillation.online import Prompt, run_round, without_dropout
    from agents.learning.distillation.sdpo import as_text

    without_dropout(distiller.student)
    if p.tasks:
        prompts = [
            Prompt(t["prompt"], check=Checker(settings, t, p.check_timeout))
            for t in load_tasks(Path(p.tasks))
        ]
    else:
        prompts = [
            Prompt(as_text(g[0]["prompt"]), feedback=str(g[-1].get("feedback", "")))
            for g in _by_prompt([r for r in _records(store, p.trajectories) if r.get("prompt")])
        ]
    if not prompts:
        raise LearningJobError("params.trajectories", "no record has a prompt")
    history = []
    for n in range(1, p.rounds + 1):
        row = run_round(distiller, opt, prompts, samples=p.samples, steps=p.steps, batch_size=p.batch_size,
                        max_new_tokens=p.max_new_tokens, temperature=p.temperature)  # fmt: skip
        history.append({"round": n, **row})
        store.progress(n / p.rounds, {
            "round": n, "loss": row["loss"], "pass_rate": row["pass_rate"],
            "divergence_before": row["divergence_before"], "divergence_after": row["divergence_after"],
        })  # fmt: skip
    result = {
        "prompts": len(prompts),
        "rounds": p.rounds,
        "pass_rate": [h["pass_rate"] for h in history],
        "divergence_before": [h["divergence_before"] for h in history],
        "divergence_after": [h["divergence_after"] for h in history],
        "first_loss": history[0]["loss"],
        "last_loss": history[-1]["loss"],
    }
    return history, result


def _sparse_train(settings: Settings, store: LearningStore, job: LearningJob, out: Path) -> dict[str, Any]:
    import torch

    from agents.learning.sparse_attention.needle import train_router

    p = SparseTrainParams.model_validate(job.params)
    device = _device(p.device)
    every = max(1, p.steps // 10)
    history: list[dict[str, float]] = []

    def on_step(step: int, loss: float) -> None:
        history.append({"step": step, "loss": loss})
        if step % every == 0 or step == p.steps:
            store.progress(step / p.steps, {"step": step, "loss": loss})

    trained = train_router({**p.model_dump(), "tied": False}, device, on_step)
    model = trained.pop("model")
    (out / "history.json").write_text(json.dumps(history, indent=1))
    if p.save_model:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, out / "layer.pt")
    return {"device": device, **trained}


def _sparse_eval(settings: Settings, store: LearningStore, job: LearningJob, out: Path) -> dict[str, Any]:
    from agents.learning.sparse_attention.needle import needle_recall

    p = SparseEvalParams.model_validate(job.params)
    device = _device(p.device)
    result = needle_recall(
        p.model_dump(),
        device,
        lambda n: store.progress(n / p.trials, {"trial": n}) if n % 8 == 0 else None,
    )
    result["device"] = device
    return result


def run(settings: Settings, job_id: int, store: LearningStore | None = None) -> str:
    """Run a queued learning job to its end; return its final status (a finished job is left alone).

    Its records go through `store` (the database by default); its artifact folder is made under
    this machine's data directory.
    """
    store = store or DbLearningStore(settings, job_id)
    job = store.claim(*jobstore.host())
    if job is None:
        return "unknown job"
    if job.status in (JobStatus.DONE, JobStatus.FAILED):
        return job.status
    out = settings.data_dir / "learning" / f"job-{job_id}"
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = {"distill": _distill, "sparse_eval": _sparse_eval, "sparse_train": _sparse_train}[job.kind](
            settings, store, job, out
        )
    except (Unreachable, Superseded):
        raise  # the API is out of reach (the job runs again), or the job is not this worker's any more
    except Exception as exc:  # the job's failure is recorded, never lost
        store.fail(f"{type(exc).__name__}: {exc}")
        return "failed"
    result = finite(result)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    try:
        store.finish(result, str(out))
    except Refused as exc:  # a result the server will not keep (too large): the job still ends
        store.fail(f"its result was refused: {exc}")
        return "failed"
    return "done"
