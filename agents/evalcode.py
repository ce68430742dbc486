"""Whether a sealed-test command runs code a change may edit, found by reading the repository, not running it.

The one-command sealed test runs beside the held-out labels: if it imports or executes a file in
`files.editable`, a candidate can read the labels and report a perfect score. The two-phase form
(`test_predict`, then `test_score` on protected files only) keeps candidate code away from them.
Python imports are followed statically from the files a command names; what cannot be followed
(a shell script, a dynamic import) is reported as unknown, never as safe.
"""

from __future__ import annotations

import ast
import posixpath
import shlex
from collections.abc import Callable, Iterable

from agents import configfiles, entrypoints, globs
from agents.spec import Level, Spec

SHELL_WORDS = frozenset({"&&", "||", ";", "|", "&", "(", ")"})
# Calls that import, execute or start something named at run time: whatever they reach is unknown.
DYNAMIC = frozenset({"import_module", "__import__", "exec", "eval", "compile", "run_path", "run_module",
                     "load_source", "exec_module", "spec_from_file_location", "system", "popen", "Popen",
                     "check_call", "check_output", "execv", "execvp", "execl", "execlp", "spawnv", "spawnl"})  # fmt: skip
# `module.call` pairs that do the same: `subprocess.run`, and unpickling (which imports and calls
# whatever the pickle names, e.g. a candidate's output read by the scorer).
DYNAMIC_OF = {"subprocess": {"run", "call"}, "pickle": {"load", "loads"}, "joblib": {"load"},
              "dill": {"load", "loads"}, "cloudpickle": {"load", "loads"}, "torch": {"load"}}  # fmt: skip
DATA = frozenset({".yaml", ".yml", ".json", ".toml", ".ini", ".cfg", ".csv", ".tsv", ".jsonl", ".txt"})
Finding = tuple[str, str, Level]  # (dotted key, message, level)


def findings(spec: Spec, files: list[str], read: Callable[[str], str]) -> list[Finding]:
    """Return what the sealed-test commands would run of the editable files (errors) or cannot tell (warnings)."""
    ev = spec.evaluate
    if ev.two_phase:
        key, command, hint = (
            "evaluate.test_score",
            ev.test_score,
            "the score phase must run protected code only",
        )
    else:
        key, command = "evaluate.test", ev.test
        hint = (
            "it runs beside the sealed files, so a candidate could read them: split it into "
            "evaluate.test_predict (the candidate's code, without the labels) and evaluate.test_score"
        )
    # Grove's adapter is trusted to run what its settings name only while neither can be edited.
    trusted = not any(
        globs.match_any(spec.files.editable, p) for p in (entrypoints.ADAPTER, entrypoints.ADAPTER_CONFIG)
    )
    reached, unknown = _reach(command, set(files), read, trusted)
    # Under the search policy a change edits config files only at its [search] keys, to values the
    # spec lists or ranges: settings, not code. Any other change to what the test reads counts.
    settings_only = not spec.capabilities.edits_code
    editable = sorted(
        p
        for p in reached
        if globs.match_any(spec.files.editable, p)
        and not (settings_only and (p in spec.files.formats or configfiles.suffix_format(p)))
    )
    out: list[Finding] = []
    if editable:
        out.append(
            (
                key,
                f"runs {', '.join(editable[:5])}, which files.editable lets a change rewrite; {hint}",
                Level.ERROR,
            )
        )
    elif unknown and not ev.two_phase:
        out.append(
            (key, f"cannot tell whether it runs code a change may edit ({unknown[0]}); {hint}", Level.WARNING)
        )
    elif unknown:
        out.append(
            (key, f"cannot tell what it runs ({unknown[0]}); keep it to protected files", Level.WARNING)
        )
    return out


