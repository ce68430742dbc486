"""Tasks for on-policy distillation, and their checkers run on a sampled answer in Grove's sandbox.

A tasks file is JSONL, one task per line:

    {"prompt": "Write add(a, b) in Python.\\n", "check": "python test_add.py",
     "answer_file": "add.py", "files": {"test_add.py": "from add import add\\nassert add(2, 2) == 4\\n"}}

The student's answer is written to `answer_file` (default `answer.txt`) in a fresh tree holding
`files`, and `check` runs there in the sandbox: exit 0 passes; otherwise the end of its output is
the answer's textual feedback. The answer is model output, so it is treated as hostile like any
code Grove runs.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from backend.core.config import Settings
from backend.engine import sandbox
from backend.engine.workspace import isolation_of

FEEDBACK_CHARS = 1500


class TaskError(ValueError):
    """A tasks file is malformed (the message names the line and the key)."""


def _safe(name: Any, what: str) -> PurePosixPath:
    parts = str(name).split("/")
    if not isinstance(name, str) or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise TaskError(f"{what}: {name!r} must be a relative path of a file inside the task's folder")
    return PurePosixPath(name)


def load_tasks(path: Path) -> list[dict[str, Any]]:
    """Read and check a tasks file; raise TaskError naming the line and key of the first problem."""
    tasks = []
    for n, line in enumerate(path.read_text("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskError(f"line {n}: not JSON ({exc.msg})") from None
        if not isinstance(task, dict):
            raise TaskError(f"line {n}: a task is a JSON object")
        for key in ("prompt", "check"):
            if not isinstance(task.get(key), str) or not task[key].strip():
                raise TaskError(f"line {n}: `{key}` must be a non-empty string")
        unknown = set(task) - {"prompt", "check", "answer_file", "files"}
        if unknown:
            raise TaskError(
                f"line {n}: unknown keys {sorted(unknown)} (known: prompt, check, answer_file, files)"
            )
        answer = _safe(task.get("answer_file", "answer.txt"), f"line {n}: `answer_file`")
        files = task.get("files", {})
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise TaskError(f"line {n}: `files` maps relative paths to their text")
        paths = [answer, *(_safe(name, f"line {n}: `files`") for name in files)]
        folders = {parent for p in paths for parent in p.parents}
        clash = next((p for p in paths if p in folders or paths.count(p) > 1), None)
        if clash is not None:
            raise TaskError(f"line {n}: {str(clash)!r} is named twice, or both as a file and as a folder")
        tasks.append(task)
    if not tasks:
        raise TaskError("the file holds no task")
    return tasks


class Checker:
    """Runs one task's check on an answer in the sandbox; returns (passed, feedback)."""

    def __init__(self, settings: Settings, task: dict[str, Any], timeout: float) -> None:
        self.task, self.timeout = task, timeout
        self.isolation = isolation_of(settings)
        sandbox.check(self.isolation)  # no box here: refuse, rather than report every answer failed
        self.scratch = settings.data_dir / "learning" / "checks"

    def __call__(self, answer: str) -> tuple[bool, str]:
        """Check one answer."""
        self.scratch.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="check-", dir=self.scratch))
        try:
            tree = tmp / "tree"
            for name, text in {
                **self.task.get("files", {}),
                self.task.get("answer_file", "answer.txt"): answer,
            }.items():
                (tree / name).parent.mkdir(parents=True, exist_ok=True)
                (tree / name).write_text(text, "utf-8", errors="replace")
            res = sandbox.run(
                self.task["check"], cwd=tree, output_dir=tmp / "out", isolation=self.isolation,
                limits=sandbox.Limits(timeout=self.timeout, memory_mb=2048, disk_mb=256),
                readonly=tuple(self.task.get("files", {})),  # the answer cannot rewrite the task's tests
            )  # fmt: skip
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if res.ok:
            return True, "The checker passed."
        why = "timed out" if res.timed_out else f"exit {res.exit_code}"
        tail = (res.stderr_tail.strip() + "\n" + res.stdout_tail.strip()).strip()[-FEEDBACK_CHARS:]
        return False, f"The checker failed ({why}):\n{tail}"
