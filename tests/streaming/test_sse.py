"""The SSE parser, table-driven on inline text: events, comments, CRLF, multi-line data,
partial events at the end of a stream, and bytes that arrive in arbitrary pieces. The
parser gives one piece per read (every event the read completed); ``flatten`` takes
the pieces apart again so that each event's bytes and summary can be checked.

Two feeds: the text split into lines, and a real ``aiohttp.StreamReader`` fed in small
fragments and read as the OpenAI provider reads it (``resp.content.iter_any()``: the
pieces as they arrived), so ``iter_events`` reassembles split lines itself and a line
longer than aiohttp's line buffer is no ``LineTooLong``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from unittest import mock

import aiohttp
import pytest

from ncap.protocol.responses import ResponseSummary
from ncap.streaming import sse
from ncap.streaming.sse import (
    DONE,
    EventSplitter,
    MalformedEvent,
    StreamPiece,
    choice_chunks,
    encode_event,
    event_data,
    iter_pieces,
    split_events,
)

CHUNK = b'{"id":"c1","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}'
FINISH = b'{"id":"c1","choices":[{"index":1,"delta":{},"finish_reason":"length"}]}'
USAGE = b'{"id":"c1","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5}}'


async def _lines(text: bytes) -> AsyncIterator[bytes]:
    for line in text.splitlines(keepends=True):
        yield line


@dataclass(frozen=True)
class StreamEvent:
    """One event of a piece, with its summary (None for comments and ``[DONE]``)."""

    raw: bytes
    summary: ResponseSummary | None
    done: bool


def flatten(pieces: list[StreamPiece]) -> list[StreamEvent]:
    """The pieces' events one by one, each with its own summary."""
    out = []
    for piece in pieces:
        summaries = iter(piece.summaries)
        for raw in split_events(piece.raw):
            data = event_data(raw)
            done = data == b"[DONE]"
            out.append(StreamEvent(raw, next(summaries) if data and not done else None, done))
        assert next(summaries, None) is None  # one summary per data event
        assert piece.done == (bool(out) and out[-1].done)
    return out


async def iter_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[StreamEvent]:
    async for piece in iter_pieces(chunks):
        for event in flatten([piece]):
            yield event


async def _parse(text: bytes) -> list[StreamEvent]:
    return [event async for event in iter_events(_lines(text))]


def _reader(loop: asyncio.AbstractEventLoop) -> aiohttp.StreamReader:
    protocol = mock.Mock(_reading_paused=False)
    return aiohttp.StreamReader(protocol, 2**16, loop=loop)


async def _parse_fragmented(text: bytes, size: int) -> list[StreamEvent]:
    reader = _reader(asyncio.get_running_loop())
    for start in range(0, len(text), size):
        reader.feed_data(text[start : start + size])
    reader.feed_eof()
    return [event async for event in iter_events(reader.iter_any())]


@dataclass(frozen=True)
class Case:
    """``shape``: per event (id, [(index, finish)], usage prompt tokens or None, done)."""

    name: str
    text: bytes
    shape: list[tuple[str | None, list[tuple[int | None, str | None]], int | None, bool]]
    raws: list[bytes] | None = None  # exact relayed bytes, when they are pinned


CASES = [
    Case("one event", b"data: " + CHUNK + b"\n\n", [("c1", [(0, None)], None, False)],
         [b"data: " + CHUNK + b"\n\n"]),
    Case("no space after the colon", b"data:" + CHUNK + b"\n\n",
         [("c1", [(0, None)], None, False)]),
    Case("events in a row, then DONE",
         b"data: " + CHUNK + b"\n\ndata: " + FINISH + b"\n\ndata: " + USAGE + b"\n\n" + DONE,
         [("c1", [(0, None)], None, False), ("c1", [(1, "length")], None, False),
          ("c1", [], 7, False), (None, [], None, True)],
         [b"data: " + CHUNK + b"\n\n", b"data: " + FINISH + b"\n\n", b"data: " + USAGE + b"\n\n",
          DONE]),
    Case("comment (keep-alive) is an event without data",
         b": keep-alive\n\ndata: " + CHUNK + b"\n\n",
         [(None, [], None, False), ("c1", [(0, None)], None, False)],
         [b": keep-alive\n\n", b"data: " + CHUNK + b"\n\n"]),
    Case("comment inside an event is kept in its bytes",
         b": note\ndata: " + CHUNK + b"\n\n", [("c1", [(0, None)], None, False)],
         [b": note\ndata: " + CHUNK + b"\n\n"]),
    Case("CRLF line endings", b"data: " + CHUNK + b"\r\n\r\ndata: [DONE]\r\n\r\n",
         [("c1", [(0, None)], None, False), (None, [], None, True)],
         [b"data: " + CHUNK + b"\r\n\n", b"data: [DONE]\r\n\n"]),
    Case("multi-line data is joined with newlines",
         b'data: {"id":"c2",\ndata: "choices":[{"index":3,\ndata: "finish_reason":"stop"}]}\n\n',
         [("c2", [(3, "stop")], None, False)]),
    Case("other fields (event, id, retry) ride along",
         b"event: message\nid: 42\nretry: 1000\ndata: " + CHUNK + b"\n\n",
         [("c1", [(0, None)], None, False)],
         [b"event: message\nid: 42\nretry: 1000\ndata: " + CHUNK + b"\n\n"]),
    Case("blank lines between events make no empty events",
         b"\n\n\ndata: " + CHUNK + b"\n\n\n\n" + DONE,
         [("c1", [(0, None)], None, False), (None, [], None, True)]),
    Case("an event cut before its blank line still comes out (end of stream)",
         b"data: " + CHUNK + b"\n\ndata: " + FINISH,
         [("c1", [(0, None)], None, False), ("c1", [(1, "length")], None, False)],
         [b"data: " + CHUNK + b"\n\n", b"data: " + FINISH + b"\n\n"]),
    Case("DONE without a trailing blank line", b"data: [DONE]", [(None, [], None, True)], [DONE]),
    Case("usage on a choice chunk",
         b'data: {"id":"c3","choices":[{"index":0,"finish_reason":"stop"}],'
         b'"usage":{"prompt_tokens":9,"completion_tokens":1}}\n\n',
         [("c3", [(0, "stop")], 9, False)]),
    Case("an event with only a field other than data has no summary", b"event: ping\n\n",
         [(None, [], None, False)], [b"event: ping\n\n"]),
    Case("empty stream", b"", []),
]  # fmt: skip


