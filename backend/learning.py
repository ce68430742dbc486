"""Learning-module jobs on the `gpu` queue: self-distillation of a causal LM, sparse-attention evaluation.

Each job is a `learning_job` row with `learning_event` rows for its progress and a result artifact
folder under the data directory. torch and transformers are imported inside the job, never at
module import, so a worker's parent process never initialises CUDA before it forks.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from sqlmodel import col, select

from backend import db
from backend.core.config import Settings
from backend.models import LearningEvent, LearningJob, now
from backend.trajectories import export_records

KINDS = ("distill", "sparse_eval")
DISTILL_DEFAULTS: dict[str, Any] = {
    "model": "",  # a local Hugging Face model folder (config, weights, tokenizer)
    "trajectories": "",  # a JSONL file from `grove export-trajectories`; empty: the study's own records
    "mode": "sdpo",
    "teacher": "ema",
    "rate": 0.05,
    "beta": 0.5,
    "support": "topk",
    "topk": 100,
    "steps": 20,
    "batch_size": 4,
    "lr": 1e-5,
    "max_tokens": 1024,
    "device": "auto",
    "save_model": True,
}
SPARSE_DEFAULTS: dict[str, Any] = {
    "docs": 64,
    "doc_len": 256,
    "top_k": 4,
    "pool": 64,
    "noise": 0.5,
    "topic": 0.0,
    "trials": 32,
    "ssmax": False,
    "seed": 0,
    "device": "auto",
}


class LearningJobError(ValueError):
    """A learning job was asked for with bad parameters (the message names the field)."""


def submit(settings: Settings, kind: str, params: dict[str, Any], study_id: int | None = None) -> LearningJob:
    """Check the parameters and record a queued job (the caller sends the task)."""
    if kind not in KINDS:
        raise LearningJobError(f"kind: {kind!r} is not one of {', '.join(KINDS)}")
    defaults = DISTILL_DEFAULTS if kind == "distill" else SPARSE_DEFAULTS
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise LearningJobError(
            f"params.{unknown[0]}: unknown for a {kind} job (known: {', '.join(defaults)})"
        )
    for key, value in params.items():
        want = type(defaults[key])
        ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise LearningJobError(f"params.{key}: expected {want.__name__}, got {value!r}")
    merged = {**defaults, **params}
    for key in ("steps", "batch_size", "max_tokens", "docs", "doc_len", "top_k", "pool", "trials", "topk"):
        if key in merged and not 1 <= merged[key] <= 1_000_000:
            raise LearningJobError(f"params.{key}: must be between 1 and 1000000")
    if kind == "distill":
        if not merged["model"] or not (Path(merged["model"]) / "config.json").is_file():
            raise LearningJobError(
                f"params.model: {merged['model']!r} is not a local Hugging Face model folder"
            )
        if merged["trajectories"] and not Path(merged["trajectories"]).is_file():
            raise LearningJobError(f"params.trajectories: {merged['trajectories']!r} does not exist")
        if not merged["trajectories"] and study_id is None:
            raise LearningJobError(
                "params.trajectories: give a JSONL file, or a study whose trajectories to use"
            )
    with db.session(settings.db_url) as s:
        job = LearningJob(study_id=study_id, kind=kind, params=merged)
        s.add(job)
        s.flush()
        s.add(LearningEvent(job_id=job.id or 0, type="learning.queued", payload={"kind": kind}))
        s.refresh(job)
        return job


def events(settings: Settings, job_id: int) -> list[LearningEvent]:
    """Return a job's events, oldest first."""
    with db.session(settings.db_url) as s:
        return list(
            s.exec(
                select(LearningEvent).where(LearningEvent.job_id == job_id).order_by(col(LearningEvent.id))
            )
        )


def _device(wanted: str) -> str:
    import torch

    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return wanted


def _update(settings: Settings, job_id: int, **fields: Any) -> None:
    with db.session(settings.db_url) as s:
        job = s.get(LearningJob, job_id)
        assert job is not None
        for k, v in fields.items():
            setattr(job, k, v)
        s.add(job)


