"""``/openapi.json`` is valid OpenAPI 3.1 and agrees with the validator it is built from."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate

from ncap.errors import InvalidRequest
from ncap.http.openapi import openapi_document
from ncap.protocol.validate import parse_chat_request
from tests.support import ServerThread


def _request_validator() -> jsonschema.Draft202012Validator:
    doc = openapi_document()
    schema = {"$ref": "#/components/schemas/ChatCompletionRequest", **doc}
    return jsonschema.Draft202012Validator(schema)


def _validator_accepts(body: Any) -> bool:
    try:
        parse_chat_request(json.dumps(body).encode())
    except InvalidRequest:
        return False
    return True


MSG = [{"role": "user", "content": "hi"}]
SAMPLE: list[dict[str, Any]] = [
    {"model": "m", "messages": MSG},
    {"model": "m", "messages": MSG, "n": 3, "temperature": 0.7, "stream": True},
    {"model": "m", "messages": [{"role": "system", "content": "s"}, *MSG], "stop": ["a", "b"]},
    {"model": "m", "messages": MSG, "logit_bias": {"123": 5}, "seed": 1},
    {"model": "m", "messages": MSG, "response_format": {"type": "json_object"}},
    {"model": "m", "messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"model": "m", "messages": []},
    {"model": "m"},
    {"messages": MSG},
    {"model": "m", "messages": MSG, "n": 0},
    {"model": "m", "messages": MSG, "n": 129},
    {"model": "m", "messages": MSG, "temperature": 3},
    {"model": "m", "messages": MSG, "stop": ["a", "b", "c", "d", "e"]},
    {"model": "m", "messages": MSG, "logit_bias": {"x": 1}},
    {"model": "m", "messages": MSG, "best_of": 2},
    {"model": "m", "messages": [{"role": "robot", "content": "hi"}]},
    {"model": 1, "messages": MSG},
    {"model": "m", "messages": MSG, "response_format": {"type": "yaml"}},
]


def test_document_is_valid_openapi_31() -> None:
    doc = openapi_document()
    validate(doc)
    assert doc["openapi"].startswith("3.1")
    assert "/v1/chat/completions" in doc["paths"]


def test_gateway_serves_the_document(gw: ServerThread) -> None:
    r = httpx.get(gw.url + "/openapi.json", timeout=10)
    assert r.status_code == 200
    assert r.json() == json.loads(json.dumps(openapi_document()))


@pytest.mark.parametrize("body", SAMPLE)
def test_schema_and_validator_agree_on_sample(body: dict[str, Any]) -> None:
    assert _request_validator().is_valid(body) == _validator_accepts(body)


_values = st.none() | st.booleans() | st.integers(-300, 300) | st.text(max_size=4)
_fields = st.sampled_from(["n", "temperature", "top_p", "stop", "logprobs", "seed", "user"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_fields, _values, max_size=4))
def test_schema_accepts_whatever_the_validator_accepts(extra: dict[str, Any]) -> None:
    """The validator also has cross-field rules the schema cannot state, so the only
    direction that must hold always is: accepted by the validator => schema-valid; and
    every one of these per-field cases has no cross-field rule, so they agree both ways."""
    body = {"model": "m", "messages": MSG, **extra}
    assert _request_validator().is_valid(body) == _validator_accepts(body)
