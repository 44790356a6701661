"""``/openapi.json`` is valid OpenAPI 3.1 and agrees with the validator it is built from,
for chat and for the legacy ``/v1/completions``."""

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
from ncap.protocol.validate import (
    COMPLETION_FIELDS,
    parse_chat_request,
    parse_completion_request,
)
from tests.support import ServerThread


def _request_validator(name: str = "ChatCompletionRequest") -> jsonschema.Draft202012Validator:
    doc = openapi_document()
    schema = {"$ref": f"#/components/schemas/{name}", **doc}
    return jsonschema.Draft202012Validator(schema)


def _validator_accepts(body: Any, parse: Any = parse_chat_request) -> bool:
    try:
        parse(json.dumps(body).encode())
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


def test_legacy_completions_is_an_operation_over_its_wire_structs() -> None:
    op = openapi_document()["paths"]["/v1/completions"]["post"]
    body = op["requestBody"]["content"]["application/json"]["schema"]
    ok = op["responses"]["200"]["content"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/TextCompletion"}
    assert "text/event-stream" in ok
    assert op["security"] == [{"bearer": []}]
    schemas = openapi_document()["components"]["schemas"]
    # every field the validator knows, and only those (the schema is generated, not written)
    props = schemas["CompletionRequest"]["properties"]
    assert set(props) == set(COMPLETION_FIELDS)
    assert props["best_of"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 20}


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


LEGACY: list[dict[str, Any]] = [
    {"model": "m", "prompt": "hi"},
    {"model": "m", "prompt": ["a", "b"], "n": 2, "best_of": 3, "max_tokens": 8},
    {"model": "m", "prompt": [1, 2, 3], "echo": True, "logprobs": 2},
    {"model": "m", "prompt": [[1, 2], [3]], "suffix": "x", "stop": "\n"},
    {"model": "m", "prompt": None},
    {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}},
    {"model": "m"},
    {"prompt": "hi"},
    {"model": "m", "prompt": "hi", "best_of": 21},
    {"model": "m", "prompt": "hi", "best_of": -1},
    {"model": "m", "prompt": "hi", "logprobs": 6},
    {"model": "m", "prompt": "hi", "n": 0},
    {"model": "m", "prompt": [[]]},
    {"model": "m", "prompt": {"text": "hi"}},
    {"model": "m", "prompt": "hi", "messages": []},
    {"model": "m", "prompt": "hi", "temperature": 3},
]


@pytest.mark.parametrize("body", LEGACY)
def test_legacy_schema_and_validator_agree_on_sample(body: dict[str, Any]) -> None:
    validator = _request_validator("CompletionRequest")
    assert validator.is_valid(body) == _validator_accepts(body, parse_completion_request)


_legacy_fields = st.sampled_from(["n", "best_of", "logprobs", "max_tokens", "echo", "suffix"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_legacy_fields, _values, max_size=4))
def test_legacy_schema_accepts_whatever_the_validator_accepts(extra: dict[str, Any]) -> None:
    """As for chat; ``best_of`` >= ``n`` is a cross-field rule, so only one direction."""
    body = {"model": "m", "prompt": "hi", **extra}
    accepted = _validator_accepts(body, parse_completion_request)
    valid = _request_validator("CompletionRequest").is_valid(body)
    assert valid or not accepted
    if not {"n", "best_of"} <= set(extra):
        assert valid == accepted


def test_every_admin_route_is_described_with_its_body_schema() -> None:
    from ncap.config import ExceptionGrant
    from ncap.http.admin import ADMIN_ROUTES, NewKey

    doc = openapi_document()
    described = {(p, m) for p, ops in doc["paths"].items() for m in ops if p.startswith("/admin")}
    assert described == {(r.path, r.method) for r in ADMIN_ROUTES}
    schemas = doc["components"]["schemas"]
    body = doc["paths"]["/admin/keys"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/NewKey"}
    assert set(schemas["NewKey"]["required"]) == {"workload"}
    assert schemas["NewKey"]["additionalProperties"] is False  # extra fields are refused
    assert set(schemas["ExceptionGrant"]["required"]) == set(
        ExceptionGrant.model_json_schema()["required"]
    )
    validator = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/NewKey", **doc})
    assert validator.is_valid({"workload": "w", "label": "ci"})
    assert not validator.is_valid({"workload": "w", "label": ""})  # min_length 1
    NewKey.model_validate({"workload": "w", "label": "ci"})
    revoke = doc["paths"]["/admin/keys/{id}"]["delete"]
    assert revoke["parameters"][0]["name"] == "id" and "201" not in revoke["responses"]


def test_the_running_app_serves_exactly_the_admin_routes_described(gw: ServerThread) -> None:
    doc = httpx.get(gw.url + "/openapi.json", timeout=10).json()
    for path, ops in doc["paths"].items():
        if not path.startswith("/admin"):
            continue
        for method in ops:
            url = gw.url + path.replace("{id}", "nope")
            r = httpx.request(method.upper(), url, timeout=10)
            # routed (not 404/405): refused without the admin key
            assert r.status_code in (401, 403), (method, path, r.status_code)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
