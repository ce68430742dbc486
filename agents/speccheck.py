"""Check a parsed spec against the files of the study's base: globs, sealed tests, `[search]` keys."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from agents import configfiles, evalcode, globs
from agents.spec import Level, SearchDim, Spec, SpecIssue, format_key


def check_against_tree(spec: Spec, files: list[str], read: Callable[[str], str]) -> list[SpecIssue]:
    """Check globs and `[search]` entries against the files present at the study's base."""
    issues: list[SpecIssue] = []
    for section in ("editable", "protected", "sealed"):
        for i, pattern in enumerate(getattr(spec.files, section)):
            if not globs.select([pattern], files):
                issues.append(
                    SpecIssue(
                        key=f"files.{section}[{i}]",
                        message=f"glob {pattern!r} matches no file at {spec.study.base!r}",
                    )
                )
    sealed = globs.select(spec.files.sealed, files)
    for i, pattern in enumerate(spec.evaluate.test_inputs):
        if not globs.select([pattern], sealed):
            issues.append(
                SpecIssue(
                    key=f"evaluate.test_inputs[{i}]", message=f"glob {pattern!r} matches no sealed file"
                )
            )
    issues += [SpecIssue(key=k, message=m, level=lvl) for k, m, lvl in evalcode.findings(spec, files, read)]
    present = set(files)
    for key, dim in spec.search.items():
        issues += _check_dim(spec, key, dim, present, read)
    for i, c in enumerate(spec.constraints):
        if c.metric == spec.objective.metric and c.min is None and c.max is None:
            issues.append(SpecIssue(key=f"constraints[{i}]", message="empty constraint"))
    return issues


def _check_dim(
    spec: Spec, key: str, dim: SearchDim, present: set[str], read: Callable[[str], str]
) -> list[SpecIssue]:
    """Check one `[search]` dimension's targets: present, editable, readable, of the right kind."""
    where = format_key(("search", key))
    issues: list[SpecIssue] = []
    currents: list[Any] = []
    for file, dotted in spec.targets(key):
        name = f"{file}:{dotted}" if dim.targets else dotted
        if file not in present:
            issues.append(SpecIssue(key=where, message=f"file {file!r} does not exist at base"))
            continue
        if not globs.match_any(spec.files.editable, file):
            issues.append(SpecIssue(key=where, message=f"file {file!r} is not in files.editable"))
        try:
            text = read(file)
            current = configfiles.get_key(file, text, dotted, spec.files.formats.get(file))
            configfiles.check_settable(file, text, dotted, spec.files.formats.get(file))
        except configfiles.ConfigKeyError:
            issues.append(SpecIssue(key=where, message=f"key {dotted!r} not found in {file}"))
            continue
        except Exception as exc:
            issues.append(SpecIssue(key=where, message=f"cannot read {file}: {exc}"))
            continue
        currents.append(current)
        if dim.is_range and (isinstance(current, bool) or not isinstance(current, int | float)):
            issues.append(
                SpecIssue(
                    key=where, message=f"{name}: range given but current value {current!r} is not numeric"
                )
            )
        elif dim.is_range and isinstance(current, float) and math.isnan(current):
            issues.append(SpecIssue(key=where, message=f"{name}: current value is NaN"))
        elif (
            dim.is_range
            and dim.low is not None
            and dim.high is not None
            and not dim.low <= current <= dim.high
        ):
            issues.append(
                SpecIssue(
                    key=where,
                    level=Level.WARNING,
                    message=f"{name}: current value {current!r} lies outside [{dim.low:g}, {dim.high:g}]",
                )
            )
    if len({repr(c) for c in currents}) > 1:
        issues.append(
            SpecIssue(
                key=where,
                level=Level.WARNING,
                message=f"its targets hold different values now ({', '.join(map(repr, currents))}); "
                "the first is the base value, and every experiment writes one value to all",
            )
        )
    return issues
