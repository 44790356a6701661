"""Whatever the body, the gateway answers with OpenAI's envelope and never a 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ncap.testing.fake_upstream import FakeState
from tests.support import ServerThread, gateway, gateway_config

FIELDS = [
    "model", "messages", "n", "temperature", "top_p", "stream", "stream_options", "stop",
    "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "logit_bias", "seed",
    "tools", "tool_choice", "response_format", "user", "metadata", "best_of", "presence_penalty",
]  # fmt: skip
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
VALID: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def gw(
    fake: tuple[str, FakeState], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    tmp: Path = tmp_path_factory.mktemp("no5xx")
    config = gateway_config(
        fake[0], tmp, server={"ramp": {"requests_per_second": 100000, "burst": 100000}}
    )
    with gateway(config) as server:
        yield server


def _check(gw: ServerThread, content: bytes) -> None:
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
    elif r.headers["content-type"].startswith("application/json"):
        assert "choices" in r.json()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6))
def test_random_fields_never_5xx(gw: ServerThread, body: dict[str, Any]) -> None:
    _check(gw, json.dumps({**VALID, **body}).encode())


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()))
def test_random_bytes_never_5xx(gw: ServerThread, content: bytes) -> None:
    _check(gw, content)
