"""How a repository is run: its MLproject, Hydra app or argparse script, read from the code.

`find(files)` returns the entry point `grove init` wraps in the evaluator adapter
(`agents/grove_eval.py`): the command with a `{name}` slot per searched value, the values'
current defaults, the config files the run reads, and the metric names its code prints.
"""

from __future__ import annotations

import ast
import functools
import json
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from agents import configfiles

ADAPTER, ADAPTER_CONFIG = "grove_eval.py", "grove/adapter.json"
SCRIPTS = ("train.py", "main.py", "run.py", "src/train.py", "scripts/train.py")
CONFIG_ARG = re.compile(r"conf|cfg|yaml|yml|param|setting|hparam", re.IGNORECASE)
ROWS = (".csv", ".tsv", ".jsonl", ".txt")
NAME = re.compile(r"(?<![\w.])([A-Za-z][\w./-]*(?: [A-Za-z][\w./-]*){0,2})\s*[:=]\s*(?:%|\{|$)")


class Runner(StrEnum):
    """How an entry point is run and where its parameters come from."""

    MLPROJECT = "mlproject"
    HYDRA = "hydra"
    ARGPARSE = "argparse"
    CLICK = "click"
    TYPER = "typer"
    SCRIPT = "script"


@dataclass
class EntryPoint:
    """A repository's training entry point, as the adapter runs it."""

    kind: Runner
    script: str
    command: list[str]
    params: dict[str, Any] = field(default_factory=dict)  # name -> current value, for `{name}` slots
    mlproject: dict[str, str] = field(default_factory=dict)  # param name -> its MLproject key
    configs: list[str] = field(default_factory=list)  # config files the run reads
    hydra: dict[str, Any] = field(default_factory=dict)  # main config, groups -> options
    printed: list[str] = field(default_factory=list)  # metric-like names the code prints
    notes: list[str] = field(default_factory=list)


@functools.cache
def adapter_source() -> str:
    """Return the text of the evaluator adapter `grove init` writes into a repository."""
    return Path(__file__).with_name(ADAPTER).read_text("utf-8")


def adapter_settings(config_text: str) -> dict[str, Any]:
    """Return an adapter's `grove/adapter.json`; ValueError unless it names a command to run."""
    settings = json.loads(config_text)
    command = settings.get("command") if isinstance(settings, dict) else None
    if not isinstance(command, list) or not command or not all(isinstance(w, str) for w in command):
        raise ValueError(f"{ADAPTER_CONFIG}: command must be a non-empty list of strings")
    return dict(settings)


def metric_name(raw: str) -> str:
    """Return a printed name as the adapter keys it (`Val Acc` -> `val_acc`)."""
    return re.sub(r"[^a-z0-9]+", "_", raw.strip().lower()).strip("_")


