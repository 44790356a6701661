"""Server-sent events, bytes to events: the upstream side of the streaming relay.

Each event's bytes are kept whole (``raw``) so the gateway relays exactly what arrived,
one event at a time, without re-encoding; the parsed ``ResponseSummary`` carries only
what settlement needs (indexes, finish reasons, usage).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

import msgspec

from ncap.protocol.responses import ResponseSummary

__all__ = ["DONE", "MAX_LINE_BYTES", "MalformedEvent", "StreamEvent", "encode_event", "iter_events"]

DONE = b"data: [DONE]\n\n"
MAX_LINE_BYTES = 16 * 1024 * 1024
"""An event line longer than this is malformed (a bound on what one upstream event may
make the gateway buffer; real chunks are a few hundred bytes)."""
_summary_decoder = msgspec.json.Decoder(ResponseSummary)


class MalformedEvent(ValueError):
    """An event whose data is not the JSON of a chat.completion.chunk."""


class StreamEvent(msgspec.Struct, frozen=True):
    """One event: ``raw`` is relayed as-is; ``summary`` is None for ``[DONE]`` and for
    events without data (comments, keep-alives); ``data`` is the event's JSON payload,
    kept so that whoever rewrites a chunk (the fan-out merge) need not re-split ``raw``."""

    raw: bytes
    summary: ResponseSummary | None
    done: bool = False
    data: bytes = b""
    # set by a provider that knows each choice's output tokens (the local engine), on
    # the event carrying the usage; not part of the bytes relayed
    choice_tokens: tuple[int, ...] | None = None


def encode_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


async def iter_events(chunks: AsyncIterable[bytes]) -> AsyncIterator[StreamEvent]:
    """Group lines into events (a blank line ends one) and decode each event's data.
    ``chunks`` are the body's bytes in any pieces (lines, or whatever the socket gave)."""
    raw: list[bytes] = []
    data: list[bytes] = []
    async for line in _split_lines(chunks):
        stripped = line.rstrip(b"\r\n")
        if stripped:
            raw.append(line)
            if stripped.startswith(b"data:"):
                data.append(stripped[5:].lstrip(b" "))
            continue
        if raw:
            yield _event(raw, data)
            raw, data = [], []
    if raw:
        yield _event(raw, data)


async def _split_lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """Lines, each with its ``\n``, however the bytes were cut; the last may lack it."""
    buf = bytearray()
    async for chunk in chunks:
        scanned = len(buf)  # the kept tail holds no newline: search only the new bytes
        buf += chunk
        start = 0
        while (end := buf.find(b"\n", scanned)) >= 0:
            _bounded(end - start)
            yield bytes(buf[start : end + 1])
            start = scanned = end + 1
        del buf[:start]
        _bounded(len(buf))  # a line still arriving is bounded too
    if buf:
        yield bytes(buf)


def _bounded(line_bytes: int) -> None:
    if line_bytes > MAX_LINE_BYTES:
        raise MalformedEvent(f"an event line over {MAX_LINE_BYTES} bytes")


def _event(raw: list[bytes], data: list[bytes]) -> StreamEvent:
    payload = b"\n".join(data)
    body = b"".join(line if line.endswith(b"\n") else line + b"\n" for line in raw) + b"\n"
    if not payload or payload == b"[DONE]":
        return StreamEvent(body, None, done=bool(payload))
    try:
        summary = _summary_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedEvent(str(exc)) from exc
    return StreamEvent(body, summary, data=payload)
