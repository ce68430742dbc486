"""The executor's tools, confined to one worktree.

Every path is resolved inside the worktree (no absolute paths, no `..` out, no symlinks out);
writes outside `files.editable` are refused with an observation the model can act on.
"""

from __future__ import annotations

import json
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import regex

from agents import globs
from agents.llm.model import fatal

MAX_READ = 20_000
MAX_LIST = 400
MAX_FILE = 5_000_000  # bytes: larger files are not read into Grove's process
RUN_TIMEOUT = 300.0  # seconds: the longest one `run` command may take
GREP_SECONDS = 5.0  # a pattern with catastrophic backtracking gets this long, in all


class Submitted(Exception):
    """The executor called finish(report)."""

    def __init__(self, report: str) -> None:
        super().__init__(report)
        self.report = report


class ToolRefused(Exception):
    """A tool call that breaks the rules; the message goes back to the model."""


class Observation(NamedTuple):
    """What a tool call gave back: the text the model reads, and whether the call did what it asked."""

    text: str
    ok: bool = True  # False: an error, a refusal, or a dev evaluation that failed


class Runtime(Protocol):
    """Commands and dev evaluations, run by the host in its sandbox."""

    def run(self, command: str, timeout: float) -> tuple[int | None, str]: ...

    def evaluate_dev(self) -> Observation: ...

    # A runtime may also offer `diff() -> str`: finish() then shows it once and asks for confirmation.


SCHEMAS: list[dict[str, Any]] = [
    {"name": "list", "description": "List a directory of the worktree.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}},
    {"name": "read", "description": "Read a file (with line numbers).",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "start": {"type": "integer"},
                                                     "end": {"type": "integer"}}, "required": ["path"]}},
    {"name": "write", "description": "Create or overwrite an editable file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                    "required": ["path", "content"]}},
    {"name": "edit", "description": "Replace one exact occurrence of `search` with `replace` in an editable file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "search": {"type": "string"},
                                                     "replace": {"type": "string"}},
                    "required": ["path", "search", "replace"]}},
    {"name": "grep", "description": "Search files for a regular expression.",
     "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
                    "required": ["pattern"]}},
    {"name": "run", "description": "Run a shell command in the worktree (sandboxed, no network secrets).",
     "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
                    "required": ["command"]}},
    {"name": "evaluate_dev", "description": "Run the development evaluation on the current files.",
     "parameters": {"type": "object", "properties": {}}},
    {"name": "finish", "description": "Stop and report what you changed and what you observed.",
     "parameters": {"type": "object", "properties": {"report": {"type": "string"}}, "required": ["report"]}},
]  # fmt: skip

TOOLS = [{"type": "function", "function": s} for s in SCHEMAS]


_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float)}


def check_arguments(name: str, args: dict[str, Any]) -> str:
    """Return what is wrong with a tool call's arguments against its schema, or ""."""
    schema = next((s["parameters"] for s in SCHEMAS if s["name"] == name), None)
    if schema is None:
        return ""
    props: dict[str, dict[str, str]] = schema.get("properties", {})
    unknown = sorted(set(args) - set(props))
    if unknown:
        return f"unknown argument(s) {', '.join(unknown)}; {name} takes {', '.join(props) or 'none'}"
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        return f"missing required argument(s) {', '.join(missing)}"
    for key, value in args.items():
        want = props[key]["type"]
        if value is not None and (isinstance(value, bool) or not isinstance(value, _TYPES[want])):
            return (
                f"`{key}` must be {'an' if want == 'integer' else 'a'} {want}, got {json.dumps(value)[:80]}"
            )
    return ""


def resolve_inside(root: Path, rel: str) -> Path:
    """Resolve a model-given path inside `root`, or raise ToolRefused."""
    if not isinstance(rel, str) or not rel.strip():
        raise ToolRefused("path must be a non-empty relative path")
    if rel.startswith(("/", "~")):
        raise ToolRefused(f"{rel}: absolute paths are not allowed; use a path relative to the worktree")
    base = root.resolve()
    target = (base / rel).resolve()
    if not target.is_relative_to(base):
        raise ToolRefused(f"{rel}: resolves outside the worktree")
    if ".git" in target.relative_to(base).parts:
        raise ToolRefused(f"{rel}: the git directory is off limits")
    return target


