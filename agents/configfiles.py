"""Read and write dotted keys in TOML, YAML and JSON configuration files.

A dotted key walks mappings by name and lists by index (`layers.0.width`); on a list, a name picks
the one item that is a mapping holding it, which is how a Hydra defaults-list choice is named
(`defaults.model` is `mlp` in `defaults: [{model: mlp}, _self_]`). YAML is read as YAML 1.2 (`1e-3`
is a float) and edited in place: only the changed values' characters are rewritten, so comments,
order, quoting and layout stay as they were. TOML keeps its layout through tomlkit; JSON keeps its
indentation.
"""

from __future__ import annotations

import io
import itertools
import json
import re
import tomllib
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Any

import tomlkit
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode


class Format(StrEnum):
    TOML = "toml"
    YAML = "yaml"
    JSON = "json"


FORMATS = {".toml": Format.TOML, ".yaml": Format.YAML, ".yml": Format.YAML, ".json": Format.JSON}
KINDS = tuple(Format)


class ConfigKeyError(KeyError):
    """A dotted key does not exist in a configuration file."""


class ConfigFormatError(ValueError):
    """A config file whose format is unknown, or whose text does not parse as that format."""


def suffix_format(path: str) -> Format | None:
    """Return the format a file's suffix names, or None."""
    return FORMATS.get(PurePosixPath(path).suffix.lower())


def sniff(text: str) -> Format | None:
    """Return the format a config text parses as (JSON, then TOML, then a YAML mapping), or None."""
    stripped = text.lstrip()
    tries: list[tuple[Format, Any]] = [
        (Format.JSON, lambda: stripped[:1] in ("{", "[") and json.loads(text) is not None),
        (Format.TOML, lambda: bool(tomllib.loads(text))),
        (Format.YAML, lambda: isinstance(_yaml_safe().load(text), dict)),
    ]
    for kind, parses in tries:
        try:
            if parses():
                return kind
        except (ValueError, YAMLError, RecursionError):
            continue
    return None


def file_format(path: str, text: str | None = None, override: str | None = None) -> Format:
    """Return a config file's format: the override, else its suffix, else what its text parses as."""
    if override:
        if override not in KINDS:
            raise ConfigFormatError(f"{path}: unknown format {override!r} (use toml, yaml or json)")
        return Format(override)
    known = suffix_format(path)
    if known:
        return known
    found = sniff(text) if text is not None else None
    if found is None:
        raise ConfigFormatError(
            f"{path}: cannot tell its format from the name or the content; "
            f'set it in grove.toml: [files.formats] "{path}" = "yaml" (or "toml", "json")'
        )
    return found


def _yaml_safe() -> YAML:
    return YAML(typ="safe", pure=True)


def _load(fmt: Format, path: str, text: str) -> Any:
    try:
        if fmt == Format.TOML:
            return tomlkit.parse(text)
        if fmt == Format.YAML:
            doc = _yaml_safe().load(text)
            return {} if doc is None else doc
        return json.loads(text)
    except RecursionError:
        raise ConfigFormatError(f"{path}: nested too deeply") from None
    except Exception as exc:
        raise ConfigFormatError(f"{path}: not valid {fmt.upper()}: {str(exc).splitlines()[0]}") from None


def _slot(node: Any, part: str, key: str) -> tuple[Any, Any]:
    if isinstance(node, dict):
        if part in node:
            return node, part
    elif isinstance(node, list):
        if re.fullmatch(r"\d+", part):
            if int(part) < len(node):
                return node, int(part)
        else:
            hits = [item for item in node if isinstance(item, dict) and part in item]
            if len(hits) == 1:
                return hits[0], part
    raise ConfigKeyError(key)


def _walk(doc: Any, key: str) -> tuple[Any, Any]:
    parts = key.split(".")
    node = doc
    for part in parts[:-1]:
        holder, slot = _slot(node, part, key)
        node = holder[slot]
    return _slot(node, parts[-1], key)


def _plain(value: Any) -> Any:
    unwrap = getattr(value, "unwrap", None)
    return unwrap() if callable(unwrap) else value


def load(path: str, text: str, fmt: str | None = None) -> Any:
    """Return a config file's whole content as plain values."""
    return _load(file_format(path, text, fmt), path, text)


def get_key(path: str, text: str, key: str, fmt: str | None = None) -> Any:
    """Return the value at a dotted key of a config file's text."""
    kind = file_format(path, text, fmt)
    holder, slot = _walk(_load(kind, path, text), key)
    return _plain(holder[slot])


def set_keys(path: str, text: str, values: dict[str, Any], fmt: str | None = None) -> str:
    """Return the config text with each dotted key set to its value."""
    kind = file_format(path, text, fmt)
    if kind == Format.YAML:
        return _set_yaml(path, text, values)
    doc = _load(kind, path, text)
    for key, value in values.items():
        holder, slot = _walk(doc, key)
        holder[slot] = value
    if kind == Format.TOML:
        return tomlkit.dumps(doc)
    return _dump_json(doc, text)


