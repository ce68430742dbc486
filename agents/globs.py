"""Glob matching for repository-relative paths (``*``, ``?``, ``**``)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache


@lru_cache(maxsize=512)
def _compile(pattern: str) -> re.Pattern[str]:
    pattern = pattern.strip("/")
    out: list[str] = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    # A pattern that names a directory also covers everything below it.
    return re.compile("".join(out) + "(?:/.*)?")


def match(pattern: str, path: str) -> bool:
    """Return whether a repository-relative path matches a glob pattern."""
    return _compile(pattern).fullmatch(path.strip("/")) is not None


def match_any(patterns: Iterable[str], path: str) -> bool:
    """Return whether a path matches any of the patterns."""
    return any(match(p, path) for p in patterns)


def select(patterns: Iterable[str], paths: Iterable[str]) -> list[str]:
    """Return the paths that match any of the patterns, in input order."""
    pats = list(patterns)
    return [p for p in paths if match_any(pats, p)]
