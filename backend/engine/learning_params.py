"""The parameters of each learning job kind, checked before a job is queued (no torch here)."""

from __future__ import annotations

from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from agents.learning.options import Method, Support, Teacher
from backend.core.errors import FieldError


class DistillParams(BaseModel):
    """A distillation job: a local model folder, the prompts or records to distil, and the step's settings.

    Stored (`on_policy = false`): the records' own rollouts and feedback, `steps` steps. On-policy:
    `rounds` rounds of sampling `samples` rollouts per prompt, checking them (`tasks`' checkers in
    the sandbox, or the records' stored feedback) and `steps` steps on them.
    """

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str = ""  # a local Hugging Face model folder (config, weights, tokenizer)
    trajectories: str = ""  # a JSONL file from `grove export-trajectories`; empty: the study's own records
    tasks: str = ""  # a JSONL file of tasks with checkers (`backend/engine/checker.py`); on-policy only
    # The enum fields take their values as strings (strict mode would ask for the enum's members).
    method: Method = Field(default=Method.SDPO, validation_alias=AliasChoices("method", "mode"), strict=False)
    teacher: Teacher | None = Field(default=None, strict=False)  # None: ema for SDPO, frozen for CANON
    on_policy: bool = False
    rounds: int = Field(default=3, ge=1, le=100_000)
    samples: int = Field(default=4, ge=1, le=1024)
    max_new_tokens: int = Field(default=64, ge=1, le=32_768)
    temperature: float = Field(default=1.0, gt=0.0, le=10.0)
    is_clip: float = Field(default=2.0, gt=0.0)
    check_timeout: float = Field(default=60.0, gt=0.0, le=3600.0)
    opsa: bool = False
    opsa_weight: float = Field(default=0.1, gt=0.0, le=100.0)
    opsa_fraction: float = Field(default=0.2, gt=0.0, le=1.0)
    opsa_a_min: float = Field(default=-1.0, le=0.0)
    opsa_a_max: float = Field(default=-0.5, le=0.0)
    rate: float = Field(default=0.05, ge=0.0, le=1.0)
    beta: float = Field(default=0.5, ge=0.0, le=1.0)
    support: Support = Field(default=Support.TOPK, strict=False)
    topk: int = Field(default=100, ge=1, le=1_000_000)
    steps: int = Field(default=20, ge=1, le=1_000_000)
    batch_size: int = Field(default=4, ge=1, le=1_000_000)
    lr: float = Field(default=1e-5, gt=0.0)
    max_tokens: int = Field(default=1024, ge=1, le=1_000_000)
    device: str = "auto"
    save_model: bool = True


class SparseEvalParams(BaseModel):
    """A sparse-attention evaluation: needle-in-documents recall of the routed memory."""

    model_config = ConfigDict(extra="forbid", strict=True)
    docs: int = Field(default=64, ge=1, le=1_000_000)
    doc_len: int = Field(default=256, ge=1, le=1_000_000)
    top_k: int = Field(default=4, ge=1, le=1_000_000)
    pool: int = Field(default=64, ge=1, le=1_000_000)
    noise: float = Field(default=0.5, ge=0.0)
    topic: float = 0.0
    trials: int = Field(default=32, ge=1, le=1_000_000)
    ssmax: bool = False
    seed: int = 0
    device: str = "auto"


class SparseTrainParams(BaseModel):
    """Training the MSA router on needle episodes with the routing loss; recall before and after.

    Training episodes (`train_docs` documents each) come from `seed`; recall is measured on
    `trials` episodes of `docs` documents from `eval_seed`, documents the router never saw. The
    documents' topics share a `topic_rank`-dimensional subspace, which a router can learn to read.
    """

    model_config = ConfigDict(extra="forbid", strict=True)
    docs: int = Field(default=64, ge=1, le=1_000_000)
    doc_len: int = Field(default=256, ge=1, le=1_000_000)
    top_k: int = Field(default=2, ge=1, le=1_000_000)
    pool: int = Field(default=16, ge=1, le=1_000_000)
    noise: float = Field(default=1.0, ge=0.0)
    topic: float = Field(default=0.3, ge=0.0)
    topic_rank: int = Field(default=4, ge=0, le=64)
    ssmax: bool = False
    seed: int = 0
    eval_seed: int = 1000
    trials: int = Field(default=32, ge=1, le=1_000_000)
    steps: int = Field(default=300, ge=1, le=1_000_000)
    lr: float = Field(default=3e-3, gt=0.0)
    train_docs: int = Field(default=16, ge=2, le=1_000_000)
    tau: float = Field(default=0.1, gt=0.0)
    device: str = "auto"
    save_model: bool = True


PARAMS: dict[str, type[BaseModel]] = {
    "distill": DistillParams,
    "sparse_eval": SparseEvalParams,
    "sparse_train": SparseTrainParams,
}


class LearningJobError(FieldError):
    """A learning job was asked for with bad parameters (`key` names the field)."""


PATHS = ("model", "trajectories", "tasks")  # the distillation parameters that name files on the server


ON_POLICY_ONLY = ("tasks", "rounds", "samples", "max_new_tokens", "temperature", "check_timeout")


OPSA_ONLY = ("opsa_weight", "opsa_fraction", "opsa_a_min", "opsa_a_max")


def distill_problem(p: DistillParams) -> LearningJobError | None:
    """Return why a distillation's parameters do not go together (naming the field), or None."""
    given = p.model_fields_set
    if p.method == Method.CANON and p.teacher not in (None, Teacher.FROZEN):
        return LearningJobError(
            "params.teacher",
            'CANON distils from a frozen snapshot: leave teacher unset or set it to "frozen"',
        )
    if p.support == Support.SAMPLED and p.beta != 1.0:
        return LearningJobError(
            "params.beta",
            "the sampled-token support is the reverse KL only: set beta = 1 (or another support)",
        )
    for name in OPSA_ONLY:
        if name in given and not p.opsa:
            return LearningJobError(f"params.{name}", "set opsa = true to use it")
    if p.opsa_a_min > p.opsa_a_max:
        return LearningJobError(
            "params.opsa_a_min", "must not be above opsa_a_max (advantages lie in [opsa_a_min, opsa_a_max])"
        )
    for name in ON_POLICY_ONLY:
        if name in given and not p.on_policy:
            return LearningJobError(f"params.{name}", "only an on-policy job samples: set on_policy = true")
    if p.tasks and p.trajectories:
        return LearningJobError("params.tasks", "give the prompts as tasks or as trajectories, not both")
    if p.on_policy and p.method == Method.CANON and p.samples < 2:
        return LearningJobError(
            "params.samples", "CANON's consensus needs at least 2 rollouts of each prompt"
        )
    return None


def describe(kind: str, err: Any) -> LearningJobError:
    """Return the refusal of a job's parameters that pydantic found wrong, naming the field."""
    key = "params." + ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return LearningJobError(
            key, f"unknown for a {kind} job (known: {', '.join(PARAMS[kind].model_fields)})"
        )
    if err["type"].endswith("_type"):
        return LearningJobError(key, f"expected {err['type'].removesuffix('_type')}, got {err['input']!r}")
    return LearningJobError(key, str(err["msg"]))
