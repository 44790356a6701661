"""Malformed HTTP over a raw socket: a 400, one log line, no traceback, no echoed bytes."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from tests.hardening.conftest import CLIENT_KEY
from tests.support import ServerThread

CANARY = b"CANARYzq81"
_BODY = b'{"model":"fake-model","messages":[{"role":"user","content":"hi"}]}'
_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + CLIENT_KEY.encode()
)

CASES = {
    "nul in a header value": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\x00"
    + CANARY
    + b"\r\n\r\n",
    "control byte in a header name": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX\x01"
    + CANARY
    + b": v\r\n\r\n",
    "broken request line": b"GET /v1/models HTTP/1.1 " + CANARY + b"\r\nHost: x\r\n\r\n",
    "not HTTP at all": CANARY + b" \x16\x03\x01\x00\xa5\r\n\r\n",
    "bad http version": b"GET /v1/models HTTP/9." + CANARY + b"\r\nHost: x\r\n\r\n",
    "huge header": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + CANARY * 10_000 + b"\r\n\r\n",
    "too many headers": b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
    + b"".join(b"X-%d: %s\r\n" % (i, CANARY) for i in range(300))
    + b"\r\n",
    "bad chunk size": _HEAD + b"\r\nTransfer-Encoding: chunked\r\n\r\nzz" + CANARY + b"\r\n",
    "content-length and chunked": _HEAD
    + b"\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "negative content-length": _HEAD + b"\r\nContent-Length: -1\r\n\r\n",
    # found by the header fuzz: h11 sends it, aiohttp refuses a repeated singleton
    "content-type twice": _HEAD
    + b"\r\nContent-Type: application/json\r\ncontent-type: "
    + CANARY
    + b"\r\nContent-Length: 2\r\n\r\n{}",
}


def _send(gw: ServerThread, raw: bytes, *, half_close: bool = False) -> bytes:
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as conn:
        conn.sendall(raw)
        if half_close:
            conn.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            try:
                data = conn.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks)


def _gateway_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    time.sleep(0.2)  # the server thread logs after it answered
    return [r for r in caplog.records if r.name.startswith(("aiohttp", "ncap"))]


def _assert_clean(records: list[logging.LogRecord], at_most: int = 1) -> None:
    assert len(records) <= at_most, [r.getMessage() for r in records]
    for record in records:
        assert record.exc_info is None and record.exc_text is None, record.getMessage()
        assert "Traceback" not in record.getMessage()
        assert CANARY.decode() not in record.getMessage()
        assert "\n" not in record.getMessage()


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_request_gets_400_and_one_clean_line(
    hgw: ServerThread, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    caplog.set_level(logging.DEBUG)
    answer = _send(hgw, CASES[name])
    assert answer.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")), answer[:200]
    _assert_clean(_gateway_records(caplog))


def test_truncated_chunked_body_is_a_400(
    hgw: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    """The client sends half a chunk and closes its side: the body read fails in the
    handler, which must be a client error (was a 500 and an internal-error log line)."""
    caplog.set_level(logging.DEBUG)
    raw = _HEAD + b"\r\nTransfer-Encoding: chunked\r\n\r\n40\r\n" + _BODY[:20]
    answer = _send(hgw, raw, half_close=True)
    if answer:  # the peer half-closed, so an answer may or may not be deliverable
        assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
        assert b'"invalid_request_error"' in answer
    records = _gateway_records(caplog)
    _assert_clean(records)
    assert not [r for r in records if r.levelno >= logging.ERROR], [r.getMessage() for r in records]


def test_truncated_content_length_body_is_not_a_500(
    hgw: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    raw = _HEAD + b"\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n" + _BODY
    answer = _send(hgw, raw, half_close=True)
    assert not answer.startswith(b"HTTP/1.1 5"), answer[:300]
    records = _gateway_records(caplog)
    _assert_clean(records)
    assert not [r for r in records if r.levelno >= logging.ERROR], [r.getMessage() for r in records]


def test_server_still_answers_afterwards(hgw: ServerThread) -> None:
    raw = _HEAD + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(_BODY) + _BODY
    assert _send(hgw, raw).startswith(b"HTTP/1.1 200")