def printed_names(text: str) -> list[str]:
    """Return the names a script's string literals print before a value (`"RMSE: %s"`, f"acc={a}")."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for m in NAME.finditer(node.value):
                name = metric_name(m.group(1))
                if name and name not in names:
                    names.append(name)
    return names


def _const(node: ast.expr | None) -> Any:
    return node.value if isinstance(node, ast.Constant) else None


def _text(node: ast.expr | None) -> str:
    value = _const(node)
    return value if isinstance(value, str) else ""


def _kwargs(call: ast.Call) -> dict[str, ast.expr]:
    return {k.arg: k.value for k in call.keywords if k.arg}


def _mlproject(files: dict[str, str]) -> EntryPoint | None:
    try:
        doc = configfiles.load("MLproject", files["MLproject"], "yaml")
    except configfiles.ConfigFormatError:
        return None
    points = doc.get("entry_points") if isinstance(doc, dict) else None
    if not isinstance(points, dict) or not points:
        return None
    name = "main" if "main" in points else next(iter(points))
    point = points[name]
    if not isinstance(point, dict) or not isinstance(point.get("command"), str):
        return None
    try:
        command = shlex.split(point["command"])
    except ValueError:
        return None
    script = next((t for t in command if t.endswith(".py")), "")
    ep = EntryPoint(Runner.MLPROJECT, script, command)
    params = point.get("parameters") or {}
    for param, spec in params.items() if isinstance(params, dict) else []:
        default = spec.get("default") if isinstance(spec, dict) else None
        if default is None:
            ep.notes.append(
                f"MLproject parameter {param!r} has no default; the adapter leaves {{{param}}} as is"
            )
            continue
        ep.params[param] = default
        ep.mlproject[param] = f"entry_points.{name}.parameters.{param}.default"
    ep.notes.append(f"MLproject entry point {name!r}: `{point['command']}`")
    return ep


def _hydra(path: str, text: str, files: dict[str, str]) -> EntryPoint | None:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            if not isinstance(deco, ast.Call):
                continue
            f = deco.func
            if not (
                isinstance(f, ast.Attribute) and f.attr == "main" and getattr(f.value, "id", "") == "hydra"
            ):
                continue
            kw = _kwargs(deco)
            conf_dir = posixpath.normpath(
                posixpath.join(posixpath.dirname(path), _text(kw.get("config_path")) or ".")
            )
            main = posixpath.normpath(
                posixpath.join(conf_dir, f"{_text(kw.get('config_name')) or 'config'}.yaml")
            )
            if main not in files:
                return None
            ep = EntryPoint(Runner.HYDRA, path, ["python", path], configs=[main])
            groups: dict[str, list[str]] = {}
            for p in sorted(files):
                parts = p[len(conf_dir) + 1 :].split("/") if p.startswith(conf_dir + "/") else []
                if len(parts) == 2 and parts[1].endswith((".yaml", ".yml")):
                    groups.setdefault(parts[0], []).append(parts[1].rsplit(".", 1)[0])
            ep.hydra = {"main": main, "dir": conf_dir, "groups": groups}
            ep.configs += [f"{conf_dir}/{g}/{o}.yaml" for g, opts in groups.items() for o in opts]
            ep.notes.append(f"Hydra app {path} (config {main}; groups: {', '.join(groups) or 'none'})")
            return ep
    return None


@dataclass(frozen=True)
class _Arg:
    flags: list[str]  # ["--lr"], or ["config"] for a positional
    default: Any
    required: bool

    @property
    def positional(self) -> bool:
        return not self.flags[0].startswith("-")


def _argparse_args(tree: ast.AST) -> list[_Arg]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags = [a for a in (_const(x) for x in node.args) if isinstance(a, str)]
            kw = _kwargs(node)
            if flags:
                out.append(_Arg(flags, _const(kw.get("default")), _const(kw.get("required")) is True))
    return out


def _click_args(tree: ast.AST) -> list[_Arg]:
    out = []
    for node in ast.walk(tree):
        f = node.func if isinstance(node, ast.Call) else None
        if not (isinstance(f, ast.Attribute) and getattr(f.value, "id", "") == "click"):
            continue
        assert isinstance(node, ast.Call)
        names = [a for a in (_const(x) for x in node.args) if isinstance(a, str)]
        kw = _kwargs(node)
        if f.attr == "option" and any(n.startswith("--") for n in names):
            flag = next(n for n in names if n.startswith("--"))
            out.append(_Arg([flag], _const(kw.get("default")), _const(kw.get("required")) is True))
        elif f.attr == "argument" and names:
            out.append(_Arg([names[0]], _const(kw.get("default")), "default" not in kw))
    return out


def _typer_args(tree: ast.AST) -> list[_Arg]:
    """Return the parameters of the functions typer runs (`typer.run(f)`, `@app.command()`)."""
    run = {
        a.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "run"
        and getattr(n.func.value, "id", "") == "typer"
        for a in n.args
        if isinstance(a, ast.Name)
    }
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        commands = any(
            isinstance(d, ast.Call) and getattr(d.func, "attr", "") in ("command", "callback")
            for d in fn.decorator_list
        )
        if fn.name not in run and not commands:
            continue
        args = [*fn.args.posonlyargs, *fn.args.args]
        defaults: list[ast.expr | None] = [None] * (len(args) - len(fn.args.defaults)) + list(
            fn.args.defaults
        )
        for arg, default in zip(args, defaults, strict=True):
            flag = "--" + arg.arg.replace("_", "-")
            if isinstance(default, ast.Call) and getattr(default.func, "attr", "") in ("Option", "Argument"):
                called = getattr(default.func, "attr", "")
                names = [a for a in (_const(x) for x in default.args[1:]) if isinstance(a, str)]
                first = _const(default.args[0]) if default.args else _const(_kwargs(default).get("default"))
                required = (
                    bool(default.args)
                    and isinstance(default.args[0], ast.Constant)
                    and default.args[0].value is Ellipsis
                )
                if called == "Argument":
                    out.append(_Arg([arg.arg], None if required else first, required))
                else:
                    long = next((n for n in names if n.startswith("--")), flag)
                    out.append(_Arg([long], None if required else first, required))
            elif default is None:
                out.append(_Arg([arg.arg], None, True))
            else:
                out.append(_Arg([flag], _const(default), False))
    return out


def _script(path: str, text: str, files: dict[str, str]) -> EntryPoint:
    """Return how a training script is run, from its argparse, click or typer parameters."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return EntryPoint(Runner.SCRIPT, path, ["python", path])
    kinds = [(Runner.ARGPARSE, _argparse_args), (Runner.CLICK, _click_args), (Runner.TYPER, _typer_args)]
    kind, args = next(((k, got) for k, read in kinds if (got := read(tree))), (Runner.SCRIPT, []))
    ep = EntryPoint(kind, path, ["python", path])
    configs = _config_files(files)
    for arg in args:
        flags, default = arg.flags, arg.default
        dest = flags[-1].lstrip("-").replace("-", "_")
        if (arg.positional or arg.required) and default is None:
            if CONFIG_ARG.search(dest) and configs:
                ep.command += ([] if arg.positional else [flags[0]]) + [configs[0]]
                ep.configs.append(configs[0])
                ep.notes.append(f"{path} needs {flags[0]}: given the config file {configs[0]}")
            else:
                ep.command += ([] if arg.positional else [flags[0]]) + ["TODO"]
                ep.notes.append(f"{path} needs {flags[0]}; TODO: say what to pass in grove/adapter.json")
        elif not arg.positional and isinstance(default, int | float) and not isinstance(default, bool):
            ep.params[dest] = default
            ep.command += [flags[0], f"{{{dest}}}"]
    return ep


