"""Read and write dotted keys in TOML, YAML and JSON configuration files."""

from __future__ import annotations

import json
from pathlib import PurePosixPath
from typing import Any

import tomlkit
import yaml

FORMATS = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}


class ConfigKeyError(KeyError):
    """A dotted key does not exist in a configuration file."""


def file_format(path: str) -> str:
    """Return the format of a config file from its suffix, or raise ValueError."""
    suffix = PurePosixPath(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"{path}: unsupported config format {suffix!r} (use .toml, .yaml or .json)")
    return FORMATS[suffix]


def _load(fmt: str, text: str) -> Any:
    if fmt == "toml":
        return tomlkit.parse(text)
    if fmt == "yaml":
        return yaml.safe_load(text) or {}
    return json.loads(text)


def _dump(fmt: str, doc: Any, original: str) -> str:
    if fmt == "toml":
        return tomlkit.dumps(doc)
    if fmt == "yaml":
        return yaml.safe_dump(doc, sort_keys=False)
    indent = 2 if "\n  " in original else (4 if "\n    " in original else None)
    return json.dumps(doc, indent=indent) + ("\n" if original.endswith("\n") else "")


def _walk(doc: Any, key: str) -> tuple[Any, str]:
    parts = key.split(".")
    node = doc
    for part in parts[:-1]:
        if not isinstance(node, dict) or part not in node:
            raise ConfigKeyError(key)
        node = node[part]
    if not isinstance(node, dict) or parts[-1] not in node:
        raise ConfigKeyError(key)
    return node, parts[-1]


def _plain(value: Any) -> Any:
    unwrap = getattr(value, "unwrap", None)
    return unwrap() if callable(unwrap) else value


def get_key(path: str, text: str, key: str) -> Any:
    """Return the value at a dotted key of a config file's text."""
    node, last = _walk(_load(file_format(path), text), key)
    return _plain(node[last])


def set_keys(path: str, text: str, values: dict[str, Any]) -> str:
    """Return the config text with each dotted key set to its value."""
    fmt = file_format(path)
    doc = _load(fmt, text)
    for key, value in values.items():
        node, last = _walk(doc, key)
        node[last] = value
    return _dump(fmt, doc, text)
