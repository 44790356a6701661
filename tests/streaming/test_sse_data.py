"""SSE bytes to data payloads, as upstreams frame them (LF or CRLF, fragmented lines,
comments, multi-line data, a cut-off last event)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from ncap.streaming.sse_data import iter_data


async def _lines(text: bytes) -> AsyncIterator[bytes]:
    for line in text.splitlines(keepends=True):
        yield line


@pytest.mark.parametrize(
    ("text", "payloads"),
    [
        (b'data: {"a":1}\r\n\r\ndata: {"b":2}\r\n\r\n', [b'{"a":1}', b'{"b":2}']),
        (b'data: {"a":1}\n\ndata: {"b":2}\n\n', [b'{"a":1}', b'{"b":2}']),
        (b": keep-alive\n\nevent: x\ndata: one\ndata: two\n\n", [b"one\ntwo"]),
        (b"data:nospace\n\n\n\n", [b"nospace"]),
        (b'data: {"cut":', [b'{"cut":']),
        (b"", []),
    ],
    ids=[
        "crlf",
        "lf",
        "comment and multi-line data",
        "no space, extra blank lines",
        "cut",
        "empty",
    ],
)
async def test_iter_data(text: bytes, payloads: list[bytes]) -> None:
    assert [p async for p in iter_data(_lines(text))] == payloads
