"""Answers asked for in the form that constrains decoding, negotiated with the server."""

from __future__ import annotations

import json

from agents.llm.decoding import Decoding, candidates, refuses
from agents.llm.model import LitellmModel, ModelConfig, Unbilled
from agents.policies.llm import schemas
from tests.support.fake_llm import FakeLLM

ANSWER = {"children": [{"parent_id": 1, "title": "more trees", "mechanism": "m", "hypothesis": "h",
                        "observable": "o", "risks": "r", "expected_gain": 0.1}]}  # fmt: skip
SYSTEM = {"role": "system", "content": "ROLE: ideator"}


def test_each_provider_gets_the_forms_it_takes() -> None:
    assert candidates("auto", "openai/gpt-4.1", None) == (Decoding.JSON_SCHEMA,)
    assert candidates("auto", "openai/gemma", "http://127.0.0.1:8080/v1") == (
        Decoding.JSON_SCHEMA,
        Decoding.LLAMACPP,
    )
    assert candidates("auto", "ollama_chat/gemma3", "http://127.0.0.1:11434") == (Decoding.OLLAMA,)
    assert candidates("auto", "hosted_vllm/x", "http://h/v1")[0] is Decoding.VLLM
    assert candidates("auto", "anthropic/claude", None) == ()
    assert candidates("none", "openai/gpt-4.1", None) == (Decoding.NONE,)


def test_a_schema_goes_as_json_schema_then_as_llama_cpps_form_then_not_at_all() -> None:
    schema = schemas.ideator(2, [1, 3])
    with FakeLLM({"ideator": [{"content": json.dumps(ANSWER)}] * 4}, refuse_formats=("json_schema",)) as llm:
        model = LitellmModel(
            ModelConfig("openai/local", api_base=llm.url, api_key="k", retries=0), Unbilled()
        )
        turn = model.complete("ideator", [SYSTEM, {"role": "user", "content": "go"}], schema=schema)
        assert json.loads(turn.content) == ANSWER
        sent = [r["body"].get("response_format") for r in llm.requests]
        assert sent[0]["type"] == "json_schema" and sent[0]["json_schema"]["schema"] == schema
        assert sent[1] == {"type": "json_object", "schema": schema}
        # The refused form is not tried again; a call without a schema sends none.
        model.complete("ideator", [SYSTEM, {"role": "user", "content": "again"}], schema=schema)
        model.complete("ideator", [SYSTEM, {"role": "user", "content": "plain"}])
        assert [r["body"].get("response_format", {}).get("type") for r in llm.requests[2:]] == [
            "json_object",
            None,
        ]
    with FakeLLM({"ideator": [{"content": "{}"}] * 3}, refuse_formats=("json_schema", "json_object")) as llm:
        model = LitellmModel(
            ModelConfig("openai/local", api_base=llm.url, api_key="k", retries=0), Unbilled()
        )
        model.complete("ideator", [SYSTEM, {"role": "user", "content": "go"}], schema=schema)
        assert [r["body"].get("response_format", {}).get("type") for r in llm.requests] == [
            "json_schema", "json_object", None,
        ]  # fmt: skip
        assert model.forms == []


def test_the_schemas_hold_the_studys_values_and_cap_every_text() -> None:
    ideator = schemas.ideator(3, [4, 1, 4])
    child = ideator["properties"]["children"]["items"]
    assert child["properties"]["parent_id"]["enum"] == [1, 4]
    assert ideator["properties"]["children"]["maxItems"] == 3
    verifier = schemas.verifier(["readable", "fast"])
    assert verifier["properties"]["verdicts"]["items"]["properties"]["name"]["enum"] == ["readable", "fast"]

    def texts(node: object) -> list[dict[str, object]]:
        if isinstance(node, dict):
            own = [node] if node.get("type") == "string" and "enum" not in node else []
            return own + [t for v in node.values() for t in texts(v)]
        return [t for v in node for t in texts(v)] if isinstance(node, list) else []

    for schema in (ideator, verifier, schemas.state([1, 2])):
        assert texts(schema) and all("maxLength" in t for t in texts(schema))


def test_a_500_that_says_nothing_moves_to_the_next_form_only_where_one_is_left() -> None:
    schema = schemas.ideator(2, [1, 3])
    script = {"ideator": [{"status": 500}, {"content": json.dumps(ANSWER)}]}
    with FakeLLM(script) as llm:
        model = LitellmModel(
            ModelConfig("openai/local", api_base=llm.url, api_key="k", retries=0), Unbilled()
        )
        turn = model.complete("ideator", [SYSTEM, {"role": "user", "content": "go"}], schema=schema)
        assert json.loads(turn.content) == ANSWER
        assert [r["body"]["response_format"]["type"] for r in llm.requests] == ["json_schema", "json_object"]
        assert model.forms == [Decoding.LLAMACPP]
    # The last form left is kept through a 500 that does not name it: the call is retried with it.
    assert not refuses(500, "Connection error.") and refuses(
        500, "Connection error.", True, Decoding.JSON_SCHEMA
    )
    assert not refuses(
        500, "Connection error.", True, Decoding.LLAMACPP
    )  # a 500 to the last known form is an error
    assert refuses(500, "response_format must be text or json_object")
