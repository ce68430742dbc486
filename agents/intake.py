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
import shlex
import tomllib
from pathlib import PurePosixPath
from typing import Any

from agents import configfiles, entrypoints, goals, spec
from agents.draft import Choices as Choices
from agents.draft import drop as drop
from agents.draft import fmt_value
from agents.draft import one_line as one_line
from agents.draft import render as render

EVALUATORS = (
    "eval.py",
    "evaluate.py",
    "score.py",
    "scripts/eval.py",
    "scripts/evaluate.py",
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
# Knobs that change what a run logs or saves, not what it learns: never searched.
NOT_HYPER = re.compile(
    r"log|print|save|ckpt|checkpoint|eval_|_every|interval|verbose|seed|workers|patience", re.I
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


def slug(text: str) -> str:
    """Return a study name from a folder name: a-z, 0-9 and '-'."""
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:63]
    return s or "my-study"


def _evaluator(files: dict[str, str]) -> str | None:
    for name in EVALUATORS:
        if name in files:
            return name
    found = sorted(p for p in files if re.search(r"(^|/)(eval|evaluate|score)\w*\.py$", p))
    if found:
        return found[0]
    # A training script counts as the evaluator only when it already prints JSON metrics.
    return next(
        (s for s in ("train.py", "main.py") if s in files and "json.dump" in files[s] and _metric(files[s])),
        None,
    )


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
    elif (isinstance(value, str) and _choices(prefix.rsplit(".", 1)[-1], value)) or _sizes(value):
        out.append((prefix, value))  # a well-known choice, or a list of layer sizes
    return out


def _sizes(value: Any) -> bool:
    """Return whether a value is a list of layer sizes (`hidden_dims: [64, 64]`)."""
    return (
        isinstance(value, list)
        and 0 < len(value) <= 8
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 2 for v in value)
    )


# Well-known categorical knobs and the alternatives worth trying (scikit-learn's and PyTorch's names).
CHOICES: dict[str, list[list[str]]] = {
    "optimizer": [["adam", "adamw", "sgd", "rmsprop"], ["Adam", "AdamW", "SGD", "RMSprop"]],
    "optim": [["adam", "adamw", "sgd", "rmsprop"]],
    "activation": [["relu", "gelu", "tanh", "silu"], ["ReLU", "GELU", "Tanh", "SiLU"]],
    "criterion": [["gini", "entropy", "log_loss"], ["squared_error", "absolute_error", "friedman_mse"]],
    "kernel": [["rbf", "linear", "poly", "sigmoid"]],
    "penalty": [["l2", "l1", "elasticnet"]],
    "scheduler": [["cosine", "linear", "constant", "step"]],
    "weights": [["uniform", "distance"]],
    "max_features": [["sqrt", "log2"]],
}


def _choices(name: str, value: str) -> list[str] | None:
    """Return the alternatives of a well-known categorical knob whose current value is one of them."""
    return next((opts for opts in CHOICES.get(name.lower(), []) if value in opts), None)


