"""Evaluation runs and their receipts (the metrics protocol: docs/architecture.md, "The metrics protocol")."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agents import globs
from backend.engine import sandbox


@dataclass
class Receipt:
    kind: str  # "dev" | "test"
    seed: int
    command: str
    commit: str
    exit_code: int | None
    duration: float
    timed_out: bool
    stdout_path: str
    stderr_path: str
    stdout_tail: str
    stderr_tail: str
    metrics: dict[str, Any] | None
    ok: bool
    reason: str
    fingerprint: str

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-friendly dict."""
        return asdict(self)

    def objective(self, metric: str) -> float | None:
        """Return the objective value of a successful receipt."""
        if not self.ok or not self.metrics:
            return None
        return float(self.metrics[metric])


def _json_objects(text: str, newest_first: bool = False) -> Iterator[dict[str, Any]]:
    lines = text.splitlines()
    for line in reversed(lines) if newest_first else lines:
        line = line.strip()
        if not (line.startswith("{") and line.endswith("}")):
            continue
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, an integer past the parser's limit, nested too deep
            continue
        if isinstance(value, dict):
            yield value


def _last_json_line(text: str) -> dict[str, Any] | None:
    return next(_json_objects(text, newest_first=True), None)


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        f = float(v)
    except OverflowError:  # an integer of hundreds of digits
        return None
    return f if math.isfinite(f) else None


STEP_KEYS = 32  # the numbers of one step record that are kept


def step_records(text: str, limit: int = 2000) -> list[dict[str, float]]:
    """Return the per-step records an evaluation printed: JSON-object lines with an integer `step`.

    Only finite numbers are kept (at most `STEP_KEYS` a record); a long run is thinned evenly to
    at most `limit` records.
    """
    found = []
    for value in _json_objects(text):
        step = value.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or _number(step) is None:
            continue
        record = {k: x for k, x in ((str(k)[:64], _number(v)) for k, v in value.items()) if x is not None}
        found.append(dict(list(record.items())[:STEP_KEYS]) | {"step": float(step)})
    if len(found) > limit:
        found = [found[int(i * len(found) / limit)] for i in range(limit)]
    return found


def parse_metrics(
    metrics: bytes | None, stdout_path: Path, stdout_tail: str = ""
) -> tuple[dict[str, Any] | None, str]:
    """Read metrics from the metrics file's bytes, else the last JSON-object line of stdout.

    The stored stdout is capped, so its tail (the end of the whole output) is searched first.
    """
    if metrics:
        try:
            value = json.loads(metrics.decode("utf-8", "replace"))
        except json.JSONDecodeError as exc:
            return None, f"GROVE_METRICS_FILE is not valid JSON: {exc}"
        except RecursionError:
            return None, "GROVE_METRICS_FILE is nested too deeply to be metrics"
        if not isinstance(value, dict):
            return None, "GROVE_METRICS_FILE does not hold a JSON object"
        return value, ""
    value = _last_json_line(stdout_tail)
    if value is None:
        try:
            value = _last_json_line(stdout_path.read_text("utf-8", "replace"))
        except FileNotFoundError:
            value = None
    if value is None:
        return None, "no metrics: no GROVE_METRICS_FILE and no JSON object line on stdout"
    return value, ""


def fingerprint(root: Path, patterns: list[str]) -> str:
    """Return a SHA-256 over the files under `root` that match the patterns (path and content)."""
    h = hashlib.sha256()
    if not patterns:
        return h.hexdigest()[:16]  # nothing to walk the tree for
    # Names are matched before anything is looked at on disk: a large tree costs one listing.
    # Links are hashed by their target's name, never followed: one may point at any host file.
    named = ((p, p.relative_to(root)) for p in root.rglob("*"))
    matched = ((p, rel.as_posix()) for p, rel in named if ".git" not in rel.parts)
    entries = sorted(
        (
            (p, rel)
            for p, rel in matched
            if globs.match_any(patterns, rel) and (p.is_symlink() or p.is_file())
        ),
        key=lambda e: e[0],
    )
    for p, rel in entries:
        body = os.readlink(p).encode() if p.is_symlink() else p.read_bytes()
        h.update(rel.encode() + b"\0" + body + b"\0")
    return h.hexdigest()[:16]


def evaluate(
    *,
    kind: str,
    command: str,
    worktree: Path,
    output_dir: Path,
    seed: int,
    metric: str | None,
    commit: str,
    limits: sandbox.Limits,
    evaluator_fingerprint: str,
    bounds: tuple[float, float] | None = None,
    isolation: sandbox.Isolation = sandbox.Isolation(),
    readonly: tuple[str, ...] = (),
    disk_base: int | None = None,
    output_cap: int = 5_000_000,
    tail_bytes: int = 4_000,
    env: dict[str, str] | None = None,
) -> Receipt:
    """Run one evaluation in the sandbox and return its receipt (`metric` None: a run that reports none)."""
    name = f"{kind}-seed{seed}"
    metrics_file = output_dir / f"{name}.metrics.json"
    output_dir.mkdir(parents=True, exist_ok=True)
    metrics_file.unlink(missing_ok=True)
    res = sandbox.run(
        command,
        cwd=worktree,
        output_dir=output_dir,
        name=name,
        limits=limits,
        isolation=isolation,
        env={**(env or {}), "GROVE_SEED": str(seed), "GROVE_METRICS_FILE": "{out}/metrics.json"},
        collect=("metrics.json",),
        readonly=readonly,
        disk_base=disk_base,
        output_cap=output_cap,
        tail_bytes=tail_bytes,
    )
    reported = res.exchange.get("metrics.json")
    if reported:
        metrics_file.write_bytes(reported)
    metrics: dict[str, Any] | None = None
    reason = ""
    if res.timed_out:
        reason = f"timed out after {limits.timeout:g}s"
    elif res.disk_exceeded:
        reason = f"wrote more than {limits.disk_mb} MB"
    elif res.exit_code != 0:
        reason = f"exited with code {res.exit_code}"
        if res.signal:
            reason = f"killed by signal {res.signal}"
    elif metric is not None:
        metrics, reason = parse_metrics(reported, res.stdout_path, res.stdout_tail)
        if metrics is not None:
            value = metrics.get(metric)
            if value is None:
                reason = f"objective metric {metric!r} missing from the reported metrics"
            elif isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                reason = f"objective metric {metric!r} is not a finite number ({value!r})"
            elif bounds is not None and not bounds[0] <= value <= bounds[1]:
                reason = f"objective metric {metric!r} is {value!r}, outside objective.bounds {list(bounds)}"
    return Receipt(
        kind=kind,
        seed=seed,
        command=command,
        commit=commit,
        exit_code=res.exit_code,
        duration=round(res.duration, 3),
        timed_out=res.timed_out,
        stdout_path=str(res.stdout_path),
        stderr_path=str(res.stderr_path),
        stdout_tail=res.stdout_tail,
        stderr_tail=res.stderr_tail,
        metrics=metrics,
        ok=reason == "",
        reason=reason,
        fingerprint=evaluator_fingerprint,
    )