def _dump_json(doc: Any, original: str) -> str:
    first = re.search(r"^([ \t]+)\S", original, re.M)
    indent: str | None = first.group(1) if first else None
    out = json.dumps(doc, indent=indent, ensure_ascii=False)
    return out + ("\n" if original.endswith("\n") else "")


# YAML: edit the characters of each changed value, keep everything else -----------------


def _yaml_node(root: Node, key: str) -> Node:
    node = root
    for part in key.split("."):
        if isinstance(node, MappingNode):
            hits = [v for k, v in node.value if isinstance(k, ScalarNode) and k.value == part]
        elif isinstance(node, SequenceNode):
            if re.fullmatch(r"\d+", part):
                hits = node.value[int(part) : int(part) + 1]
            else:
                hits = [
                    v
                    for item in node.value
                    if isinstance(item, MappingNode)
                    for k, v in item.value
                    if isinstance(k, ScalarNode) and k.value == part
                ]
        else:
            hits = []
        if len(hits) != 1:
            merged = isinstance(node, MappingNode) and any(
                isinstance(k, ScalarNode) and k.value == "<<" for k, _ in node.value
            )
            if merged and not hits:
                raise ConfigFormatError(
                    f"{key}: inherited through a merge key (<<); name it where it is written, Grove edits in place"
                )
            raise ConfigKeyError(key)
        node = hits[0]
    if getattr(node, "anchor", None):
        raise ConfigFormatError(
            f"{key}: the value is anchored (&{node.anchor}) and may be shared through aliases; "
            "name a value written once, Grove edits in place"
        )
    return node


def check_settable(path: str, text: str, key: str, fmt: str | None = None) -> None:
    """Raise ConfigKeyError or ConfigFormatError unless the key can be set in place."""
    kind = file_format(path, text, fmt)
    if kind != Format.YAML:
        get_key(path, text, key, kind)
        return
    try:
        root = _yaml_safe().compose(text)
    except (YAMLError, RecursionError) as exc:
        raise ConfigFormatError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if root is None:
        raise ConfigKeyError(key)
    _yaml_node(root, key)


def _yaml_text(value: Any, style: str | None = None) -> str:
    if isinstance(value, str) and style == '"':
        return json.dumps(value, ensure_ascii=False)
    y = _yaml_safe()
    y.default_flow_style = True
    y.width = 1 << 16
    buf = io.StringIO()
    y.dump(value, buf)
    out = buf.getvalue().strip()
    return out.removesuffix("...").strip()


def _spans(node: Node, value: Any) -> list[tuple[int, int, str]]:
    """Return (start, end, new text) for the characters that set `node` to `value`."""
    if (
        isinstance(node, SequenceNode)
        and isinstance(value, list)
        and len(value) == len(node.value)
        and all(isinstance(n, ScalarNode) for n in node.value)
        and not any(isinstance(v, dict | list) for v in value)
    ):
        return [s for n, v in zip(node.value, value, strict=True) for s in _spans(n, v)]
    start, end = node.start_mark.index, node.end_mark.index
    style = node.style if isinstance(node, ScalarNode) else None
    return [(start, end, _yaml_text(value, style))]


def _set_yaml(path: str, text: str, values: dict[str, Any]) -> str:
    try:
        root = YAML(typ="safe", pure=True).compose(text)
    except YAMLError as exc:
        raise ConfigFormatError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if root is None:
        raise ConfigKeyError(next(iter(values), ""))
    before = _load(Format.YAML, path, text)
    spans: list[tuple[int, int, str]] = []
    for key, value in values.items():
        node = _yaml_node(root, key)
        holder, slot = _walk(before, key)
        if holder[slot] == value and type(holder[slot]) is type(value):
            continue  # unchanged: its characters stay as written (`1e-3` is not rewritten `0.001`)
        spans += _spans(node, value)
    spans.sort()
    for (_, end, _), (start, _, _) in itertools.pairwise(spans):
        if start < end:
            raise ConfigFormatError(f"{path}: two of the keys set share characters; set each value once")
    out = text
    for start, end, new in reversed(spans):
        if start == end:  # `lr:` with no value: the empty value's mark lies after the line break
            start = end = out.rfind(":", 0, start) + 1
        old = out[start:end]
        tail = old[len(old.rstrip()) :]  # a block value's span ends after its line break
        tag = re.match(r"(?:![^\s]*\s+)+", old)  # keep an explicit tag: `!!float 1e-3`
        lead = tag.group(0) if tag else (" " if start == end else "")  # `lr:` with no value yet
        out = out[:start] + lead + new + tail + out[end:]
    doc = _load(Format.YAML, path, out)
    for key, value in values.items():
        holder, slot = _walk(doc, key)
        if holder[slot] != value:
            raise ConfigFormatError(f"{path}: setting {key} in place did not read back as {value!r}")
    return out
