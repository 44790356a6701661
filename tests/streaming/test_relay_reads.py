"""The relay works per upstream read, and the reads' cuts never show: an event that
arrives alone is forwarded before the next one is even sent, and the same stream cut
into reads at any byte offset (events split across reads, many events in one read,
``\\r\\n`` line ends, comments, keep-alives) gives the client the same bytes and the
ledger the same settlement.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from ncap.http.app import create_app
from ncap.streaming.sse import EventSplitter, StreamPiece, iter_pieces, split_events
from tests.streaming.recorded import RecordedTransport, gateway, openai_provider, play
from tests.support import gateway_config

_enc = msgspec.json.Encoder().encode


def _chunk(index: int | None, content: str | None = None, **extra: Any) -> bytes:
    choices = []
    if index is not None:
        delta = {} if content is None else {"content": content}
        choices = [{"index": index, "delta": delta, "finish_reason": extra.pop("finish", None)}]
    body = {"id": "chatcmpl-r", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return _enc({**body, "choices": choices, **extra})


# -- an event that arrives alone is forwarded before the next is sent -------------------

PAUSE_S = 0.12
SENT = web.AppKey("sent", list[float])


async def _pausing_upstream(request: web.Request) -> web.StreamResponse:
    """Two choices, interleaved, one event per write with a pause after each; the send
    time of every event is kept for the test."""
    sent: list[float] = request.app[SENT]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    events = [_chunk(i, f"w{t}") for t in range(3) for i in range(2)]
    events += [_chunk(i, finish="stop") for i in range(2)]
    usage = {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    events.append(_chunk(None, usage=usage))
    for data in events:
        sent.append(time.monotonic())
        await resp.write(b"data: " + data + b"\n\n")
        await asyncio.sleep(PAUSE_S)
    sent.append(time.monotonic())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def test_each_event_is_forwarded_before_the_next_arrives(tmp_path: Path) -> None:
    upstream = web.Application()
    upstream[SENT] = []
    upstream.router.add_post("/v1/chat/completions", _pausing_upstream)
    async with TestServer(upstream) as up:
        config = gateway_config(
            str(up.make_url("/v1")),
            tmp_path,
            stores={"ledger": "memory://", "budgets": "memory://"},
            workloads={"default": {"max_candidates": 4}},
        )
        async with TestServer(create_app(config, instance_id="t")) as gw:
            client = openai.AsyncOpenAI(base_url=str(gw.make_url("/v1")), api_key="x")
            stream = await client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}], n=2, stream=True
            )
            arrivals = [time.monotonic() async for _ in stream]
            await client.close()
    sent = upstream[SENT]
    assert len(arrivals) == 8  # six words, two finishes (the usage chunk was not asked for)
    for i, arrived in enumerate(arrivals):
        # event i reached the client before the upstream even sent event i + 1
        assert arrived < sent[i + 1], (i, arrived - sent[i], sent[i + 1] - sent[i])


def test_a_lone_event_is_a_piece_at_once() -> None:
    """Nothing is held back to fill a batch: each read that completes an event gives a
    piece with it, however small."""
    splitter = EventSplitter()
    one = b"data: " + _chunk(0, "a") + b"\n\n"
    piece = splitter.feed(one)
    assert piece is not None and piece.raw == one and len(piece.summaries) == 1
    assert splitter.feed(one[:10]) is None  # an event not complete yet: nothing to relay
    piece = splitter.feed(one[10:] + b": keep-alive\n\n")
    assert piece is not None and piece.raw == one + b": keep-alive\n\n"


# -- reads cut anywhere: same bytes, same settlement --------------------------------------


def _stream(eol: bytes) -> bytes:
    """Two choices with comments, keep-alives, a multi-line event, usage, ``[DONE]``."""
    parts = [b": keep-alive" + eol + eol]
    for t in range(3):
        for i in range(2):
            parts.append(b"data: " + _chunk(i, f"t{t}{i} \\n é") + eol + eol)
        parts.append(b": ping" + eol + eol)
    parts.append(b"event: chunk" + eol + b"data: " + _chunk(0, finish="stop") + eol + eol)
    finish = _chunk(1, finish="length").replace(
        b',"finish_reason"', eol + b'data: ,"finish_reason"'
    )
    parts.append(b"data:" + finish + eol + eol + eol)
    usage = {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}
    parts.append(b"data: " + _chunk(None, usage=usage) + eol + eol)
    return b"".join(parts) + b"data: [DONE]" + eol + eol


def _flat(pieces: list[StreamPiece]) -> list[tuple[bytes, Any]]:
    """Each event's bytes with its summary, whatever the pieces were."""
    out = []
    for piece in pieces:
        summaries = iter(piece.summaries)
        for event in split_events(piece.raw):
            is_data = b"data:" in event and b"[DONE]" not in event
            out.append((event, msgspec.to_builtins(next(summaries)) if is_data else None))
    return out


async def _pieces(reads: list[bytes]) -> list[StreamPiece]:
    async def feed() -> AsyncIterator[bytes]:
        for read in reads:
            yield read

    return [piece async for piece in iter_pieces(feed())]


def _cuts(text: bytes, offsets: list[int]) -> list[bytes]:
    bounds = [0, *sorted(offsets), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"], ids=["lf", "crlf"])
async def test_the_splitter_gives_the_same_events_however_the_reads_fall(eol: bytes) -> None:
    text = _stream(eol)
    want = _flat(await _pieces([text[i : i + 1] for i in range(len(text))]))  # byte by byte
    assert len(want) == 14 and want[-1][0].startswith(b"data: [DONE]")
    assert _flat(await _pieces([text])) == want  # all events in one read
    for cut in range(1, len(text)):  # one event split across two reads, at every offset
        assert _flat(await _pieces(_cuts(text, [cut]))) == want, cut
    rng = random.Random(7)
    for _ in range(300):  # three and four reads, cut anywhere
        offsets = rng.sample(range(1, len(text)), rng.choice([2, 3]))
        assert _flat(await _pieces(_cuts(text, offsets))) == want, offsets


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"], ids=["lf", "crlf"])
async def test_relayed_bytes_and_settlement_do_not_depend_on_the_reads(
    eol: bytes, tmp_path: Path
) -> None:
    """Through the real OpenAI provider and the whole lifecycle: the reference is one
    read per byte; every single cut offset, one read for everything, and seeded random
    multi-cuts give the same client bytes and the same settled row."""
    text = _stream(eol)
    plans = [[text[i : i + 1] for i in range(len(text))], [text]]
    plans += [_cuts(text, [cut]) for cut in range(1, len(text))]
    rng = random.Random(11)
    plans += [_cuts(text, rng.sample(range(1, len(text)), 5)) for _ in range(50)]
    transport = RecordedTransport([(reads, None) for reads in plans])
    h = gateway(tmp_path, openai_provider(transport))
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2}
    want = None
    for number in range(len(plans)):
        got = await play(h, body, request_id=f"req-{number}")
        got.pop("held")
        if want is None:
            want = got
            row = want["rows"][0]
            assert row["state"] == "settled" and row["input_tokens"] == 7
            assert row["finish_reasons"] == {"stop": 1, "length": 1}
            assert b"usage" not in want["out"].encode()  # stripped: the client did not ask
            continue
        assert got == want, number
    assert await h.outstanding() == []
