"""How a role's answer is asked for so that the server constrains its decoding to the answer's schema.

A small model given a schema in the form its server enforces writes valid JSON of that schema; asked
in free text, it echoes the prompt. Servers take the schema in different forms (OpenAI's
`json_schema`, llama.cpp's `json_object` with a schema, Ollama's `format`, vLLM's `guided_json`),
and refuse forms they do not know: the forms a server is tried with come from a small table by
provider, the first it does not refuse is kept, and where none is taken the answer is read as it
comes (the tolerant readers in `answers`).
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any


class Decoding(StrEnum):
    """The form a schema is sent in; NONE sends none."""

    NONE = "none"
    JSON_SCHEMA = "json_schema"  # response_format {"type": "json_schema", "json_schema": {...}}
    LLAMACPP = "llamacpp"  # response_format {"type": "json_object", "schema": {...}} (llama.cpp's server)
    OLLAMA = "ollama"  # format: <schema>
    VLLM = "vllm"  # extra_body {"guided_json": <schema>}


SETTINGS = ("auto", *(d.value for d in Decoding))
# Providers (litellm's model prefix) and the forms worth trying, first first.
TABLE: dict[str, tuple[Decoding, ...]] = {
    "openai": (Decoding.JSON_SCHEMA,),
    "azure": (Decoding.JSON_SCHEMA,),
    "ollama": (Decoding.OLLAMA,),
    "ollama_chat": (Decoding.OLLAMA,),
    "hosted_vllm": (Decoding.VLLM, Decoding.JSON_SCHEMA),
    "lm_studio": (Decoding.JSON_SCHEMA,),
}
# An OpenAI-compatible server at a base URL of its own may be any of them (llama.cpp answers
# `json_schema` with HTTP 500; LM Studio and vLLM take it).
COMPATIBLE = (Decoding.JSON_SCHEMA, Decoding.LLAMACPP)
_REFUSED = re.compile(r"response_format|json_schema|json_object|guided_json|grammar|schema|format", re.I)


def candidates(setting: str, model: str, api_base: str | None) -> tuple[Decoding, ...]:
    """Return the forms to try for a model, in order (`setting` other than auto names the one)."""
    if setting != "auto":
        return (Decoding(setting),)
    provider = model.split("/", 1)[0] if "/" in model else "openai"
    if provider == "openai" and api_base:
        return COMPATIBLE
    return TABLE.get(provider, ())


def fields(decoding: Decoding, name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """Return the request fields that carry `schema` in this form (none for NONE)."""
    if decoding is Decoding.JSON_SCHEMA:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}}
    if decoding is Decoding.LLAMACPP:
        return {"response_format": {"type": "json_object", "schema": schema}}
    if decoding is Decoding.OLLAMA:
        return {"format": schema}
    if decoding is Decoding.VLLM:
        return {"extra_body": {"guided_json": schema}}
    return {}


def refuses(status: int | None, text: str, others: bool = False, form: Decoding | None = None) -> bool:
    """Return whether an error says the server does not take the schema in the form it was sent.

    With `others` (another form is left to try), a 500 to OpenAI's `json_schema` form says so whatever
    its text: llama.cpp's server fails on that form with a 500 whose body the client may not pass on.
    """
    if others and status in (500, 501) and form is Decoding.JSON_SCHEMA:
        return True
    return status in (400, 415, 422, 500, 501) and bool(_REFUSED.search(text))
