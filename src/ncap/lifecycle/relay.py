"""The single relay: one upstream stream forwarded event by event, as it arrived, and
settled once when it ends or is cut (a cut stream stays pending with its hold)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec

from ncap.errors import NcapError, UpstreamError
from ncap.lifecycle.attempts import StreamOpen
from ncap.lifecycle.evidence import EvidenceFeed
from ncap.lifecycle.failures import stream_cut
from ncap.lifecycle.plan import Attempt
from ncap.lifecycle.reports import Tally, stream_report
from ncap.lifecycle.settle import Accounting
from ncap.providers.base import AttemptFailed
from ncap.streaming.sse import DONE, StreamEvent, encode_event

__all__ = ["error_event", "relay"]

_encode = msgspec.json.Encoder().encode


async def relay(
    accounting: Accounting, attempt: Attempt, opened: StreamOpen
) -> AsyncIterator[bytes]:
    """Forward each upstream event as it arrives; the attempt is closed in ``finally``
    whatever ends the stream (its end, a cut, the client going away)."""
    tally = Tally(provider_request_id=opened.provider_request_id)
    if attempt.plan.expected_returned > 1:
        tally.evidence = EvidenceFeed()
    wants_usage = attempt.plan.client_wants_usage
    cut: str | None = "client_disconnect"
    try:
        async with opened.stack:
            event = opened.first
            while event is not None:
                out = _take(event, tally, wants_usage)
                if out:
                    yield out
                if tally.done:
                    break
                event = await anext(opened.events, None)
            cut = None if tally.done else "stream_truncated"
            if cut:
                yield error_event(UpstreamError("The upstream stream ended early."))
    except (AttemptFailed, NcapError) as exc:
        cut, error = stream_cut(exc)
        yield error_event(error)
    finally:
        await asyncio.shield(accounting.stream_finished(attempt, stream_report(tally, cut)))


def _take(event: StreamEvent, tally: Tally, client_wants_usage: bool) -> bytes | None:
    if event.summary is None:
        tally.done = event.done or event.raw == DONE
        return event.raw
    tally.add(event.summary)
    if tally.evidence is not None and event.summary.choices:
        tally.evidence.chunk(event.data)
    if event.choice_tokens is not None:
        tally.choice_tokens = event.choice_tokens
    if event.summary.usage is None or client_wants_usage:
        return event.raw
    if not event.summary.choices:
        return None  # the usage chunk the gateway asked for on its own behalf
    return _without_usage(event.data)


def _without_usage(data: bytes) -> bytes:
    """A choice chunk that also carries usage (some upstreams put it on the last one),
    re-encoded without it for a client that did not ask: the only chunk re-encoded."""
    chunk = msgspec.json.decode(data)
    chunk.pop("usage", None)
    return encode_event(_encode(chunk))


def error_event(error: NcapError) -> bytes:
    return encode_event(_encode(error.envelope()))
