"""Integers beyond what a ledger column holds (SQLite and PostgreSQL INTEGER/BIGINT are
64-bit) must never reach a row: found by schemathesis (a 500 from an OverflowError in
the SQLite ledger's insert). Each field is an OpenAI-shaped answer, never a 5xx."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.hardening.conftest import CLIENT_KEY, MODEL
from tests.support import ServerThread

HUGE = [2**63, 2**64 + 7, 10**30, -(2**63) - 1]


@pytest.fixture(scope="module")
def client(hgw: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=hgw.url, timeout=10) as c:
        yield c


@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize(
    "path,field",
    [
        ("/v1/chat/completions", "max_tokens"),
        ("/v1/chat/completions", "max_completion_tokens"),
        ("/v1/chat/completions", "n"),
        ("/v1/chat/completions", "seed"),
        ("/v1/chat/completions", "top_logprobs"),
        ("/v1/completions", "max_tokens"),
        ("/v1/completions", "best_of"),
        ("/v1/completions", "n"),
    ],
)
def test_huge_integer_is_a_client_error(
    client: httpx.Client, path: str, field: str, value: int
) -> None:
    if path == "/v1/completions":
        body: dict[str, object] = {"model": MODEL, "prompt": "hi"}
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    body[field] = value
    r = client.post(path, json=body, headers={"Authorization": f"Bearer {CLIENT_KEY}"})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    if field in ("max_tokens", "max_completion_tokens"):
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field, error
        assert field in error["message"]