def _config_files(files: dict[str, str]) -> list[str]:
    found = [p for p in files if p.endswith((".yaml", ".yml", ".json", ".toml")) and "/." not in f"/{p}"]
    found = [p for p in found if posixpath.basename(p) not in ("MLproject", "grove.toml", "pyproject.toml")]
    return sorted(found, key=lambda p: (p.count("/"), "conf" not in p.lower() and "param" not in p, p))


def find(files: dict[str, str]) -> EntryPoint | None:
    """Return how the repository is run, from its MLproject, Hydra app or training script."""
    ep: EntryPoint | None = None
    if "MLproject" in files:
        ep = _mlproject(files)
    if ep is None:
        for path in sorted(p for p in files if p.endswith(".py") and "hydra.main" in files[p]):
            ep = _hydra(path, files[path], files)
            if ep:
                break
    if ep is None:
        script = next((s for s in SCRIPTS if s in files), None)
        if script is None:
            return None
        ep = _script(script, files[script], files)
    if ep.script in files:
        ep.printed = printed_names(files[ep.script])
    return ep


def data_files(files: dict[str, str], ep: EntryPoint) -> list[str]:
    """Return the row files (CSV, TSV, JSON lines, text) the entry point reads: named in its code or
    configs, or kept under a data folder."""
    said = "\n".join(files.get(p, "") for p in [ep.script, *ep.configs, "MLproject"])
    out = []
    for p in sorted(files):
        if not p.lower().endswith(ROWS) or p.lower().startswith(("readme", "requirements", "license")):
            continue
        if posixpath.basename(p) in said or p.split("/")[0] in ("data", "datasets"):
            out.append(p)
    return out


def split_rows(path: str, text: str, every: int = 3) -> tuple[str, str]:
    """Split a row file into (dev, held-out): every `every`-th row held out, a CSV/TSV header kept in both."""
    lines = text.splitlines(keepends=True)
    head: list[str] = []
    if path.lower().endswith((".csv", ".tsv")) and lines:
        cells = re.split(r"[,\t;]", lines[0].strip())
        if any(c and not re.fullmatch(r"[-+]?[\d.eE+-]+", c.strip().strip('"')) for c in cells):
            head, lines = lines[:1], lines[1:]
    held = [ln for i, ln in enumerate(lines) if i % every == every - 1]
    dev = [ln for i, ln in enumerate(lines) if i % every != every - 1]
    return "".join(head + dev), "".join(head + held)
