"""The single relay: one upstream stream forwarded as it arrived, one write per upstream
read (every event that read completed, bytes unchanged), and settled once when it ends
or is cut (a cut stream stays pending with its hold)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec

from ncap.errors import NcapError, UpstreamError
from ncap.lifecycle.attempt_report import Tally, stream_report
from ncap.lifecycle.attempts import StreamOpen
from ncap.lifecycle.evidence import EvidenceFeed
from ncap.lifecycle.failures import stream_cut
from ncap.lifecycle.plan import Attempt
from ncap.lifecycle.settle import Accounting
from ncap.providers.base import AttemptFailed
from ncap.streaming.sse import StreamPiece, encode_event, event_data

__all__ = ["error_event", "relay"]

_encode = msgspec.json.Encoder().encode


async def relay(
    accounting: Accounting, attempt: Attempt, opened: StreamOpen
) -> AsyncIterator[bytes]:
    """Forward each upstream piece as it arrives; the attempt is closed in ``finally``
    whatever ends the stream (its end, a cut, the client going away)."""
    tally = Tally(provider_request_id=opened.provider_request_id)
    if attempt.plan.expected_returned > 1:
        tally.evidence = EvidenceFeed()
    wants_usage = attempt.plan.client_wants_usage
    cut: str | None = "client_disconnect"
    try:
        async with opened.stack:
            if opened.first is not None:
                out = _take(opened.first, tally, wants_usage)
                if out:
                    yield out
                if not tally.done:
                    async for piece in opened.events:  # one iteration per upstream read
                        out = _take(piece, tally, wants_usage)
                        if out:
                            yield out
                        if tally.done:
                            break
            cut = None if tally.done else "stream_truncated"
            if cut:
                yield error_event(UpstreamError("The upstream stream ended early."))
    except (AttemptFailed, NcapError) as exc:
        health = attempt.route.health
        if health is not None:
            health.failed(exc)  # the upstream failed mid-way
        cut, error = stream_cut(exc)
        yield error_event(error)
    finally:
        await asyncio.shield(accounting.stream_finished(attempt, stream_report(tally, cut)))


def _take(piece: StreamPiece, tally: Tally, client_wants_usage: bool) -> bytes:
    """The piece's bytes for the client, its summaries counted on the way (and, for
    the candidates' evidence, kept for the feed to read)."""
    if piece.done:
        tally.done = True
    if piece.choice_tokens is not None:
        tally.choice_tokens = piece.choice_tokens
    usage_seen = tally.add_all(piece.summaries)
    if tally.evidence is not None:
        tally.evidence.piece(piece.raw, piece.summaries)
    if usage_seen and not client_wants_usage:
        return _without_usage(piece.raw)
    return piece.raw


def _without_usage(raw: bytes) -> bytes:
    """The piece with the usage the client did not ask for taken out: the usage chunk
    the gateway asked for on its own behalf is dropped, and a choice chunk that also
    carries usage (some upstreams put it on the last one) is re-encoded without it
    (the only chunk re-encoded). Only the events that name ``usage`` are looked at: a
    piece's events end with a blank line, and only there (``StreamPiece``)."""
    out = []
    start = 0
    at = raw.find(b'"usage"')
    while at >= 0:
        begin = raw.rfind(b"\n\n", start, at)
        begin = start if begin < 0 else begin + 2
        end = raw.find(b"\n\n", at) + 2
        out.append(raw[start:begin])
        out.append(_event_without_usage(raw[begin:end]))
        start = end
        at = raw.find(b'"usage"', start)
    out.append(raw[start:])
    return b"".join(out)


def _event_without_usage(event: bytes) -> bytes:
    data = event_data(event)
    if not data.startswith(b"{"):
        return event
    chunk = msgspec.json.decode(data)
    if not isinstance(chunk, dict) or chunk.get("usage") is None:
        return event
    if not chunk.get("choices"):
        return b""
    chunk.pop("usage", None)
    return encode_event(_encode(chunk))


def error_event(error: NcapError) -> bytes:
    return encode_event(_encode(error.envelope()))
