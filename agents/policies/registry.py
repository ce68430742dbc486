"""Pick the policy a spec asks for."""

from __future__ import annotations

import os
from typing import Literal

from agents.policies.base import Policy
from agents.policies.search import SearchPolicy
from agents.spec import Spec


class PolicyUnavailable(RuntimeError):
    """The spec asks for a policy this installation cannot provide."""


def make_policy(spec: Spec, ledger: object | None = None) -> Policy:
    """Return the policy for a spec; the `llm` policy charges its calls to `ledger`."""
    if spec.policy_kind == "search":
        return SearchPolicy(spec.policy.sampler)
    from agents.executor.loop import Limits
    from agents.llm.model import LitellmModel, ModelConfig
    from agents.policies.llm.policy import LlmPolicy

    model = model_of(spec)
    if not model:
        raise PolicyUnavailable(
            "policy.kind = 'llm' needs policy.model (or GROVE_MODEL), e.g. 'openai/gpt-4.1'"
        )
    if ledger is None:
        raise PolicyUnavailable("the llm policy needs a ledger to charge its calls to")
    prices = prices_of(spec)
    api_base, api_key = endpoint(spec, model)
    config = ModelConfig(
        model=model,
        api_base=api_base,
        api_key=api_key,
        prices=prices,
        retries=int(os.environ.get("GROVE_LLM_RETRIES", "5")),
        backoff=float(os.environ.get("GROVE_LLM_BACKOFF", "1.0")),
        max_backoff=float(os.environ.get("GROVE_LLM_MAX_BACKOFF", "60")),
        tool_mode=_tool_mode(spec),
        decoding=spec.policy.decoding,
        system_role=spec.policy.system_role,
        extra=dict(spec.policy.extra),
        # The operator's server knows its own context (`grove up --local-model` sets these).
        max_input_tokens=input_limit(spec),
        max_output_tokens=output_limit(spec),
        temperature=spec.policy.temperature,
    )
    limits = Limits(
        turns=spec.policy.max_turns,
        tokens=spec.policy.max_tokens,
        seconds=spec.policy.executor_minutes * 60,
        keep_turns=spec.policy.keep_turns,
    )
    # A ledger that keeps a study's events is told of every answer the policy refuses.
    refused = getattr(ledger, "refused", None)
    return LlmPolicy(LitellmModel(config, ledger), limits, refused, ideas_of(spec) == "settings")  # type: ignore[arg-type]


def _tool_mode(spec: Spec) -> Literal["auto", "native", "text"]:
    """Return how the executor acts: the operator's `GROVE_LLM_TOOL_MODE` (a server they run) wins."""
    value = os.environ.get("GROVE_LLM_TOOL_MODE", "").strip()
    if value in ("auto", "native", "text"):
        return value  # type: ignore[return-value]
    if value:
        raise PolicyUnavailable("GROVE_LLM_TOOL_MODE: must be auto, native or text")
    return spec.policy.tool_mode


def ideas_of(spec: Spec) -> str:
    """Return what an ideator's child may be: the operator's `GROVE_LLM_IDEAS` (a model they run) wins."""
    value = os.environ.get("GROVE_LLM_IDEAS", "").strip()
    if value and value not in ("any", "settings"):
        raise PolicyUnavailable("GROVE_LLM_IDEAS: must be any or settings")
    return value or spec.policy.ideas


def input_limit(spec: Spec) -> int | None:
    """Return the tokens a prompt may take: the operator's server's limit, else the spec's (None: the model's)."""
    return _int_env("GROVE_LLM_MAX_INPUT_TOKENS") or spec.policy.max_input_tokens


def output_limit(spec: Spec) -> int:
    """Return the tokens an answer may take."""
    return _int_env("GROVE_LLM_MAX_OUTPUT_TOKENS") or spec.policy.max_output_tokens


def _int_env(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdecimal() or not 16 <= int(value) <= 100_000_000:
        raise PolicyUnavailable(f"{name}: must be a whole number of tokens between 16 and 100,000,000")
    return int(value)


def endpoint(spec: Spec, model: str) -> tuple[str | None, str | None]:
    """Return the base URL and key for the model calls (docs/security.md, "Keys").

    The operator's `GROVE_LLM_API_BASE`, and spec bases listed in `GROVE_LLM_API_BASES`, get the
    server's keys. Any other spec base gets the key in the spec's `api_key_env` (a `GROVE_KEY_*`
    variable) or a placeholder: an explicit key keeps litellm from sending the provider's.
    """
    server = os.environ.get("GROVE_LLM_API_BASE")
    base = server or spec.policy.api_base
    if base and not server and not allowed_base(base):
        named = spec.policy.api_key_env
        return base, (os.environ.get(named) if named else None) or "no-key"
    # Local OpenAI-compatible servers want some key; hosted providers read theirs from the environment.
    return base, os.environ.get("GROVE_LLM_API_KEY") or (
        "local" if base and not _provider_key(model) else None
    )


def allowed_base(base: str) -> bool:
    """Return whether the operator lists a spec's model server as theirs (`GROVE_LLM_API_BASES`)."""
    listed = {
        b.strip().rstrip("/") for b in os.environ.get("GROVE_LLM_API_BASES", "").split(",") if b.strip()
    }
    return base.rstrip("/") in listed


def server_endpoint(model: str) -> tuple[str | None, str | None]:
    """Return the operator's model server and key (`GROVE_LLM_API_BASE`, `GROVE_LLM_API_KEY`)."""
    base = os.environ.get("GROVE_LLM_API_BASE")
    return base, os.environ.get("GROVE_LLM_API_KEY") or (
        "local" if base and not _provider_key(model) else None
    )


def _provider_key(model: str) -> str | None:
    provider = model.split("/", 1)[0].upper().replace("-", "_")
    return os.environ.get(f"{provider}_API_KEY")


def prices_of(spec: Spec) -> dict[str, float] | None:
    """Return the per-token prices the spec gives for its model, if it gives any."""
    if spec.policy.input_usd_per_mtok is None and spec.policy.output_usd_per_mtok is None:
        return None
    return {
        "input_cost_per_token": (spec.policy.input_usd_per_mtok or 0.0) / 1e6,
        "output_cost_per_token": (spec.policy.output_usd_per_mtok or 0.0) / 1e6,
    }


def model_of(spec: Spec) -> str | None:
    """Return the model the llm policy will call (the operator's GROVE_MODEL wins)."""
    return os.environ.get("GROVE_MODEL") or spec.policy.model


def unpriced(model: str) -> bool:
    """Return whether litellm has no price (or only a zero price) for `model`."""
    from agents.llm.model import model_info, unpriced_info

    return unpriced_info(model_info(model))
