"""An Azure OpenAI route through the real gateway, with the official ``openai`` SDK as the
client: n native through both URL forms (deployment + api-version, and /openai/v1), the
route's key in ``api-key`` (the client's ``Authorization`` never forwarded), Azure's
content filter and its 429."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ncap.client import demux
from ncap.config import Config
from ncap.domain.events import LedgerEvent
from ncap.lifecycle.failures import retryable
from ncap.providers.openai_passthrough import azure_failure
from ncap.stores import SQLiteLedgerStore
from ncap.testing.fake_azure import AZURE_LOG, AzureLog, create_azure_app
from ncap.testing.fake_upstream import STATE, FakeState
from tests.support import ServerThread, gateway, gateway_config

KEY_ENV = "NCAP_TEST_AZURE_KEY"
KEY = "azure-route-key"
VERSION = "2024-10-21"
MESSAGES: list[Any] = [{"role": "user", "content": "Name a prime."}]
Fake = tuple[str, FakeState, AzureLog]


@pytest.fixture
def fake_azure() -> Iterator[Fake]:
    server = ServerThread(lambda: create_azure_app(api_key=KEY, api_version=VERSION)).start()
    try:
        assert server.app is not None
        yield server.url, server.app[STATE], server.app[AZURE_LOG]
    finally:
        server.stop()


def _config(base_url: str, tmp: Path, form: str, headers: dict[str, str] | None) -> Config:
    route: dict[str, Any] = {
        "provider": "azure",
        "base_url": base_url if form == "deployment" else base_url + "/openai/v1",
        "upstream_model": "gpt-4o-prod",
        "api_key_env": KEY_ENV,
        "retries": 0,
        "headers": headers or {},
        "pricing": {"input_per_mtok": 2.5, "output_per_mtok": 10.0},
        "contract": {"candidates": "native", "max_candidates": 8, "stream_usage": "include_usage"},
    }
    if form == "deployment":
        route["api_version"] = VERSION
    return gateway_config(
        "http://unused",
        tmp,
        workloads={"default": {"max_candidates": 8, "output_ceiling": 256}},
        models={"gpt": ["az"]},
        routes={"az": route},
    )


def _rows(tmp: Path, count: int) -> list[LedgerEvent]:
    async def read() -> list[LedgerEvent]:
        store = SQLiteLedgerStore(tmp / "ledger.db")
        try:
            return [e async for e in store.export()]
        finally:
            await store.close()

    deadline = time.monotonic() + 10
    while True:
        found = [r for r in asyncio.run(read()) if r.policy_result == "allow"]
        if len(found) >= count and all(r.state != "reserved" for r in found):
            return found
        assert time.monotonic() < deadline, found
        time.sleep(0.05)


@pytest.fixture
def client_for(
    fake_azure: Fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., openai.OpenAI]]:
    monkeypatch.setenv(KEY_ENV, KEY)
    with ExitStack() as stack:

        def make(form: str = "deployment", headers: dict[str, str] | None = None) -> openai.OpenAI:
            config = _config(fake_azure[0], tmp_path, form, headers)
            server = stack.enter_context(gateway(config))
            return openai.OpenAI(base_url=server.url + "/v1", api_key="client-key", max_retries=0)

        yield make


@pytest.mark.parametrize(
    ("form", "path"),
    [
        ("deployment", f"/openai/deployments/gpt-4o-prod/chat/completions?api-version={VERSION}"),
        ("v1", "/openai/v1/chat/completions"),
    ],
)
def test_n3_native_through_both_url_forms(
    client_for: Any, fake_azure: Fake, tmp_path: Path, form: str, path: str
) -> None:
    _, state, log = fake_azure
    client = client_for(form)
    whole = client.chat.completions.create(
        model="gpt", messages=MESSAGES, n=3, max_completion_tokens=30
    )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason == "stop" for c in whole.choices)
    streamed = demux(
        client.chat.completions.create(
            model="gpt", messages=MESSAGES, n=3, max_completion_tokens=30, stream=True
        )
    )
    assert [streamed.choices[i].content for i in range(3)] == [
        c.message.content for c in whole.choices
    ]
    # one upstream request each: n is native on Azure
    assert log.paths == [path, path]
    assert state.stats()["recent_bodies"][0]["n"] == 3
    assert log.keys == [KEY, KEY]
    seen = state.stats()["last_headers_seen"]
    assert seen["Authorization"] is None  # the client's key never goes upstream
    assert seen["api-key"] == KEY
    rows = _rows(tmp_path, 2)
    assert [(r.returned_candidate_count, r.state) for r in rows] == [(3, "settled")] * 2


@pytest.mark.parametrize("stream", [False, True])
def test_filtered_output_is_content_filter_per_choice(client_for: Any, stream: bool) -> None:
    client = client_for(headers={"x-fake-azure": "output_filtered"})
    kwargs: dict[str, Any] = {"model": "gpt", "messages": MESSAGES, "n": 2}
    if stream:
        out = demux(client.chat.completions.create(**kwargs, stream=True))
        finishes = [out.choices[i].finish_reason for i in sorted(out.choices)]
    else:
        finishes = [c.finish_reason for c in client.chat.completions.create(**kwargs).choices]
    assert finishes == ["content_filter", "content_filter"]


def test_filtered_prompt_is_a_400_content_filter(client_for: Any, fake_azure: Fake) -> None:
    client = client_for(headers={"x-fake-azure": "prompt_filtered"})
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="gpt", messages=MESSAGES)
    assert info.value.code == "content_filter"
    assert "content management policy" in info.value.message
    assert len(fake_azure[2].paths) == 1  # the request's own fault: not retried


def test_429_is_a_rate_limit_with_retry_after_ms(client_for: Any) -> None:
    client = client_for(headers={"x-fake-azure": "rate_limited=1500"})
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="gpt", messages=MESSAGES)
    assert info.value.code == "rate_limit_exceeded"
    assert info.value.response.headers["retry-after"] == "2"


def test_retry_after_ms_wins_over_seconds() -> None:
    body = b'{"error": {"code": "429", "message": "Requests have exceeded the token rate limit."}}'
    failure = azure_failure(429, {"retry-after-ms": "250", "retry-after": "1"}, body)
    assert failure.retry_after == 0.25
    assert failure.error is not None and failure.error.code == "rate_limit_exceeded"
    assert retryable(failure)


def test_wrong_version_or_key_is_the_routes_fault(fake_azure: Fake) -> None:
    """The fake refuses what Azure refuses: a missing api-version, a wrong key."""
    url = fake_azure[0] + "/openai/deployments/d/chat/completions"
    body = {"messages": MESSAGES}
    assert httpx.post(url, json=body, headers={"api-key": KEY}).status_code == 404
    wrong = httpx.post(url + f"?api-version={VERSION}", json=body, headers={"api-key": "x"})
    assert wrong.status_code == 401