def _shape(events: list[StreamEvent]) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for e in events:
        s = e.summary
        if s is None:
            out.append((None, [], None, e.done))
            continue
        choices = [(c.index, c.finish_reason) for c in s.choices]
        out.append((s.id, choices, s.usage.prompt_tokens if s.usage else None, e.done))
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_events_from_lines(case: Case) -> None:
    events = await _parse(case.text)
    assert _shape(events) == case.shape
    if case.raws is not None:
        assert [e.raw for e in events] == case.raws


@pytest.mark.parametrize("size", [1, 3, 7, 64])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_events_from_fragments_through_aiohttp(case: Case, size: int) -> None:
    events = await _parse_fragmented(case.text, size)
    assert _shape(events) == case.shape
    if case.raws is not None:
        assert [e.raw for e in events] == case.raws


@pytest.mark.parametrize(
    "text",
    [
        b"data: {not json}\n\n",
        b'data: {"id":"c1","choices":[{"index":0\n\n',  # cut inside the JSON
        b"data: [1, 2]\n\n",  # JSON, but not a chunk object
        b'data: {"choices":"nope"}\n\n',  # a chunk of the wrong shape
    ],
)
async def test_malformed_data_raises_after_the_good_events(text: bytes) -> None:
    seen: list[StreamEvent] = []
    with pytest.raises(MalformedEvent):
        async for event in iter_events(_lines(b"data: " + CHUNK + b"\n\n" + text)):
            seen.append(event)
    assert [e.raw for e in seen] == [b"data: " + CHUNK + b"\n\n"]  # the good one came first


def test_malformed_event_is_a_value_error() -> None:
    assert issubclass(MalformedEvent, ValueError)


def test_encode_event_round_trips() -> None:
    assert encode_event(CHUNK) == b"data: " + CHUNK + b"\n\n"
    assert DONE == b"data: [DONE]\n\n"


async def test_encoded_events_parse_back() -> None:
    events = await _parse(encode_event(CHUNK) + encode_event(FINISH) + DONE)
    assert [e.raw for e in events] == [encode_event(CHUNK), encode_event(FINISH), DONE]
    assert [e.done for e in events] == [False, False, True]


async def test_a_long_event_line_is_parsed_from_the_reader() -> None:
    event = b'data: {"id":"' + b"x" * 300_000 + b'","choices":[]}\n\n'
    events = await _parse_fragmented(event, 65_536)
    assert [e.raw for e in events] == [event]


@pytest.mark.parametrize("cut", [0, 1, 5, 6, 299_000, 300_020])
async def test_a_long_line_split_anywhere_is_one_event(cut: int) -> None:
    event = b'data: {"id":"' + b"y" * 300_000 + b'","choices":[]}\n\n' + DONE

    async def pieces() -> AsyncIterator[bytes]:
        yield event[:cut]
        yield event[cut:]

    events = [e async for e in iter_events(pieces())]
    assert [e.raw for e in events] == [event[: -len(DONE)], DONE]
    assert events[0].summary is not None and events[0].summary.id == "y" * 300_000


async def test_a_line_over_the_bound_is_malformed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound on one line's buffer: over it the stream is malformed (the provider
    makes that a protocol failure: the client gets an error event, the row a cut)."""
    monkeypatch.setattr(sse, "MAX_LINE_BYTES", 100)
    ok = b"data: " + CHUNK + b"\n\n"
    seen: list[StreamEvent] = []
    with pytest.raises(MalformedEvent, match="over 100 bytes"):
        async for e in iter_events(_lines(ok + b"data: " + b"z" * 101)):
            seen.append(e)
    assert [e.raw for e in seen] == [ok]

    async def at_the_bound() -> AsyncIterator[bytes]:
        yield b": " + b"z" * 98  # 100 bytes buffered before its newline arrives
        yield b"\n\n"

    events = [e async for e in iter_events(at_the_bound())]
    assert [e.raw for e in events] == [b": " + b"z" * 98 + b"\n\n"]


def test_choice_chunks_are_the_data_of_the_events_with_choices() -> None:
    text = b'data: {"choices":[{"index":0}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\n'
    alone = EventSplitter().feed(text)
    assert alone is not None and choice_chunks(alone) == [text[6:-2]]
    only_usage = EventSplitter().feed(usage)
    assert only_usage is not None and choice_chunks(only_usage) == []
    several = EventSplitter().feed(b": keep-alive\n\n" + text + usage + text + DONE)
    assert several is not None
    assert choice_chunks(several) == [text[6:-2], text[6:-2]]