def _name_of(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[-2] if parts[-1] in ("default", "value") and len(parts) > 1 else parts[-1]


def _range(name: str, v: float | int) -> dict[str, Any] | None:
    """Return a range for a knob from its kind (read from its name) and its current value."""
    if isinstance(v, int):
        if v <= 0:
            return None
        floor = 2 if re.search(r"min_samples_split", name, re.I) else 1
        lo, hi = max(floor, v // 4), max(v * 4, v + 2)
        return {"low": lo, "high": hi, "integer": True} | ({"log": True} if hi / lo >= 16 else {})
    if 0.0 <= v <= 1.0 and re.search(r"subsample|colsample|keep_prob", name, re.I):
        return {"low": 0.05, "high": 1.0}
    if 0.0 <= v < 1.0 and re.search(r"dropout|momentum|ratio|beta", name, re.I):
        return {"low": 0.0, "high": 0.95}
    if v <= 0:
        return None
    if re.search(r"(^|_)(lr|learning_rate|eta)$", name, re.I):  # learning rates: 1e-6 .. 1
        return {
            "low": float(f"{max(v / 100, 1e-6):.4g}"),
            "high": float(f"{min(v * 100, 1.0):.4g}"),
            "log": True,
        }
    # Regularization strengths and the rest: two decades each way (the optimum is often far).
    return {"low": float(f"{v / 100:.4g}"), "high": float(f"{v * 100:.4g}"), "log": True}


def draft(files: dict[str, str], name: str, goal: str = "", base: str = "") -> Choices:
    """Return a draft of a study's spec for a repository's text files (path -> content)."""
    c = Choices(name=slug(name), goal=goal.strip() or "TODO: say in one sentence what should improve")
    c.base = base
    if not goal.strip():
        c.notes.append("goal: none given; write what should improve (ideation reads it)")
    ev = _evaluator(files)
    try:
        ep = None if ev else entrypoints.find(files)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        ep = None
        c.notes.append(f"entry point: could not read how the repository is run ({type(exc).__name__}: {exc})")
    if ev is not None:
        _own_evaluator(c, ev, files[ev])
        c.sealed = _sealed(files)
        _goal_limits(c, _printed(files[ev]), ev)
    elif ep is not None:
        _adapter(c, ep, files)
        _goal_limits(c, ep.printed, ep.script)
    else:
        c.notes.append(
            "evaluator: no eval.py, evaluate.py or score.py, and no MLproject, Hydra app or train.py/main.py "
            'found; write one that prints a JSON line such as {"score": 0.9} and set evaluate.dev and evaluate.test'
        )
        c.sealed = _sealed(files)
    for folder in ("data", "datasets"):
        if any(p.startswith(folder + "/") for p in files):
            c.protected.append(f"{folder}/**")
            c.notes.append(f"protected: {folder}/** (the data the evaluator reads; no change may edit it)")
    if ep is None:
        c.notes.append(
            "sealed: "
            + ", ".join(c.sealed)
            + " (folders named like held-out data; only the gate's test runs see them)"
            if c.sealed
            else "sealed: nothing found that looks held out; list the held-out data's files in files.sealed"
        )
    sealed_prefixes = tuple(s.removesuffix("/**") + "/" for s in c.sealed)
    if ep is not None and ep.configs:
        configs = [p for p in ep.configs if p in files]
    elif ep is not None:
        configs = []
    else:
        configs = [p for p in sorted(files) if not NOT_CONFIG.search(p) and not p.startswith(sealed_prefixes)]
    _search_configs(c, files, configs, ep)
    if c.search:
        c.notes.append(
            "search: "
            + ", ".join(f"{k} = {fmt_value(v)}" for k, v in c.search.items())
            + " (knobs named like hyperparameters, ranged from their kind and current value; logging and "
            "saving knobs are never searched)"
        )
    else:
        c.notes.append(
            "search: no config key named like a hyperparameter; list keys under [search] or use the llm policy"
        )
    _environment(c, files, ev or (ep.script if ep else None))
    return c


CONDA_FILES = ("environment.yml", "environment.yaml", "conda.yaml", "conda.yml")
PIP_VENV = 'python -m venv "$GROVE_ENV" && "$GROVE_ENV/bin/pip" install'
INLINE = re.compile(r"(?m)^# /// script\s*$\n((?:^#(?: .*)?$\n)+?)^# ///\s*$")


def inline_dependencies(text: str) -> list[str] | None:
    """Return the dependencies of a script's inline metadata (`# /// script`, PEP 723), or None."""
    m = INLINE.search(text if text.endswith("\n") else text + "\n")
    if m is None:
        return None
    body = "\n".join(line[2:] if line.startswith("# ") else line[1:] for line in m.group(1).splitlines())
    try:
        deps = tomllib.loads(body).get("dependencies", [])
    except tomllib.TOMLDecodeError:
        return None
    return [d for d in deps if isinstance(d, str)] if isinstance(deps, list) else None


def _environment(c: Choices, files: dict[str, str], script: str | None) -> None:
    """Draft `[environment]` from the dependency files found (conda, pip, inline script metadata)."""
    network = (
        "downloading packages (network = true, which the operator allows with GROVE_SANDBOX_NETWORK=true)"
    )
    conda = next((p for p in CONDA_FILES if p in files), None)
    reqs = [p for p in ("requirements.txt", "pyproject.toml", "setup.py") if p in files]
    inline = inline_dependencies(files[script]) if script in files and script.endswith(".py") else None
    if conda:
        c.setup = (
            f'if command -v micromamba >/dev/null; then micromamba create -y -q -p "$GROVE_ENV" -f {conda}; '
            f'elif command -v conda >/dev/null; then conda env create -q -p "$GROVE_ENV" -f {conda}; '
            f'else echo "{conda} needs micromamba or conda where the study runs; neither is installed '
            '(install one, or set environment.setup to a pip install)" >&2; exit 127; fi'
        )
        if conda not in spec.ENV_INPUTS:
            c.env_inputs = [*spec.ENV_INPUTS, conda]
        c.notes.append(
            f"environment: {conda} found; the setup builds it with micromamba or conda (whichever the machine "
            f"has in the sandbox's view, e.g. /usr/local/bin; else it stops saying so), {network}"
        )
    elif reqs:
        c.setup = f"{PIP_VENV} -r requirements.txt" if reqs[0] == "requirements.txt" else f"{PIP_VENV} ."
        c.notes.append(
            f"environment: {reqs[0]} found; the setup installs it into the study's environment, {network}"
        )
    elif inline and script:
        c.setup = f"{PIP_VENV} " + " ".join(shlex.quote(d) for d in inline)
        c.env_inputs = [*spec.ENV_INPUTS, script]
        c.notes.append(
            f"environment: {script} declares its dependencies inline (# /// script); the setup installs "
            f"them ({', '.join(inline)}), rebuilt when {script} changes, {network}"
        )


def _printed(text: str) -> list[str]:
    """Return the metric-like names an evaluator prints: JSON keys and `name: value` texts."""
    keys = [m.group(1) for m in re.finditer(r"""["']([A-Za-z]\w*)["']\s*:""", text)]
    return list(dict.fromkeys([*keys, *entrypoints.printed_names(text)]))


def _goal_limits(c: Choices, names: list[str], where: str) -> None:
    """Turn the goal's bounds on metrics the evaluator prints into `[[constraints]]`."""
    for limit in goals.limits(c.goal, [n for n in names if n != c.metric]):
        bound = {k: v for k, v in (("min", limit.min), ("max", limit.max)) if v is not None}
        c.constraints.append({"name": limit.metric, "metric": limit.metric, **bound, "why": limit.phrase})
        said = " and ".join(f"{'≥' if k == 'min' else '≤'} {v:g}" for k, v in bound.items())
        c.notes.append(
            f"constraint: {limit.metric} {said}, from the goal's {limit.phrase!r} ({where} prints it)"
        )


def _own_evaluator(c: Choices, ev: str, text: str) -> None:
    """Draft the commands and metric for a repository that has its own evaluator script."""
    flag = re.search(r"""add_argument\(\s*["'](--[\w-]+)["'][^)]*choices""", text)
    names_test = bool(re.search(r"""["']test["']""", text) and re.search(r"""["']dev["']""", text))
    split = names_test and ("sys.argv" in text or flag is not None)
    arg = f"{flag.group(1)} " if flag and names_test else ""
    c.dev, c.test = (
        (f"python {ev} {arg}dev", f"python {ev} {arg}test") if split else (f"python {ev}", f"python {ev}")
    )
    c.protected = [ev]
    c.notes.append(
        f"evaluator: {ev}, the repository's own; it is protected, so no change may edit it"
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


def _direction(name: str) -> str | None:
    parts = name.split("_")
    for part in reversed(parts):
        if part in METRICS:
            return METRICS[part]
    return METRICS.get(name)


SPLIT_FOLDERS = ("grove/dev/", "grove/heldout/")


def _adapter(c: Choices, ep: entrypoints.EntryPoint, files: dict[str, str]) -> None:
    """Draft the adapter (grove_eval.py) that runs the entry point, its data split and its metric."""
    # Grove's own split (an earlier init's) is not data to split again: sealing it would hide dev rows.
    data = [p for p in entrypoints.data_files(files, ep) if not p.startswith(SPLIT_FOLDERS)]
    adapter: dict[str, Any] = {"entry": ep.kind, "command": ep.command, "data": data}
    if ep.params:
        adapter["params"] = "grove/params.json"
        c.writes["grove/params.json"] = json.dumps(ep.params, indent=2) + "\n"
        c.editable.append("grove/params.json")
    if ep.kind == entrypoints.Runner.HYDRA:
        adapter["hydra"] = True
    c.writes["grove/adapter.json"] = json.dumps(adapter, indent=2) + "\n"
    c.writes[entrypoints.ADAPTER] = entrypoints.adapter_source()
    c.dev, c.test = "python grove_eval.py dev", "python grove_eval.py test"
    c.protected = ["grove_eval.py", "grove/adapter.json", "grove/dev/**", "grove/heldout/**"]
    c.notes += ep.notes
    c.notes.append(
        f"evaluator: none in the repository (no eval.py, evaluate.py or score.py); grove_eval.py, an adapter "
        f"Grove writes, runs `{' '.join(ep.command)}` ({ep.kind}) and turns the numbers it prints into JSON"
        + ("; its values live in grove/params.json" if ep.params else "")
    )
    kept = []
    for path in data:
        dev_path, held_path = f"grove/dev/{path}", f"grove/heldout/{path}"
        if dev_path in files and held_path in files:  # the split an earlier init made stays as it is
            dev, held = files[dev_path], files[held_path]
            kept.append(path)
        else:
            dev, held = entrypoints.split_rows(path, files[path])
        c.writes[dev_path], c.writes[held_path] = dev, held
    if kept:
        c.notes.append(
            f"split: kept the split an earlier init made of {', '.join(kept)} (rows held out stay held out)"
        )
    if data:
        c.sealed = [*data, "grove/heldout/**"]
        c.notes.append(
            f"split: the rows of {', '.join(data)} are split 2:1 into grove/dev/ and grove/heldout/ (every third "
            "row held out); each run gets its split's copy in place, and the originals and the held-out rows "
            "are sealed, so only the gate's test runs see them"
        )
    else:
        c.notes.append("split: no data file found that the entry point reads; TODO: seal the held-out data")
    ranked = sorted(
        (n for n in ep.printed if _direction(n)),
        key=lambda n: 0 if n.startswith(("val", "valid", "dev")) else 2 if n.startswith("train") else 1,
    )
    if ranked:
        c.metric, c.direction = ranked[0], _direction(ranked[0]) or "maximize"
        c.notes.append(f"metric: {c.metric!r}, {c.direction}d, a name {ep.script} prints")
    else:
        c.notes.append(
            f"metric: 'score' (no known metric name printed by {ep.script}); TODO: name one it prints"
        )
    if ep.params:
        for param, value in ep.params.items():
            if HYPER.search(param) and not NOT_HYPER.search(param) and not isinstance(value, bool):
                dim = _range(param, value) if isinstance(value, int | float) else None
                if dim is None:
                    continue
                if param in ep.mlproject:
                    dim["targets"] = [f"grove/params.json:{param}", f"MLproject:{ep.mlproject[param]}"]
                    c.search[param] = dim
                    if "MLproject" not in c.editable:
                        c.editable.append("MLproject")
                    c.formats["MLproject"] = "yaml"
                else:
                    c.search[f"grove/params.json:{param}"] = dim


def _search_configs(
    c: Choices, files: dict[str, str], paths: list[str], ep: entrypoints.EntryPoint | None
) -> None:
    """Add [search] keys for the hyperparameter-like values of config files (Hydra groups as choices)."""
    hydra = ep.hydra if ep is not None else {}
    when: dict[str, dict[str, Any]] = {}
    if hydra:
        try:
            doc = configfiles.load(hydra["main"], files[hydra["main"]], "yaml")
        except configfiles.ConfigFormatError as exc:
            c.notes.append(
                f"search: {hydra['main']} does not parse as YAML ({exc}); its groups are not searched"
            )
            doc = None
        defaults = doc.get("defaults") if isinstance(doc, dict) else None
        for item in defaults if isinstance(defaults, list) else []:
            if isinstance(item, dict) and len(item) == 1:
                group, chosen = next(iter(item.items()))
                options = hydra["groups"].get(group, [])
                if isinstance(group, str) and chosen in options and len(options) > 1:
                    key = f"{hydra['main']}:defaults.{group}"
                    c.search[key] = {"values": options}
                    c.editable.append(hydra["main"])
                    for option in options:
                        when[f"{hydra['dir']}/{group}/{option}.yaml"] = {key: option}
    scored: list[tuple[int, str, str, Any, configfiles.Format]] = []
    for path in paths:
        text = files[path]
        suffix = PurePosixPath(path).suffix.lower()
        if path.lower().endswith(CODE) or (suffix not in configfiles.FORMATS and suffix):
            continue
        try:
            fmt = configfiles.file_format(path, text)
            doc = configfiles.load(path, text, fmt)
        except configfiles.ConfigFormatError:
            continue
        if hydra and isinstance(doc, dict):
            doc = {k: v for k, v in doc.items() if k not in ("defaults", "hydra")}
        for dotted, value in _leaves(doc, "", []):
            key_name = _name_of(dotted)
            if NOT_HYPER.search(key_name):
                continue
            if isinstance(value, str) or HYPER.search(key_name) or HYPER.search(dotted.split(".")[-1]):
                scored.append(
                    (0 if isinstance(value, str) or HYPER.search(key_name) else 1, path, dotted, value, fmt)
                )
    chosen = sorted(scored, key=lambda t: (t[0], t[1], t[2]))[: MAX_KEYS + len(when)]
    for _, path, dotted, value, fmt in chosen:
        dim: dict[str, Any] | None
        if isinstance(value, str):
            options = _choices(dotted.rsplit(".", 1)[-1], value)
            dim = {"values": options} if options else None
        elif isinstance(value, list):  # layer sizes: halved, as they are, doubled
            dim = {"values": [[max(1, v // 2) for v in value], value, [v * 2 for v in value]]}
        else:
            dim = _range(_name_of(dotted), value)
        if dim is None:
            continue
        if path in when:
            dim["when"] = when[path]
        c.search[f"{path}:{dotted}"] = dim
        if path not in c.editable:
            c.editable.append(path)
        if not PurePosixPath(path).suffix:
            c.formats[path] = fmt
    c.editable = list(dict.fromkeys(c.editable))
