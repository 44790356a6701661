"""Clients that stall, over a raw socket, against a gateway with short deadlines
(``limits.body_timeout_s`` and ``limits.stream_write_timeout_s``): a body that stops
arriving gets a 408 in OpenAI's envelope and its connection closed; a streamed answer
whose client stops reading is dropped and settled like a disconnect (no row left
``reserved``, the upstream stream closed). A body that arrives in pieces, slowly but
within the deadline, is read whole."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ncap.auth import hash_key
from ncap.testing.fake_upstream import FakeState
from tests.hardening.conftest import CLIENT_KEY, MODEL
from tests.http.test_accounting import rows
from tests.support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, ServerThread, gateway, gateway_config

BODY_TIMEOUT_S = 0.5
WRITE_TIMEOUT_S = 0.5
LONG_TOKENS = 40_000  # a streamed answer far larger than the socket buffers
LONG_MODEL = "long-model"
_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n" % (
    CLIENT_KEY.encode()
)
_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
).encode()


@pytest.fixture(scope="module")
def stalls(
    fake: tuple[str, FakeState], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerThread, FakeState, Path]]:
    tmp = tmp_path_factory.mktemp("stalls")
    base = gateway_config(fake[0], tmp).model_dump(mode="json")["routes"]["fake"]
    # the fake reads the header the route sends: every choice this many tokens long
    long = {**base, "headers": {"x-fake-completion-tokens": str(LONG_TOKENS)}}
    config = gateway_config(
        fake[0],
        tmp,
        keys=[{"hash": hash_key(CLIENT_KEY), "workload": "default"}],
        limits={"body_timeout_s": BODY_TIMEOUT_S, "stream_write_timeout_s": WRITE_TIMEOUT_S},
        workloads={"default": {"max_candidates": 4, "output_ceiling": LONG_TOKENS}},
        models={LONG_MODEL: ["long"]},
        routes={"long": long},
    )
    mp = pytest.MonkeyPatch()
    mp.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)
    with gateway(config) as server:
        yield server, fake[1], tmp
    mp.undo()


def _read_all(conn: socket.socket, limit_s: float) -> tuple[bytes, bool]:
    """Everything until the server closes (True) or ``limit_s`` passes (False)."""
    conn.settimeout(0.2)
    deadline = time.monotonic() + limit_s
    chunks: list[bytes] = []
    while time.monotonic() < deadline:
        try:
            data = conn.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return b"".join(chunks), True
        if not data:
            return b"".join(chunks), True
        chunks.append(data)
    return b"".join(chunks), False


def _split(answer: bytes) -> tuple[bytes, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


def test_stalled_body_gets_a_408_and_the_connection_is_closed(
    stalls: tuple[ServerThread, FakeState, Path],
) -> None:
    server, state, _ = stalls
    before = state.requests
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        started = time.monotonic()
        conn.sendall(_HEAD + b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
        conn.sendall(_BODY[:10])  # then nothing: the client stalls
        answer, closed = _read_all(conn, 20)
        elapsed = time.monotonic() - started
    status, headers, body = _split(answer)
    assert status == b"HTTP/1.1 408 Request Timeout", answer[:300]
    assert elapsed >= BODY_TIMEOUT_S
    assert headers["connection"] == "close"
    assert headers["content-type"].startswith("application/json")
    assert json.loads(body) == {
        "error": {
            "message": "The request body did not arrive within 0.5 seconds.",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_timeout",
        }
    }
    assert closed, "the server kept the stalled connection open"
    assert state.requests == before  # nothing went upstream


def test_stalled_chunked_body_gets_a_408(stalls: tuple[ServerThread, FakeState, Path]) -> None:
    server, _, _ = stalls
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(_HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\n" + _BODY[:5] + b"\r\n")
        answer, closed = _read_all(conn, 20)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
    assert b'"request_timeout"' in answer
    assert closed


def test_slow_body_within_the_deadline_is_read_whole(
    stalls: tuple[ServerThread, FakeState, Path],
) -> None:
    """A body in three segments with pauses between them (well inside the deadline)
    is one body: one read of the stream would have returned its first segment only
    (a 400 invalid_json)."""
    server, _, _ = stalls
    head = _HEAD + b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(_BODY)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(head + b"Connection: close\r\n\r\n")
        third = len(_BODY) // 3
        for piece in (_BODY[:third], _BODY[third : 2 * third], _BODY[2 * third :]):
            conn.sendall(piece)
            time.sleep(BODY_TIMEOUT_S / 5)
        answer, closed = _read_all(conn, 10)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:400]
    assert closed


def test_client_that_stops_reading_a_stream_is_dropped_and_settled(
    stalls: tuple[ServerThread, FakeState, Path],
) -> None:
    server, state, tmp = stalls
    body = json.dumps(
        {
            "model": LONG_MODEL,
            "messages": [{"role": "user", "content": "a long story"}],
            "max_tokens": LONG_TOKENS,
            "stream": True,
        }
    ).encode()
    head = _HEAD + b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
    try:
        conn.settimeout(10)
        conn.connect(("127.0.0.1", server.port))
        conn.sendall(head + b"\r\n" + body)
        first = conn.recv(4096)  # the head and the first events; then never read again
        status, headers, _ = _split(first)
        assert status == b"HTTP/1.1 200 OK", first[:300]
        request_id = headers["x-request-id"]
        found = asyncio.run(_final_rows(tmp, request_id, 20))
        (row,) = found
        assert row.state != "reserved"
        _, closed = _read_all(conn, 20)  # what was buffered, then the server's close
        assert closed, "the server kept the stalled stream's connection open"
    finally:
        conn.close()
    deadline = time.monotonic() + 10
    while state.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state.in_flight == 0  # the upstream stream was closed too


async def _final_rows(tmp: Path, request_id: str, limit_s: float) -> list[object]:
    """The request's rows once none is ``reserved`` (the stalled stream was settled)."""
    deadline = time.monotonic() + limit_s
    while True:
        found = await rows(tmp, request_id)
        if found and all(r.state != "reserved" for r in found):
            return list(found)
        assert time.monotonic() < deadline, [r.state for r in found]
        await asyncio.sleep(0.1)
