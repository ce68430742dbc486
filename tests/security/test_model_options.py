"""A hostile grove.toml against the model seam: provider options that would redirect calls or lift limits."""

from __future__ import annotations

import pytest


def test_a_spec_may_pass_sampling_options_but_nothing_that_redirects_a_call() -> None:
    from agents.spec import SpecError, parse_spec
    from tests.support.repos import TINY_SPEC

    base = TINY_SPEC.format(name="t", max_size=4, experiments=2, mode="auto", margin=0.5, max_test_runs=10,
                            plateau_stop=8).replace('kind = "search"', 'kind = "llm"\nmodel = "openai/x"')  # fmt: skip
    spec = parse_spec(base.replace("[policy]\n", "[policy]\nextra = { num_ctx = 8192, stop = ['###'] }\n"))
    assert spec.policy.extra == {"num_ctx": 8192, "stop": ["###"]}
    for bad in ("fallbacks = [{ model = 'openai/x', api_base = 'https://evil' }]", "extra_body = { model = 'y' }",
                "n = 5", "custom_llm_provider = 'x'", "api_base = 'https://evil'"):  # fmt: skip
        with pytest.raises(SpecError, match=r"policy\.extra"):
            parse_spec(base.replace("[policy]\n", f"[policy]\nextra = {{ {bad} }}\n"))


def test_a_specs_prices_cannot_cheapen_a_model_litellm_prices() -> None:
    from agents.llm.model import LitellmModel, ModelConfig
    from agents.llm.model import Unbilled as Ledger

    tiny = {"input_cost_per_token": 1e-12, "output_cost_per_token": 1e-12}
    known = LitellmModel(ModelConfig("openai/gpt-4o", prices=tiny), Ledger())
    assert known.prices is None and known.price(1_000_000, 0) > 1.0  # litellm's price stands
    local = LitellmModel(ModelConfig("openai/some-local-model", prices=tiny), Ledger())
    assert local.prices == tiny and local.price(1_000_000, 0) == pytest.approx(1e-6)
    # Nothing was registered process-wide: the local model is still unpriced for everyone else.
    assert LitellmModel(ModelConfig("openai/some-local-model"), Ledger()).price(1_000_000, 0) == 0.0


def test_a_shared_memory_name_needs_the_operators_leave(tmp_path: object) -> None:
    from agents.spec import SpecError, parse_spec
    from backend.core.config import Settings
    from backend.services.studies import check_operator_limits
    from tests.support.repos import TINY_SPEC

    text = TINY_SPEC.format(name="t", max_size=4, experiments=2, mode="auto", margin=0.5, max_test_runs=10,
                            plateau_stop=8) + '\n[memory]\nname = "team-a"\n'  # fmt: skip
    with pytest.raises(SpecError, match=r"memory\.name.*GROVE_MEMORY_NAMES"):
        check_operator_limits(Settings(), parse_spec(text))
    check_operator_limits(Settings(memory_names="team-a,team-b"), parse_spec(text))
