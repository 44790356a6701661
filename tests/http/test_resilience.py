"""Unbuffered streaming, retries, Retry-After, timeouts and admission control."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ncap.testing.fake_upstream import FakeState
from tests.support import gateway, gateway_config

BODY: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def _faulty(fake: tuple[str, FakeState], tmp: Path, headers: dict[str, str], **route: Any) -> Any:
    return gateway_config(fake[0], tmp, routes={"fake": {"headers": headers, **route}})


def _key() -> str:
    return uuid.uuid4().hex


def test_stream_is_not_buffered(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    # the upstream pauses after its first event: relayed unbuffered, that event reaches
    # the client a whole pause before the next one. Buffered, they would arrive together.
    # Half the pause is slack for a loaded machine; the second arrival cannot come before
    # the pause has passed (timed from before the request: causality, not speed).
    pause = 1.2
    headers = {"x-fake-fault": "first_chunk_then_pause", "x-fake-pause-ms": str(pause * 1000)}
    with gateway(_faulty(fake, tmp_path, headers)) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        start = time.monotonic()
        arrivals = []
        for _chunk in client.chat.completions.create(**BODY, stream=True):
            arrivals.append(time.monotonic() - start)
    assert len(arrivals) >= 3
    assert arrivals[1] >= pause, arrivals
    assert arrivals[1] - arrivals[0] > pause / 2, arrivals


def test_503_then_200_succeeds_in_two_attempts(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    key = _key()
    headers = {"x-fake-fault": "overloaded", "x-fake-fail-times": "1", "x-fake-fail-key": key}
    with gateway(_faulty(fake, tmp_path, headers)) as gw:
        r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
    assert r.status_code == 200, r.text
    assert fake[1].stats()["by_key"][key] == 2


def test_three_503_give_client_503(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    key = _key()
    headers = {"x-fake-fault": "overloaded", "x-fake-fail-times": "99", "x-fake-fail-key": key}
    with gateway(_faulty(fake, tmp_path, headers)) as gw:
        r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "server_is_overloaded"
    assert fake[1].stats()["by_key"][key] == 3


def test_retry_after_is_honoured(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    key = _key()
    headers = {
        "x-fake-fault": "rate_limit",
        "x-fake-retry-after": "1",
        "x-fake-fail-times": "1",
        "x-fake-fail-key": key,
    }
    with gateway(_faulty(fake, tmp_path, headers, backoff_s=0.01)) as gw:
        start = time.monotonic()
        r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
        elapsed = time.monotonic() - start
    assert r.status_code == 200
    assert elapsed >= 0.95, elapsed
    assert fake[1].stats()["by_key"][key] == 2


def test_hung_upstream_times_out_at_route_limit(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    headers = {"x-fake-fault": "timeout"}
    with gateway(_faulty(fake, tmp_path, headers, timeout_s=0.5, retries=0)) as gw:
        start = time.monotonic()
        r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=30)
        elapsed = time.monotonic() - start
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"
    # not before the route's limit; and the gateway's own timer fired, not the upstream
    # (which hangs for an hour) nor the client (30 s): the bound is slack for load only
    assert 0.45 <= elapsed < 10, elapsed


def test_upstream_400_is_relayed_not_retried(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    key = _key()
    headers = {"x-fake-fault": "server_error_400", "x-fake-fail-times": "9", "x-fake-fail-key": key}
    with gateway(_faulty(fake, tmp_path, headers)) as gw:
        r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("Upstream:")
    assert fake[1].stats()["by_key"][key] == 1


def test_html_502_maps_to_upstream_error(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    with gateway(_faulty(fake, tmp_path, {"x-fake-fault": "bad_gateway_html"})) as gw:
        r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_error"


async def test_in_flight_capacity_gives_503(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    config = gateway_config(
        fake[0],
        tmp_path,
        server={"max_in_flight": 1},
        routes={"fake": {"headers": {"x-fake-fault": "latency=1000"}}},
    )
    fake[1].reset()
    with gateway(config) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
            first = asyncio.create_task(client.post("/v1/chat/completions", json=BODY))
            # the first request holds the only slot once the upstream has it (not a sleep)
            deadline = time.monotonic() + 10
            while fake[1].stats()["in_flight"] < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            second = await client.post("/v1/chat/completions", json=BODY)
            assert (await first).status_code == 200
    assert second.status_code == 503
    assert second.json()["error"]["code"] == "server_is_overloaded"


def test_ramp_limit_gives_429_slow_down(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    config = gateway_config(
        fake[0], tmp_path, server={"ramp": {"requests_per_second": 0.01, "burst": 2}}
    )
    with gateway(config) as gw:
        answers = [
            httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10) for _ in range(6)
        ]
    slowed = [r for r in answers if r.status_code == 429]
    # at most 2 per second from idle (+0.01 growth): 6 quick requests cannot all pass
    assert slowed and len(slowed) + [r.status_code for r in answers].count(200) == 6
    assert {r.json()["error"]["code"] for r in slowed} == {"slow_down"}
    assert all("retry-after" in r.headers for r in slowed)


@pytest.mark.parametrize("body", [b"{", b"[]", b"", b'{"model": 1}'])
def test_bad_bodies_are_400_envelopes(gw: Any, body: bytes) -> None:
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_oversized_body_is_413(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    config = gateway_config(fake[0], tmp_path, limits={"max_body_bytes": 2048})
    big = {**BODY, "messages": [{"role": "user", "content": "x" * 5000}]}
    raw = json.dumps(big).encode()
    with gateway(config) as gw:
        r = httpx.post(gw.url + "/v1/chat/completions", json=big, timeout=10)
        # without a length: chunked, in one chunk and in several (here the body has
        # arrived whole when the handler reads it, so no read waits for it)
        one = _raw_post(gw.port, _chunked([raw]))
        parts = _raw_post(gw.port, _chunked([raw[i : i + 1000] for i in range(0, len(raw), 1000)]))
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    for answer in (one, parts):
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b'"code":"request_too_large"' in answer


def _chunked(parts: list[bytes]) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n"
    )
    return head + body


def _raw_post(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer
