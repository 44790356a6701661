"""The single relay: one upstream stream forwarded as it arrived, one write per upstream
read (every event that read completed, bytes unchanged), and settled once when it ends
or is cut (a cut stream stays pending with its hold)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec

from ncap.errors import NcapError, UpstreamError
from ncap.lifecycle.attempts import StreamOpen
from ncap.lifecycle.failures import stream_cut
from ncap.lifecycle.plan import Attempt
from ncap.lifecycle.reports import Tally, stream_report
from ncap.lifecycle.settle import Accounting
from ncap.providers.base import AttemptFailed
from ncap.streaming.sse import StreamPiece, encode_event, event_data, split_events

__all__ = ["error_event", "relay"]

_encode = msgspec.json.Encoder().encode


async def relay(
    accounting: Accounting, attempt: Attempt, opened: StreamOpen
) -> AsyncIterator[bytes]:
    """Forward each upstream piece as it arrives; the attempt is closed in ``finally``
    whatever ends the stream (its end, a cut, the client going away)."""
    tally = Tally(provider_request_id=opened.provider_request_id)
    wants_usage = attempt.plan.client_wants_usage
    cut: str | None = "client_disconnect"
    try:
        async with opened.stack:
            piece = opened.first
            events = opened.events
            while piece is not None:
                out = _take(piece, tally, wants_usage)
                if out:
                    yield out
                if tally.done:
                    break
                piece = await anext(events, None)
            cut = None if tally.done else "stream_truncated"
            if cut:
                yield error_event(UpstreamError("The upstream stream ended early."))
    except (AttemptFailed, NcapError) as exc:
        cut, error = stream_cut(exc)
        yield error_event(error)
    finally:
        await asyncio.shield(accounting.stream_finished(attempt, stream_report(tally, cut)))


def _take(piece: StreamPiece, tally: Tally, client_wants_usage: bool) -> bytes:
    """The piece's bytes for the client, its summaries counted on the way."""
    if piece.done:
        tally.done = True
    if piece.choice_tokens is not None:
        tally.choice_tokens = piece.choice_tokens
    if tally.add_all(piece.summaries) and not client_wants_usage:
        return _without_usage(piece.raw)
    return piece.raw


def _without_usage(raw: bytes) -> bytes:
    """The piece with the usage the client did not ask for taken out: the usage chunk
    the gateway asked for on its own behalf is dropped, and a choice chunk that also
    carries usage (some upstreams put it on the last one) is re-encoded without it
    (the only chunk re-encoded). Once per stream: the other events are kept as they are."""
    out = []
    for event in split_events(raw):
        data = event_data(event)
        if not data.startswith(b"{") or b'"usage"' not in data:
            out.append(event)
            continue
        chunk = msgspec.json.decode(data)
        if not isinstance(chunk, dict) or chunk.get("usage") is None:
            out.append(event)
        elif chunk.get("choices"):
            chunk.pop("usage", None)
            out.append(encode_event(_encode(chunk)))
    return b"".join(out)


def error_event(error: NcapError) -> bytes:
    return encode_event(_encode(error.envelope()))