@dataclass
class Toolbox:
    root: Path
    editable: list[str]
    runtime: Runtime
    run_timeout: float = RUN_TIMEOUT
    _shown: bool = False  # finish() has shown the change once

    def call(self, name: str, args: dict[str, Any]) -> str:
        """Run one tool and return the text of its observation (refusals included)."""
        return self.act(name, args).text

    def act(self, name: str, args: dict[str, Any]) -> Observation:
        """Run one tool and return its observation, with whether it did what was asked."""
        fn = getattr(self, f"t_{name}", None)
        if fn is None:
            return Observation(
                f"error: unknown tool {name!r}; tools are " + ", ".join(s["name"] for s in SCHEMAS), False
            )
        problem = check_arguments(name, args)
        if problem:
            return Observation(f"error: bad arguments for {name}: {problem}", False)
        try:
            out = fn(**args)
        except Submitted:
            raise
        except ToolRefused as exc:
            return Observation(f"refused: {exc}", False)
        except Exception as exc:  # whatever a tool raises is the model's observation, never the node's end
            if fatal(exc):  # but a worker's time limit ends the run
                raise
            return Observation(f"error: {name} failed: {type(exc).__name__}: {exc}", False)
        text, ok = out if isinstance(out, Observation) else (str(out), True)
        # File names need not be UTF-8: escape what would not survive the trip to the model.
        return Observation(text.encode("utf-8", "backslashreplace").decode("utf-8"), ok)

    def _text(self, target: Path, rel: str) -> str:
        """Return a regular file's text, refusing FIFOs, devices and files too large to read."""
        st = target.stat()
        if not stat.S_ISREG(st.st_mode):
            raise ToolRefused(f"{rel}: not a regular file")
        if st.st_size > MAX_FILE:
            raise ToolRefused(f"{rel}: {st.st_size} bytes is too large to read (limit {MAX_FILE})")
        return target.read_text("utf-8")

    def _rel(self, path: Path) -> str:
        return path.relative_to(self.root.resolve()).as_posix()

    def _writable(self, rel: str) -> Path:
        target = resolve_inside(self.root, rel)
        if not globs.match_any(self.editable, self._rel(target)):
            raise ToolRefused(
                f"{rel} is not editable; you may change only files matching {', '.join(self.editable)}"
            )
        if target.exists() and not stat.S_ISREG(target.stat().st_mode):
            raise ToolRefused(f"{rel}: not a regular file")
        return target

    def t_list(self, path: str = ".") -> str:
        target = resolve_inside(self.root, path) if path not in ("", ".") else self.root.resolve()
        if not target.is_dir():
            raise ToolRefused(f"{path}: not a directory")
        items = sorted(p for p in target.iterdir() if p.name != ".git")
        out = [self._rel(p) + ("/" if p.is_dir() else "") for p in items[:MAX_LIST]]
        return "\n".join(out) or "(empty)"

    def t_read(self, path: str, start: int = 1, end: int | None = None) -> str:
        target = resolve_inside(self.root, path)
        if not target.is_file():
            raise ToolRefused(f"{path}: no such file")
        lines = self._text(target, path).splitlines()
        chunk = lines[max(start, 1) - 1 : end]
        text = "\n".join(f"{i}\t{line}" for i, line in enumerate(chunk, start=max(start, 1)))
        return text[:MAX_READ] + ("\n[truncated]" if len(text) > MAX_READ else "")

    def t_write(self, path: str, content: str) -> str:
        target = self._writable(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, "utf-8")
        return f"wrote {path} ({len(content)} characters)"

    def t_edit(self, path: str, search: str, replace: str) -> str:
        target = self._writable(path)
        if not target.is_file():
            raise ToolRefused(f"{path}: no such file")
        text = self._text(target, path)
        count = text.count(search) if search else 0
        if count != 1:
            raise ToolRefused(f"{path}: `search` must match exactly once, it matches {count} times")
        target.write_text(text.replace(search, replace, 1), "utf-8")
        return f"edited {path}"

    def t_grep(self, pattern: str, path: str = ".") -> str:
        try:
            rx = regex.compile(pattern)
        except regex.error as exc:
            raise ToolRefused(f"bad regular expression: {exc}") from None
        root = self.root.resolve()
        base = resolve_inside(self.root, path) if path not in ("", ".") else root
        candidates = [base] if base.is_file() else sorted(base.rglob("*"))
        # Links are skipped: one in the tree may point anywhere on Grove's machine.
        files = [p for p in candidates if p.is_file() and not p.is_symlink() and ".git" not in p.parts]
        hits: list[str] = []
        deadline = time.monotonic() + GREP_SECONDS
        for f in files:
            try:
                st = f.stat()
                if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE:
                    continue
                for i, line in enumerate(f.read_text("utf-8").splitlines(), 1):
                    left = deadline - time.monotonic()
                    if left <= 0 or rx.search(line, timeout=left):
                        if left <= 0:
                            raise TimeoutError
                        hits.append(f"{self._rel(f)}:{i}: {line[:200]}")
            except TimeoutError:  # before OSError, its base class
                return "\n".join(
                    [*hits[:200], f"[grep stopped: the pattern took over {GREP_SECONDS:g} s; simplify it]"]
                )
            except (UnicodeDecodeError, OSError):
                continue
            if len(hits) >= 200:
                break
        return "\n".join(hits[:200]) or "no matches"

    def t_run(self, command: str, timeout: float | None = None) -> str:
        code, output = self.runtime.run(command, min(float(timeout or self.run_timeout), self.run_timeout))
        status = "timed out" if code is None else f"exit code {code}"
        return f"{status}\n{output}"

    def t_evaluate_dev(self) -> Observation:
        return self.runtime.evaluate_dev()

    def t_finish(self, report: str = "") -> str:
        diff = getattr(self.runtime, "diff", None)
        if diff is None or self._shown:
            raise Submitted(report)
        self._shown = True
        change = diff()
        if not change.strip():
            return (
                "Your change is empty: nothing differs from where you started, and an empty change fails "
                "the node. Make the change, or call finish(report) again to end anyway."
            )
        return (
            f"Before you finish, check your change:\n{change[:MAX_READ]}\n"
            "Call finish(report) again to confirm it, or keep working."
        )
