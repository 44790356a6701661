"""Server-sent events, bytes to pieces: the upstream side of the streaming relay.

The relay works per socket read, not per event. ``EventSplitter`` takes the bytes of
each read and returns one ``StreamPiece``: every event the read completed, their bytes
kept whole (``raw``, relayed in one write, as they arrived) and the settlement fields of
each data event (``summaries``: choice indexes, finish reasons, usage), decoded by the
narrowest decoder (``ResponseSummary``, which skips everything else). Nothing is held
back: a read that completes one event gives a piece of one event.

Event ends are normalized as they always were: each line ends with ``\\n`` and an event
ends with one blank line (``\\n``); blank lines between events are dropped. Bytes already
in that form (the common case: ``data: {...}\\n\\n``) are relayed as they arrived without
being split into lines (``_fast``); anything else (``\\r\\n``, comments, multi-line data,
extra blank lines, a line still arriving past a piece's end) goes line by line.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable

import msgspec

from ncap.protocol.candidates import CandidateSummary
from ncap.protocol.responses import ResponseSummary

__all__ = [
    "DONE",
    "MAX_LINE_BYTES",
    "EventSplitter",
    "MalformedEvent",
    "StreamPiece",
    "choice_chunks",
    "encode_event",
    "event_data",
    "iter_pieces",
    "split_events",
]

DONE = b"data: [DONE]\n\n"
MAX_LINE_BYTES = 16 * 1024 * 1024
"""An event line longer than this is malformed (a bound on what one upstream event may
make the gateway buffer; real chunks are a few hundred bytes)."""
_decode_summary = msgspec.json.Decoder(ResponseSummary).decode
_decode_candidates = msgspec.json.Decoder(CandidateSummary).decode
_DecodeError = msgspec.DecodeError


class MalformedEvent(ValueError):
    """An event whose data is not the JSON of a chat.completion.chunk."""


class StreamPiece(msgspec.Struct, gc=False):
    """Whole events that arrived together. ``raw`` is relayed as-is (one or more events,
    each ending with its blank line); ``summaries`` holds each data event's settlement
    fields, in order (comments, keep-alives and ``[DONE]`` have none); ``done``: the
    piece ends with ``[DONE]`` (nothing after it is relayed). ``choice_tokens`` is set
    by a provider that knows each choice's output tokens (the local engine), on the
    piece carrying the usage; it is not part of the bytes relayed."""

    raw: bytes
    summaries: list[ResponseSummary]
    done: bool = False
    choice_tokens: tuple[int, ...] | None = None


def encode_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


class EventSplitter:
    """One stream's reads in, pieces out. After ``feed`` or ``end``, ``failure`` is set
    when a malformed event (or an over-long line) stopped the stream: the piece returned
    holds the events before it, and nothing more is parsed."""

    __slots__ = ("_decode", "_rest", "done", "failure")

    def __init__(self) -> None:
        self._rest = b""
        self.done = False
        self.failure: MalformedEvent | None = None
        self._decode: Callable[[bytes], ResponseSummary] = _decode_summary

    def read_candidates(self) -> None:
        """Summaries with each choice's text and tool calls as well
        (``CandidateSummary``): one decode serves settlement and the candidates'
        evidence of a stream of two or more candidates."""
        self._decode = _decode_candidates

    def feed(self, chunk: bytes) -> StreamPiece | None:
        if (
            not self._rest
            and chunk[-3:] == b"}\n\n"
            and chunk.startswith(b"data: {")
            and chunk.find(b"\n") == len(chunk) - 2
            and len(chunk) <= MAX_LINE_BYTES
            and not self.done
            and self.failure is None
        ):  # the most common read of all: one whole chunk event, alone
            try:
                return StreamPiece(chunk, [self._decode(chunk[6:])])
            except _DecodeError:
                pass  # reported event by event below
        if self.done or self.failure is not None:
            return None
        buf = self._rest + chunk if self._rest else chunk
        if len(buf) > MAX_LINE_BYTES or b"\r" in buf or buf[:1] == b"\n":
            return self._lines(buf, final=False)
        end = buf.rfind(b"\n\n") + 2
        if end < 2:
            self._rest = buf  # no event ends here yet
            return None
        self._rest = buf[end:]
        return self._fast(buf[:end])

    def end(self) -> StreamPiece | None:
        """The stream's end: an event cut off without its blank line still counts."""
        if self.done or self.failure is not None or not self._rest:
            return None
        rest, self._rest = self._rest, b""
        return self._lines(rest, final=True)

    def _fast(self, body: bytes) -> StreamPiece | None:
        """Events already in relayed form, one ``data:`` line each (the common case),
        ``[DONE]`` last or not at all: decoded without splitting lines. Anything else,
        and data that does not decode (a malformed event), goes event by event."""
        done = body == DONE or body.endswith(_DONE_LAST)
        head = body[: -len(DONE)] if done else body
        summaries = _decoded(head, self._decode) if head else []
        if summaries is not None:
            self.done = done
            return StreamPiece(body, summaries, done)
        if b"\n\n\n" in body:
            return self._lines(body + self._rest, final=False)
        return self._piece([e + b"\n\n" for e in body[:-2].split(b"\n\n")])

    def _lines(self, buf: bytes, *, final: bool) -> StreamPiece | None:
        """Line by line: each line ends with ``\\n`` (one without it gets one), a line
        blank but for ``\\r`` ends an event, blank lines between events are dropped."""
        events: list[bytes] = []
        lines: list[bytes] = []
        start = pos = 0
        size = len(buf)
        while pos < size:
            nl = buf.find(b"\n", pos)
            if nl < 0 and not final:
                break
            stop = size if nl < 0 else nl + 1
            if stop - pos - (nl >= 0) > MAX_LINE_BYTES:
                self.failure = MalformedEvent(f"an event line over {MAX_LINE_BYTES} bytes")
                return self._piece(events)
            line = buf[pos:stop]
            if line.rstrip(b"\r\n"):
                if not lines:
                    start = pos
                lines.append(line if nl >= 0 else line + b"\n")
            elif lines:
                events.append(b"".join(lines) + b"\n")
                lines = []
            pos = stop
        if final and lines:
            events.append(b"".join(lines) + b"\n")
            lines = []
        self._rest = buf[start:] if lines else buf[pos:]
        if size - pos > MAX_LINE_BYTES:  # a line still arriving is bounded too
            self.failure = MalformedEvent(f"an event line over {MAX_LINE_BYTES} bytes")
        return self._piece(events)

    def _piece(self, events: list[bytes]) -> StreamPiece | None:
        """Events one by one: a comment or keep-alive is relayed without a summary,
        ``[DONE]`` ends the stream, data that is not a chunk stops it (``failure``)."""
        summaries: list[ResponseSummary] = []
        kept = 0
        for event in events:
            data = event_data(event)
            if data == b"[DONE]":
                kept += 1
                self.done = True
                break
            if data:
                try:
                    summaries.append(self._decode(data))
                except _DecodeError as exc:
                    self.failure = MalformedEvent(str(exc))
                    break
            kept += 1
        if not kept:
            return None
        return StreamPiece(b"".join(events[:kept]), summaries, done=self.done)