def _progress(settings: Settings, job_id: int, fraction: float, **payload: Any) -> None:
    with db.session(settings.db_url) as s:
        job = s.get(LearningJob, job_id)
        assert job is not None
        job.progress = fraction
        s.add(job)
        s.add(
            LearningEvent(job_id=job_id, type="learning.progress", payload={"progress": fraction, **payload})
        )


def _records(settings: Settings, job: LearningJob) -> list[dict[str, Any]]:
    path = job.params["trajectories"]
    if path:
        lines = Path(path).read_text("utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    assert job.study_id is not None
    return export_records(settings, job.study_id)


def _distill(settings: Settings, job: LearningJob, out: Path) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agents.learning.distillation import DistillConfig
    from agents.learning.distillation.sdpo import SdpoConfig, SelfDistiller

    p = job.params
    records = [r for r in _records(settings, job) if r.get("rollout") and r.get("prompt")]
    if not records:
        raise LearningJobError("params.trajectories: no record has both a prompt and a rollout")
    device = _device(p["device"])
    tokenizer = AutoTokenizer.from_pretrained(p["model"], local_files_only=True)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(p["model"], local_files_only=True, dtype=dtype).to(device)
    cfg = SdpoConfig(
        mode=p["mode"], teacher=p["teacher"], rate=p["rate"], max_tokens=p["max_tokens"],
        distill=DistillConfig(beta=p["beta"], support=p["support"], topk=p["topk"]),
    )  # fmt: skip
    distiller = SelfDistiller(model, tokenizer, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"])
    history = []
    started = time.monotonic()
    steps, size = int(p["steps"]), int(p["batch_size"])
    for step in range(steps):
        batch = [records[(step * size + i) % len(records)] for i in range(min(size, len(records)))]
        diag = distiller.step(batch, opt)
        history.append({"step": step + 1, **diag})
        _progress(settings, job.id or 0, (step + 1) / steps, step=step + 1, loss=diag["loss"])
    result = {
        "device": device,
        "records": len(records),
        "steps": steps,
        "first_loss": history[0]["loss"],
        "last_loss": history[-1]["loss"],
        "seconds": time.monotonic() - started,
    }
    (out / "history.json").write_text(json.dumps(history, indent=1))
    if p["save_model"]:
        model.save_pretrained(out / "model")
        tokenizer.save_pretrained(out / "model")
    return result


def _sparse_eval(settings: Settings, job: LearningJob, out: Path) -> dict[str, Any]:
    device = _device(job.params["device"])
    trials = int(job.params["trials"])
    from agents.learning.sparse_attention.needle import needle_recall

    result = needle_recall(
        job.params,
        device,
        lambda n: _progress(settings, job.id or 0, n / trials, trial=n) if n % 8 == 0 else None,
    )
    result["device"] = device
    return result


def run(settings: Settings, job_id: int) -> str:
    """Run a queued learning job to its end; return its final status (a finished job is left alone)."""
    with db.session(settings.db_url) as s:
        job = s.get(LearningJob, job_id)
        if job is None:
            return "unknown job"
        if job.status in ("done", "failed"):
            return job.status
        job.status, job.started_at = "running", now()
        s.add(job)
        s.add(LearningEvent(job_id=job_id, type="learning.started", payload={"pid": os.getpid()}))
        s.flush()
        s.refresh(job)
        s.expunge(job)
    out = settings.data_dir / "learning" / f"job-{job_id}"
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = _distill(settings, job, out) if job.kind == "distill" else _sparse_eval(settings, job, out)
    except Exception as exc:  # the job's failure is recorded, never lost
        message = f"{type(exc).__name__}: {exc}"[:4000]
        _update(settings, job_id, status="failed", error=message, finished_at=now())
        with db.session(settings.db_url) as s:
            s.add(LearningEvent(job_id=job_id, type="learning.failed", payload={"error": message}))
        return "failed"
    (out / "result.json").write_text(json.dumps(result, indent=1))
    _update(
        settings, job_id, status="done", progress=1.0, device=result.get("device", ""),
        artifact=str(out), result=result, finished_at=now(),
    )  # fmt: skip
    with db.session(settings.db_url) as s:
        s.add(
            LearningEvent(job_id=job_id, type="learning.finished", payload={"artifact": str(out), **result})
        )
    return "done"