def _reach(
    command: str, present: set[str], read: Callable[[str], str], trusted: bool = False, nested: bool = False
) -> tuple[set[str], list[str]]:
    """Return the repository files a command runs (named, imported) and what could not be followed."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return set(), [f"cannot parse {command!r}"]
    todo: list[tuple[str, str]] = []  # (path, the folder its own imports are resolved from)
    inline: dict[str, str] = {}  # `python -c` code, by a name of its own
    data: set[str] = set()
    unknown: list[str] = []
    named_code = False
    for i, word in enumerate(words):
        if word in SHELL_WORDS:
            continue
        path = posixpath.normpath(word.removeprefix("./"))
        if path in present and posixpath.splitext(path)[1].lower() in DATA:
            data.add(path)  # a config or data file the command reads, not code it runs
            continue
        if path in present:
            named_code = named_code or path.endswith(".py")
            todo.append((path, posixpath.dirname(path)))
            if not path.endswith(".py"):
                unknown.append(f"{path} is not Python")
        elif i > 0 and words[i - 1] == "-m":
            named_code = True
            todo += [(p, "") for p in _module(word, "", present)]
            main = posixpath.join(*word.split("."), "__main__.py")
            if main in present:  # `python -m package` runs its __main__
                todo.append((main, ""))
        elif i > 0 and words[i - 1] == "-c":
            named_code = True
            inline[f"<-c {len(inline)}>"] = word
            todo.append((f"<-c {len(inline) - 1}>", ""))
    if not named_code and not todo:
        unknown.append("it names no Python file of the repository")
    reached: set[str] = set()
    while todo:
        path, home = todo.pop()
        if path in reached:
            continue
        reached.add(path)
        if not path.endswith(".py") and path not in inline:
            continue
        try:
            text = inline[path] if path in inline else read(path)
            if (
                path == entrypoints.ADAPTER
                and trusted
                and text == entrypoints.adapter_source()
                and not nested
            ):
                # Grove's own adapter runs what its settings name, and nothing else; a Hydra app
                # also reads its YAML configs as code (`_target_`, callbacks), so they count too.
                settings = entrypoints.adapter_settings(read(entrypoints.ADAPTER_CONFIG))
                ran, unsure = _reach(shlex.join(settings["command"]), present, read, False, True)
                reached |= ran
                unknown += unsure
                if settings.get("hydra"):
                    reached |= {p for p in present if p.endswith((".yaml", ".yml"))}
                continue
            tree = ast.parse(text)
        except (SyntaxError, ValueError, OSError, UnicodeDecodeError) as exc:
            unknown.append(f"cannot read {path}: {type(exc).__name__}")
            continue
        for name, level in _imports(tree):
            base = home if level == 0 else posixpath.join(posixpath.dirname(path), *[".."] * (level - 1))
            for found in _module(name, base, present) + ([] if level else _module(name, "", present)):
                todo.append((found, home))
        dynamic = _dynamic(tree)
        if dynamic:
            unknown.append(f"{path} calls {dynamic}")
    return (reached | data) - set(inline), unknown


def _imports(tree: ast.AST) -> Iterable[tuple[str, int]]:
    """Yield every imported module name (with its relative level), and `from m import x` as m.x too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, 0
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod or node.level:
                yield mod, node.level
            for alias in node.names:
                yield f"{mod}.{alias.name}" if mod else alias.name, node.level


def _module(name: str, base: str, present: set[str]) -> list[str]:
    """Return the files importing `name` from `base` runs: each package's `__init__.py` and the module."""
    parts = [p for p in name.split(".") if p]
    out = []
    for i in range(1, len(parts) + 1):
        stem = posixpath.normpath(posixpath.join(base, *parts[:i]))
        for candidate in (f"{stem}.py", f"{stem}/__init__.py"):
            if candidate in present:
                out.append(candidate)
    return out


def _dynamic(tree: ast.AST) -> str:
    """Return the first call that imports or executes something by a computed name, or ''."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            if name in DYNAMIC or name in DYNAMIC_OF.get(owner, ()):
                return f"{owner + '.' if owner else ''}{name}()"
    return ""