_DONE_LAST = b"\n\n" + DONE


def _decoded(
    body: bytes, decode: Callable[[bytes], ResponseSummary]
) -> list[ResponseSummary] | None:
    """Each event's summary when every event of ``body`` is one ``data:`` line of JSON
    (None otherwise, or when one does not decode: then it is done event by event)."""
    count = body.count(b"\n\n")
    if not body.startswith(b"data: ") or body.count(b"\n") != 2 * count:
        return None
    try:
        if count == 1:
            return [decode(body[6:])]
        if body.count(b"\n\ndata: ") == count - 1:
            return [decode(d) for d in body[6:-2].split(b"\n\ndata: ")]
    except _DecodeError:
        pass
    return None


def event_data(event: bytes) -> bytes:
    """An event's data: its ``data:`` lines (without the field name and the spaces
    after it), joined by newlines; empty for a comment or keep-alive."""
    if event.startswith(b"data:") and event.count(b"\n") == 2 and event.endswith(b"\n\n"):
        return event[5:].rstrip(b"\r\n").lstrip(b" ")
    data = []
    for line in event.split(b"\n"):
        stripped = line.rstrip(b"\r\n")
        if stripped.startswith(b"data:"):
            data.append(stripped[5:].lstrip(b" "))
    return b"\n".join(data)


def choice_chunks(piece: StreamPiece) -> list[bytes]:
    """The data of the piece's events whose summary has choices, in order (the chunks a
    rewrite or the candidates' evidence reads; the usage chunk, comments and ``[DONE]``
    are not among them)."""
    summaries = piece.summaries
    if len(summaries) == 1 and piece.raw.count(b"\n") == 2:  # one event alone: that one
        return [event_data(piece.raw)] if summaries[0].choices else []
    if not any(s.choices for s in summaries):
        return []
    out = []
    each = iter(summaries)
    for event in split_events(piece.raw):
        data = event_data(event)
        if data and data != b"[DONE]" and next(each).choices:
            out.append(data)
    return out


def split_events(raw: bytes) -> list[bytes]:
    """A piece's ``raw`` back into its events (each with its blank line)."""
    return [e + b"\n\n" for e in raw[:-2].split(b"\n\n")] if raw else []


async def iter_pieces(chunks: AsyncIterable[bytes]) -> AsyncIterator[StreamPiece]:
    """The pieces of a body read in any pieces (lines, or whatever the socket gave);
    a malformed event raises ``MalformedEvent`` after the events before it; nothing
    after ``[DONE]`` is read."""
    splitter = EventSplitter()
    async for chunk in chunks:
        piece = splitter.feed(chunk)
        if piece is not None:
            yield piece
        if splitter.failure is not None:
            raise splitter.failure
        if splitter.done:
            return
    piece = splitter.end()
    if piece is not None:
        yield piece
    if splitter.failure is not None:
        raise splitter.failure
