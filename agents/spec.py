"""The study spec (`grove.toml`): typed models, parsing, and checks against the repository."""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from agents import capabilities, configfiles

SLUG = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
KEY_ENV = re.compile(r"^GROVE_KEY_[A-Z0-9_]+$")
WEEK = 7 * 24 * 3600


class Judge(StrEnum):
    """Who decides a constraint: its metric against bounds, or the verifier model (a soft constraint)."""

    METRIC = "metric"
    LLM = "llm"


class Level(StrEnum):
    """How much a spec issue weighs: an error stops the study, a warning is shown."""

    ERROR = "error"
    WARNING = "warning"


class GateMode(StrEnum):
    """Whether a change that passes the held-out gate waits for a human or merges at once."""

    APPROVE = "approve"
    AUTO = "auto"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class StudySection(_Section):
    name: str
    goal: str
    base: str = "HEAD"  # the repository's default branch

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        if not SLUG.match(v):
            raise ValueError(f"must be a slug of a-z, 0-9 and '-', at most 63 characters (got {v!r})")
        return v


class Objective(_Section):
    metric: str = Field(min_length=1)
    direction: Literal["maximize", "minimize"]
    # The values the metric can take (e.g. [0, 1] for an accuracy): a run reporting one outside fails.
    bounds: tuple[float, float] | None = None

    @field_validator("bounds")
    @classmethod
    def _bounds(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None and not (math.isfinite(v[0]) and math.isfinite(v[1]) and v[0] < v[1]):
            raise ValueError("must be [low, high] with finite low < high")
        return v


class Evaluate(_Section):
    dev: str = Field(min_length=1)
    # The sealed test: one command, or two phases (the candidate predicts without the labels into
    # $GROVE_OUTPUTS, then protected code alone scores what it wrote, beside the sealed files).
    test: str = ""
    test_predict: str = ""
    test_score: str = ""
    test_inputs: list[str] = []  # sealed files the predict phase may read (inputs, never labels)
    timeout: float = Field(default=600, gt=0, le=WEEK)
    repeats: int = Field(default=3, ge=1, le=100)
    # An unclear dev gain is re-run with trunk on more paired seeds, up to this many (default 3 x repeats).
    max_repeats: int | None = Field(default=None, ge=1, le=300)

    @model_validator(mode="after")
    def _repeats(self) -> Evaluate:
        if self.max_repeats is not None and self.max_repeats < self.repeats:
            raise ValueError(f"max_repeats ({self.max_repeats}) is below repeats ({self.repeats})")
        phases = bool(self.test_predict.strip()), bool(self.test_score.strip())
        if self.test.strip() and any(phases):
            raise ValueError("give either test or test_predict and test_score, not both")
        if not self.test.strip() and not all(phases):
            missing = "test_score" if phases[0] else "test_predict" if phases[1] else "test"
            raise ValueError(
                f"{missing} is required: the sealed test is one command (test) or two (test_predict, test_score)"
            )
        if self.test_inputs and not self.two_phase:
            raise ValueError("test_inputs goes with test_predict and test_score")
        return self

    @property
    def two_phase(self) -> bool:
        """Return whether the sealed test runs as a predict phase and a protected score phase."""
        return bool(self.test_predict.strip())

    @property
    def most_repeats(self) -> int:
        """Return the most dev runs a node may get (adaptive repeats)."""
        return self.max_repeats if self.max_repeats is not None else 3 * self.repeats


class Files(_Section):
    editable: list[str] = Field(min_length=1)
    protected: list[str] = []
    sealed: list[str] = []
    # The format of config files whose name does not say it (`"MLproject" = "yaml"`).
    formats: dict[str, Literal["toml", "yaml", "json"]] = {}


class Constraint(_Section):
    name: str
    metric: str = ""
    min: float | None = None
    max: float | None = None
    description: str = ""
    judge: Judge = Judge.METRIC  # llm: a soft constraint judged by the verifier
    threshold: int = Field(default=70, ge=0, le=100)  # confidence a soft constraint needs to pass

    @model_validator(mode="after")
    def _bound(self) -> Constraint:
        if self.judge == Judge.LLM:
            if not self.description:
                raise ValueError("a soft constraint (judge = 'llm') needs a description")
            return self
        if not self.metric:
            raise ValueError("needs metric (or judge = 'llm' with a description)")
        if self.min is None and self.max is None:
            raise ValueError("needs min, max or both")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError("min is greater than max")
        return self


Scalar = bool | int | float | str


class SearchDim(_Section):
    values: list[Scalar | list[Scalar]] | None = None
    low: float | None = None
    high: float | None = None
    log: bool = False
    # true: whole numbers; false: floats; unset: whole numbers only where the bounds and the
    # repository's current value all are.
    integer: bool | None = None
    # Config keys that all take this dimension's value (`["MLproject:a.b", "params.yaml:alpha"]`);
    # unset: the `[search]` key itself names the one target.
    targets: list[str] = []
    # A conditional dimension: active only where each named `[search]` key (a list of values)
    # takes the value, or one of the values, given here (`{ "c.toml:opt.name" = "sgd" }`).
    # Elsewhere it keeps the repository's value and is neither searched nor edited.
    when: dict[str, Scalar | list[Scalar]] = {}

    @model_validator(mode="after")
    def _shape(self) -> SearchDim:
        if self.values is not None:
            if self.low is not None or self.high is not None:
                raise ValueError("give either values or low/high, not both")
            if len(self.values) < 2:
                raise ValueError("values needs at least two entries")
            return self
        if self.low is None or self.high is None:
            raise ValueError("needs values = [...] or low and high")
        if not self.low < self.high:
            raise ValueError("low must be below high")
        if self.log and self.low <= 0:
            raise ValueError("a log range needs low > 0")
        if self.integer and math.ceil(self.low) > math.floor(self.high):
            raise ValueError(f"no integer lies between low ({self.low:g}) and high ({self.high:g})")
        return self

    @property
    def is_range(self) -> bool:
        """Return whether this dimension is a numeric range."""
        return self.values is None


class Budget(_Section):
    experiments: int = Field(default=30, ge=1, le=100_000)
    parallel: int = Field(default=2, ge=1, le=64)
    hours: float = Field(default=2.0, gt=0, le=24 * 366)
    usd: float = Field(default=5.0, ge=0, le=1_000_000)  # LLM spend; 0: no USD limit
    tokens: int | None = Field(default=None, ge=1000, le=10**12)  # LLM tokens in and out, every call


class Gate(_Section):
    mode: GateMode = GateMode.APPROVE
    # The held-out gain's 95% lower bound must be strictly above this (metric units).
    margin: float = Field(default=0.0, ge=0)
    test_repeats: int = Field(default=3, ge=1, le=100)
    max_test_runs: int = Field(default=10, ge=1, le=10_000)

    @field_validator("mode", mode="before")
    @classmethod
    def _no_review(cls, v: Any) -> Any:
        if v == "review":
            raise ValueError(
                "'review' is not offered: use 'approve' (a human approves every gate pass) or 'auto'"
            )
        return v


class PolicySection(_Section):
    kind: Literal["search", "llm"] | None = None
    model: str | None = None
    api_base: str | None = None  # an OpenAI-compatible server (vLLM, llama.cpp, Ollama's /v1)
    # The variable holding the key for `api_base` when the operator has not allow-listed it.
    api_key_env: str | None = Field(default=None, pattern=KEY_ENV.pattern)
    input_usd_per_mtok: float | None = Field(default=None, ge=0)  # prices for models litellm does not know
    output_usd_per_mtok: float | None = Field(default=None, ge=0)
    max_turns: int = Field(default=30, ge=1, le=10_000)
    max_tokens: int = Field(default=400_000, ge=1000, le=1_000_000_000)
    executor_minutes: float = Field(default=30.0, gt=0, le=WEEK / 60)
    seed: int = 0
    children: int = Field(default=3, ge=1, le=16)
    # The search policy's Optuna sampler; auto: GP where torch and scipy are installed, else TPE.
    sampler: Literal["auto", "gp", "tpe", "random"] = "auto"
    max_depth: int = Field(default=6, ge=1, le=1000)
    # The share of the experiment budget the `search` policy keeps for its finishing phase: local
    # search around the best node so far (0 turns it off). Its winner still has to pass the gate.
    finish: float = Field(default=0.25, ge=0.0, le=0.9)
    # A merged value on a range's bound widens that side for later proposals (and is a finding).
    widen: bool = True
    # How the executor acts: native tool calls, the text action format, or "auto" (litellm's word
    # on the model; native for a model it does not know, falling back to text if the server refuses).
    tool_mode: Literal["auto", "native", "text"] = "auto"
    # How an answer's JSON schema is sent so the server constrains decoding to it ("auto": by provider,
    # the first form the server takes; "none": tolerant reading only).
    decoding: Literal["auto", "none", "json_schema", "llamacpp", "ollama", "vllm"] = "auto"
    system_role: bool = True  # false for models whose template has no system role
    # What an ideator's child may be: "any" (edits of the `[search]` settings, or a change of code the
    # executor writes) or "settings" (edits only, where the study has settings: for a small model).
    ideas: Literal["any", "settings"] = "any"
    extra: dict[str, Any] = {}  # provider options passed through, e.g. {num_ctx = 16384} for Ollama
    max_input_tokens: int | None = Field(default=None, ge=1000, le=100_000_000)  # None: the model's own
    max_output_tokens: int = Field(default=4096, ge=16, le=1_000_000)
    keep_turns: int = Field(default=4, ge=1, le=1000)  # turns kept whole when the context must shrink
    # Sampling temperature: one for every role, or a table by role (roles left out: the server's default).
    temperature: float | dict[str, float] | None = None

    @field_validator("temperature", mode="before")
    @classmethod
    def _temperature(cls, v: Any) -> Any:
        def one(x: Any, where: str) -> float:
            if isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x <= 2:
                raise ValueError(f"{where}must be a number from 0 to 2 (got {x!r})")
            return float(x)

        if v is None or not isinstance(v, dict):
            return None if v is None else one(v, "")
        bad = sorted(k for k in v if k not in LLM_ROLES)
        if bad:
            raise ValueError(
                f"{', '.join(bad)}: not a role; a temperature table takes {', '.join(LLM_ROLES)}, "
                "e.g. { ideator = 0.9, executor = 0.2 }"
            )
        return {k: one(x, f"{k}: ") for k, x in v.items()}

    @field_validator("extra")
    @classmethod
    def _provider_options(cls, v: dict[str, Any]) -> dict[str, Any]:
        bad = sorted(k for k in v if k not in PROVIDER_OPTIONS)
        if bad:
            raise ValueError(
                f"{', '.join(bad)}: not a provider option Grove passes through; it takes "
                f"{', '.join(sorted(PROVIDER_OPTIONS))} (endpoints, keys, the model, limits and retries are Grove's)"
            )
        plain = (bool, int, float, str)
        for k, value in v.items():
            if not (
                isinstance(value, plain)
                or (isinstance(value, list) and all(isinstance(x, plain) for x in value))
            ):
                raise ValueError(
                    f"{k}: a provider option takes a number, a string, a boolean or a list of them"
                )
        return v


# The llm policy's roles, each a prompt of its own (`[policy] temperature` may differ by role).
LLM_ROLES = ("ideator", "executor", "verifier", "insight", "state", "reflect")

# Sampling and server options a spec may pass to the provider as they are; nothing that could
# redirect a call, change the model, read a key or lift a limit (`fallbacks`, `extra_body`, `n`, …).
PROVIDER_OPTIONS = frozenset({
    "num_ctx", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seed", "stop", "reasoning_effort", "mirostat", "mirostat_eta",
    "mirostat_tau", "keep_alive",
})  # fmt: skip


class Plateau(_Section):
    warn: int = Field(default=3, ge=1)
    change: int = Field(default=5, ge=1)
    stop: int = Field(default=8, ge=1)
    min_gain: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _order(self) -> Plateau:
        if not self.warn <= self.change <= self.stop:
            raise ValueError("needs warn <= change <= stop")
        return self


class Sandbox(_Section):
    memory_mb: int = Field(default=4096, ge=16, le=16 * 1024 * 1024)
    cpu_seconds: int | None = Field(default=None, ge=1, le=WEEK)
    file_size_mb: int = Field(default=1024, ge=1, le=16 * 1024 * 1024)
    processes: int = Field(default=512, ge=1, le=65_536)
    disk_mb: int = Field(default=2048, ge=1, le=16 * 1024 * 1024)  # bytes a run may add to its tree
    tmp_mb: int = Field(default=512, ge=1, le=1024 * 1024)  # size of the private /tmp
    network: bool = False  # evaluations and executor commands reach the network only if true


ENV_INPUTS = [
    "requirements*.txt", "pyproject.toml", "setup.py", "setup.cfg", "uv.lock", "poetry.lock",
    "Pipfile.lock", "environment.yml", "conda.yaml",
]  # fmt: skip


class Environment(_Section):
    # Run once per Grove clone and content of `inputs`, inside the sandbox, to build the folder
    # `$GROVE_ENV` (e.g. `python -m venv "$GROVE_ENV" && "$GROVE_ENV/bin/pip" install -r requirements.txt`);
    # every evaluation then runs with `$GROVE_ENV/bin` first on PATH.
    setup: str = ""
    inputs: list[str] = Field(default_factory=lambda: list(ENV_INPUTS))  # globs whose content keys the cache
    network: bool = False  # the setup step may reach the network (evaluations still follow [sandbox])
    timeout: int = Field(default=1800, ge=1, le=WEEK)
    disk_mb: int = Field(default=20 * 1024, ge=1, le=16 * 1024 * 1024)  # what setup may write, env included


class Memory(_Section):
    # Lab memory: a finished study leaves its findings and lessons for later studies of the same
    # repository and objective; a new study's ideator gets the most relevant ones.
    use: bool = True  # read earlier studies' entries and leave this study's
    name: str = Field(default="", pattern=r"^[A-Za-z0-9_.-]{0,64}$")  # also share entries under this name
    entries: int = Field(default=8, ge=0, le=100)  # entries given to the ideator


class Resources(_Section):
    gpu: bool = False


class Spec(_Section):
    study: StudySection
    objective: Objective
    evaluate: Evaluate
    files: Files
    constraints: list[Constraint] = []
    search: dict[str, SearchDim] = {}
    budget: Budget = Budget()
    gate: Gate = Gate()
    policy: PolicySection = PolicySection()
    plateau: Plateau = Plateau()
    sandbox: Sandbox = Sandbox()
    resources: Resources = Resources()
    environment: Environment = Environment()
    memory: Memory = Memory()

    @property
    def policy_kind(self) -> Literal["search", "llm"]:
        """Return the policy kind, defaulting to `search` when a search space is declared."""
        if self.policy.kind is not None:
            return self.policy.kind
        return "search" if self.search else "llm"

    @property
    def capabilities(self) -> capabilities.Capabilities:
        """Return what the study's policy does that its callers must know."""
        return capabilities.of(self.policy_kind)

    @property
    def maximize(self) -> bool:
        """Return whether the objective is maximised."""
        return self.objective.direction == "maximize"

    def judged_metrics(self) -> list[str]:
        """Return the metrics a node is judged on: the objective's and every metric constraint's."""
        return [
            self.objective.metric,
            *(c.metric for c in self.constraints if c.judge == Judge.METRIC and c.metric),
        ]

    @field_validator("constraints")
    @classmethod
    def _unique(cls, v: list[Constraint]) -> list[Constraint]:
        names = [c.name for c in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate constraint name {dup[0]!r}")
        return v

    @field_validator("search", mode="before")
    @classmethod
    def _keys(cls, v: Any) -> Any:
        if isinstance(v, dict):
            for key, dim in v.items():
                targets = dim.get("targets") if isinstance(dim, dict) else None
                if not targets:
                    split_search_key(key)
                    continue
                if not isinstance(targets, list):
                    raise _bad_key(key, "targets must be a list of 'FILE:dotted.key' strings")
                for i, target in enumerate(targets):
                    try:
                        split_search_key(str(target))
                    except ValueError as exc:
                        raise _bad_key(key, f"targets[{i}]: {exc}") from None
        return v

    @field_validator("search", mode="after")
    @classmethod
    def _conditions(cls, v: dict[str, SearchDim]) -> dict[str, SearchDim]:
        for key, dim in v.items():
            for parent, allowed in dim.when.items():
                other = v.get(parent)
                if other is None:
                    raise _bad_key(key, f"when names {parent!r}, which is not a [search] key")
                if other.values is None:
                    raise _bad_key(key, f"when names {parent!r}, which must be a list of values")
                if other.when:
                    raise _bad_key(key, f"when names {parent!r}, which is conditional itself")
                for value in allowed if isinstance(allowed, list) else [allowed]:
                    if not any(value == c and type(value) is type(c) for c in other.values):
                        raise _bad_key(key, f"when: {value!r} is not one of {parent!r}'s values")
        return v

    def targets(self, key: str) -> list[tuple[str, str]]:
        """Return the `(file, dotted key)` pairs a `[search]` key sets."""
        dim = self.search[key]
        return [split_search_key(t) for t in dim.targets] if dim.targets else [split_search_key(key)]

    def value_at(self, key: str, read: Callable[[str], str]) -> Any:
        """Return a `[search]` key's current value: its first target's, read through `read(file)`."""
        file, dotted = self.targets(key)[0]
        return configfiles.get_key(file, read(file), dotted, self.files.formats.get(file))

    def target_map(self) -> dict[str, list[str]]:
        """Return each `[search]` key's targets as `FILE:dotted` strings."""
        return {k: [f"{f}:{d}" for f, d in self.targets(k)] for k in self.search}

    @model_validator(mode="after")
    def _cross(self) -> Spec:
        if not self.capabilities.edits_code and not self.search:
            raise ValueError("policy.kind = 'search' needs a [search] section")
        if not self.capabilities.judges and any(c.judge == Judge.LLM for c in self.constraints):
            raise ValueError("constraints with judge = 'llm' need policy.kind = 'llm'")
        return self


class SpecIssue(BaseModel):
    """One problem found in a spec, located by its dotted key; a warning does not stop a study."""

    key: str
    message: str
    level: Level = Level.ERROR

    def __str__(self) -> str:
        return f"{self.key}: {self.message}" if self.key else self.message


class SpecError(ValueError):
    """A spec is invalid; `issues` names every key at fault."""

    def __init__(self, issues: list[SpecIssue], source: str = "grove.toml") -> None:
        self.issues = issues
        self.source = source
        super().__init__("\n".join(f"{source}: {i}" for i in issues))


def split_search_key(key: str) -> tuple[str, str]:
    """Split a `[search]` key `FILE:DOTTED.KEY` into its file and key."""
    file, sep, dotted = key.rpartition(":")
    if not sep or not file or not dotted:
        raise _bad_key(key, "expected 'FILE:dotted.key', e.g. 'config.toml:model.hidden'")
    if file.startswith("/") or ".." in file.split("/"):
        raise _bad_key(key, "the file must be a path inside the repository")
    return file, dotted


def format_key(loc: tuple[int | str, ...]) -> str:
    """Format a location as a dotted key: `files.editable[0]`, `search."a.toml:x"`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            name = part if re.fullmatch(r"[A-Za-z0-9_-]+", part) else f'"{part}"'
            out += f".{name}" if out else name
    return out


BAD_KEY = "bad_key"  # the error type of a problem of one key inside a table (its name in `ctx`)


def _bad_key(key: str, detail: str) -> PydanticCustomError:
    """Return the validation error of one key of a table, located at the key, not the table."""
    return PydanticCustomError(BAD_KEY, "key '{key}': {detail}", {"key": key, "detail": detail})


def _issues_from(err: ValidationError) -> list[SpecIssue]:
    out: list[SpecIssue] = []
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif e["type"] not in ("value_error", BAD_KEY):
            msg = f"{msg} (got {e['input']!r})"
        loc = tuple(e["loc"])
        if e["type"] == BAD_KEY:  # a [search] key's own problem, located at the key
            loc, msg = (*loc, e["ctx"]["key"]), e["ctx"]["detail"]
        out.append(SpecIssue(key=format_key(loc), message=msg))
    return out


# TOML's integers are 64-bit; Python's are not, and one of thousands of digits cannot even be printed.
INT64 = 2**63


def _wide_int(value: Any, loc: tuple[int | str, ...] = ()) -> tuple[int | str, ...] | None:
    """Return the location of the first integer outside TOML's 64 bits in parsed TOML, or None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None if -INT64 <= value < INT64 else loc
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if (found := _wide_int(v, (*loc, k))) is not None:
            return found
    return None


def _long_number(text: str, exc: ValueError) -> str:
    """Say why TOML text raised a plain ValueError: Python's int-string limit on a decimal integer."""
    for n, line in enumerate(text.splitlines(), 1):
        if re.search(r"(?:^|[=\[,{\s])[+-]?[0-9][0-9_]{4300,}", line):
            return f"not valid TOML: line {n} holds an integer of thousands of digits (TOML's are 64-bit)"
    return f"not valid TOML: {exc}"


def parse_spec(text: str, source: str = "grove.toml") -> Spec:
    """Parse spec text into a `Spec`, raising `SpecError` that names each bad key."""
    try:
        data = tomllib.loads(text)
        wide = _wide_int(data)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError([SpecIssue(key="", message=f"not valid TOML: {exc}")], source) from exc
    except ValueError as exc:  # int() past Python's int-string limit, which tomllib lets through
        raise SpecError([SpecIssue(key="", message=_long_number(text, exc))], source) from None
    except RecursionError:
        raise SpecError([SpecIssue(key="", message="not valid TOML: nested too deeply")], source) from None
    if wide is not None:
        issue = SpecIssue(key=format_key(wide), message="integer out of range (TOML integers are 64-bit)")
        raise SpecError([issue], source)
    try:
        return Spec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_issues_from(exc), source) from exc


def spec_changes(old: Spec, new: Spec) -> list[str]:
    """Return the dotted keys whose values differ between two specs (comments and layout aside)."""

    def flat(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                flat(v, f"{prefix}.{format_key((str(k),))}" if prefix else format_key((str(k),)), out)
        else:
            out[prefix] = value
        return out

    a, b = flat(old.model_dump(), "", {}), flat(new.model_dump(), "", {})
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
