"""Intake: read a repository's files and draft a commented `grove.toml`, each choice explained.

`draft(files, ...)` looks for an evaluator script, guesses the metric and direction from the
names it prints, proposes sealing data folders that look held out, and turns the numeric keys of
the config files it finds into `[search]` ranges around their current values. The notes say
why each choice was made; a model (the API's draft) may then refine the same `Choices`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from agents.policies import configfiles

EVALUATORS = (
    "eval.py",
    "evaluate.py",
    "score.py",
    "scripts/eval.py",
    "scripts/evaluate.py",
    "train.py",
    "main.py",
)
METRICS = {
    "accuracy": "maximize", "acc": "maximize", "f1": "maximize", "auc": "maximize", "roc_auc": "maximize",
    "r2": "maximize", "score": "maximize", "recall": "maximize", "precision": "maximize", "bleu": "maximize",
    "reward": "maximize", "loss": "minimize", "rmse": "minimize", "mae": "minimize", "mse": "minimize",
    "error": "minimize", "perplexity": "minimize", "ppl": "minimize",
}  # fmt: skip
HYPER = re.compile(
    r"(^|_)(lr|learning_rate|alpha|l1_ratio|l2|weight_decay|dropout|momentum|batch_size|epochs|n_estimators|"
    r"max_depth|min_samples_\w+|hidden\w*|units|width|depth|layers|num_layers|heads|gamma|c|beta\d?|"
    r"temperature|warmup\w*|steps|k|top_k|subsample|colsample\w*|eta|lambda)$",
    re.IGNORECASE,
)
NOT_CONFIG = re.compile(
    r"(^|/)(\.github|\.git|node_modules|\.venv|venv|site-packages|__pycache__)/|"
    r"(^|/)(package(-lock)?\.json|pyproject\.toml|poetry\.lock|uv\.lock|Pipfile(\.lock)?|grove\.toml|"
    r"\.pre-commit-config\.yaml|docker-compose\.ya?ml|mkdocs\.ya?ml|tsconfig\.json|codecov\.ya?ml)$"
)
HELD_OUT = re.compile(r"(^|/)(test|tests?_data|heldout|held_out|holdout|hidden)(/|$)", re.IGNORECASE)
# A data file named like a held-out split (`data/test.csv`, `test_labels.json`, `heldout.npy`).
HELD_OUT_FILE = re.compile(
    r"(^|/)(test|heldout|held_out|holdout|hidden)[\w.-]*\.(csv|tsv|json|jsonl|parquet|npy|npz|txt|pkl|pt|h5|arrow|feather|zip|gz)$",
    re.IGNORECASE,
)
CODE = (".py", ".ipynb", ".sh", ".r", ".jl", ".js", ".ts", ".c", ".cpp", ".rs", ".go")
MAX_KEYS = 6


@dataclass
class Choices:
    """What a draft spec says, before it is written out as TOML."""

    name: str
    goal: str
    base: str = ""
    metric: str = "score"
    direction: str = "maximize"
    dev: str = "python eval.py dev"
    test: str = "python eval.py test"
    editable: list[str] = field(default_factory=list)
    protected: list[str] = field(default_factory=list)
    sealed: list[str] = field(default_factory=list)
    formats: dict[str, str] = field(default_factory=dict)
    search: dict[str, dict[str, Any]] = field(default_factory=dict)
    setup: str = ""
    notes: list[str] = field(default_factory=list)


def slug(text: str) -> str:
    """Return a study name from a folder name: a-z, 0-9 and '-'."""
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:63]
    return s or "my-study"


def _evaluator(files: dict[str, str]) -> str | None:
    for name in EVALUATORS:
        if name in files:
            return name
    found = sorted(p for p in files if re.search(r"(^|/)(eval|evaluate|score)\w*\.py$", p))
    return found[0] if found else None


def _metric(text: str) -> tuple[str, str] | None:
    for m in re.finditer(r"""["'](\w+)["']\s*:""", text):
        if m.group(1).lower() in METRICS:
            return m.group(1), METRICS[m.group(1).lower()]
    for m in re.finditer(r"""["'](\w+)["']""", text):
        if m.group(1).lower() in METRICS:
            return m.group(1), METRICS[m.group(1).lower()]
    return None


def _sealed(files: dict[str, str]) -> list[str]:
    folders: set[str] = set()
    for path in files:
        m = HELD_OUT.search(path)
        if not m or path.lower().endswith(CODE):
            continue
        folder = path[: m.end()].rstrip("/")
        if not any(p.lower().endswith(CODE) for p in files if p.startswith(folder + "/")):
            folders.add(folder)
    top = sorted(f for f in folders if not any(f.startswith(g + "/") for g in folders))
    loose = sorted(
        p for p in files if HELD_OUT_FILE.search(p) and not any(p.startswith(f + "/") for f in top)
    )
    return [f"{f}/**" for f in top] + loose


def looks_held_out(path: str) -> bool:
    """Return whether a file's path looks like held-out data (it is never shown to a model)."""
    return bool(HELD_OUT_FILE.search(path)) or (
        bool(HELD_OUT.search(path)) and not path.lower().endswith(CODE)
    )


def _leaves(value: Any, prefix: str, out: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and "." not in k:
                _leaves(v, f"{prefix}.{k}" if prefix else k, out)
    elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        out.append((prefix, float(value) if isinstance(value, float) else int(value)))
    return out


def _name_of(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[-2] if parts[-1] in ("default", "value") and len(parts) > 1 else parts[-1]


def _range(name: str, v: float | int) -> dict[str, Any] | None:
    if isinstance(v, int):
        if v <= 0:
            return None
        lo, hi = max(1, v // 4), max(v * 4, v + 2)
        return {"low": lo, "high": hi, "integer": True} | ({"log": True} if hi / lo >= 16 else {})
    if 0.0 <= v < 1.0 and re.search(r"dropout|momentum|ratio|subsample|colsample|beta", name, re.I):
        return {"low": 0.0, "high": 0.95}
    if v <= 0:
        return None
    return {"low": float(f"{v / 10:.4g}"), "high": float(f"{v * 10:.4g}"), "log": True}


def draft(files: dict[str, str], name: str, goal: str = "", base: str = "") -> Choices:
    """Return a draft of a study's spec for a repository's text files (path -> content)."""
    c = Choices(name=slug(name), goal=goal.strip() or "TODO: say in one sentence what should improve")
    c.base = base
    if not goal.strip():
        c.notes.append("goal: none given; write what should improve (ideation reads it)")
    ev = _evaluator(files)
    if ev is None:
        c.notes.append(
            "evaluator: no eval.py, evaluate.py or score.py found; write one that prints a JSON line "
            'such as {"score": 0.9} and set evaluate.dev and evaluate.test'
        )
    else:
        text = files[ev]
        flag = re.search(r"""add_argument\(\s*["'](--[\w-]+)["'][^)]*choices""", text)
        names_test = bool(re.search(r"""["']test["']""", text) and re.search(r"""["']dev["']""", text))
        split = names_test and ("sys.argv" in text or flag is not None)
        arg = f"{flag.group(1)} " if flag and names_test else ""
        c.dev, c.test = (
            (f"python {ev} {arg}dev", f"python {ev} {arg}test") if split else (f"python {ev}", f"python {ev}")
        )
        c.protected = [ev]
        c.notes.append(
            f"evaluator: {ev} (the first of {', '.join(EVALUATORS[:3])} found); it is protected, so no change may edit it"
            + (f"; it takes {arg}dev or {arg}test" if split else "; TODO: make `test` score the sealed split")
        )
        found = _metric(text)
        if found:
            c.metric, c.direction = found
            c.notes.append(f"metric: {c.metric!r}, {c.direction}d, a name {ev} prints")
        else:
            c.notes.append(
                f"metric: 'score' (no known metric name in {ev}); it must be a key of the JSON it prints"
            )
    c.sealed = _sealed(files)
    for folder in ("data", "datasets"):
        if any(p.startswith(folder + "/") for p in files):
            c.protected.append(f"{folder}/**")
            c.notes.append(f"protected: {folder}/** (the data the evaluator reads; no change may edit it)")
    c.notes.append(
        "sealed: "
        + ", ".join(c.sealed)
        + " (folders named like held-out data; only the gate's test runs see them)"
        if c.sealed
        else "sealed: nothing found that looks held out; list the held-out data's files in files.sealed"
    )
    sealed_prefixes = tuple(s.removesuffix("/**") + "/" for s in c.sealed)
    scored: list[tuple[int, str, str, Any, str]] = []
    for path, text in sorted(files.items()):
        if NOT_CONFIG.search(path) or path.startswith(sealed_prefixes) or path.lower().endswith(CODE):
            continue
        suffix = PurePosixPath(path).suffix.lower()
        if suffix not in configfiles.FORMATS and suffix:
            continue
        try:
            fmt = configfiles.file_format(path, text)
            doc = configfiles.load(path, text, fmt)
        except configfiles.ConfigFormatError:
            continue
        for dotted, value in _leaves(doc, "", []):
            key_name = _name_of(dotted)
            if HYPER.search(key_name) or HYPER.search(dotted.split(".")[-1]):
                scored.append((0 if HYPER.search(key_name) else 1, path, dotted, value, fmt))
    chosen = sorted(scored, key=lambda t: (t[0], t[1], t[2]))[:MAX_KEYS]
    for _, path, dotted, value, fmt in chosen:
        dim = _range(_name_of(dotted), value)
        if dim is None:
            continue
        c.search[f"{path}:{dotted}"] = dim
        if path not in c.editable:
            c.editable.append(path)
        if not PurePosixPath(path).suffix:
            c.formats[path] = fmt
    if c.search:
        c.notes.append(
            "search: "
            + ", ".join(f"{k} = {_fmt(v)}" for k, v in c.search.items())
            + " (numeric keys named like hyperparameters, ranged around their current values)"
        )
    else:
        c.notes.append(
            "search: no config key named like a hyperparameter; list keys under [search] or use the llm policy"
        )
    reqs = [p for p in ("requirements.txt", "pyproject.toml", "setup.py") if p in files]
    if reqs:
        c.setup = (
            'python -m venv "$GROVE_ENV" && "$GROVE_ENV/bin/pip" install -r requirements.txt'
            if reqs[0] == "requirements.txt"
            else 'python -m venv "$GROVE_ENV" && "$GROVE_ENV/bin/pip" install .'
        )
        c.notes.append(
            f"environment: {reqs[0]} found; the setup installs it into the study's environment, downloading "
            "packages (network = true, which the operator allows with GROVE_SANDBOX_NETWORK=true)"
        )
    return c


def _fmt(dim: dict[str, Any]) -> str:
    if "values" in dim:
        return json.dumps(dim["values"])
    return (
        f"[{dim['low']:g}, {dim['high']:g}]"
        + (" log" if dim.get("log") else "")
        + (" integer" if dim.get("integer") else "")
    )


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{ " + ", ".join(f"{_key(str(k))} = {_toml(v)}" for k, v in value.items()) + " }"


def _key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def one_line(text: str) -> str:
    """Return text with every control character (a line break above all) turned into a space."""
    return re.sub(r"[\x00-\x1f\x7f\u2028\u2029\x85]", " ", text)


def render(c: Choices) -> str:
    """Write the choices out as a commented grove.toml."""
    lines = [
        "# Drafted by Grove from what it found in the repository; every line is yours to change.",
        "# Each choice is explained in a comment; `grove validate` checks it and runs dev once.",
        "[study]",
        f"name = {_toml(c.name)}",
        f"goal = {_toml(c.goal)}",
    ]
    if c.base:
        lines.append(f"base = {_toml(c.base)}")
    lines += [
        "",
        "[objective]",
        f"metric = {_toml(c.metric)}          # a key of the JSON line the evaluator prints",
        f"direction = {_toml(c.direction)}",
        "",
        "[evaluate]",
        f"dev = {_toml(c.dev)}     # scores a change; GROVE_SEED=0,1,2 for the repeats",
        f"test = {_toml(c.test)}   # the sealed held-out score: only the gate runs it",
        "# If that command runs code a change may edit, it could read the held-out labels: split it",
        "# into test_predict (writes $GROVE_OUTPUTS, no labels) and test_score (protected code only).",
        "repeats = 3",
        "",
        "[files]",
        f"editable = {_toml(c.editable or ['TODO-config-file'])}   # what a change may touch",
        f"protected = {_toml(c.protected)}   # never changed: the evaluator",
        f"sealed = {_toml(c.sealed)}   # hidden from every experiment",
    ]
    if c.formats:
        lines.append(f"formats = {_toml(c.formats)}   # files whose name does not say their format")
    if c.search:
        lines += ["", "[search]   # the space the search policy explores"]
        lines += [f"{_toml(k)} = {_toml(v)}" for k, v in c.search.items()]
    if c.setup:
        lines += [
            "",
            "[environment]   # built once per clone and dependency files, then shared by every run",
            f"setup = {_toml(c.setup)}",
            "network = true   # the setup step downloads packages",
        ]
    lines += [
        "",
        "[budget]",
        "experiments = 20",
        "parallel = 2",
        "",
        "[gate]",
        'mode = "approve"   # a human approves each change that clears the sealed gate',
        "",
        "# Why each choice was made:",
        *(f"# - {one_line(n)}" for n in c.notes),
        "",
    ]
    return "\n".join(lines)
