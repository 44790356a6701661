"""The hook between relayed answers and ``ncap.domain.evidence``: a whole body's
choices, or a stream's events, fed to one ``Candidates`` per request.

``EvidenceFeed.piece`` is what a relay calls per write (the native relay per upstream
read, the fan-out merge per merged write, its branches' choices at their indexes). A
stream of two or more candidates from an OpenAI-compatible upstream is decoded once:
its splitter reads each event into ``CandidateSummary`` (settlement's summary with the
candidates' text and tool calls), which the feed takes as it is. Other streams hand
their bytes (a reference the relay holds anyway), read together once ``HOLD_BYTES`` of
them are kept and when the answer ends, in one decode of only the candidates' text
and tool calls (``ncap.protocol.candidates``). Either way each candidate's text deltas
are kept and hashed as one string (the digests are those of one delta at a time: the
normalization is the same over any split of the text). Nothing here can fail a
request: an answer whose candidates cannot be read yields no evidence.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import msgspec

from ncap.domain.evidence import Candidates, Evidence
from ncap.protocol.candidates import CandidateSummary, CandidatesWire, ChoiceWire, MessageWire
from ncap.protocol.responses import ResponseSummary
from ncap.streaming.sse import event_data

__all__ = ["EvidenceFeed", "evidence_headers"]

_decode = msgspec.json.Decoder(CandidatesWire).decode
_decode_all = msgspec.json.Decoder(list[CandidatesWire]).decode
# the stream events kept before they are read together (a bound on the memory a long
# stream's evidence holds; about 400 chunk events)
HOLD_BYTES = 64 * 1024
_PENDING_PARTS = 4096  # text deltas kept before they are hashed (a bound on memory)
# the hashes' key, one per process (immutable): a digest means nothing outside it, and
# none is ever stored
_PROCESS_KEY = os.urandom(32)


class EvidenceFeed:
    """One request's candidates as they pass (``body`` per whole answer, ``piece``
    per relayed stream piece), then ``finish`` once."""

    __slots__ = ("_candidates", "_held_bytes", "_parts", "_pending", "_pieces", "_unreadable")

    def __init__(self) -> None:
        self._candidates = Candidates(_PROCESS_KEY)
        self._unreadable = False
        self._pieces: list[bytes] = []  # relayed pieces not read yet
        self._held_bytes = 0
        self._pending: dict[int, list[str]] = {}  # each candidate's text not hashed yet
        self._parts = 0

    def body(self, body: bytes, first_index: int = 0) -> None:
        """A whole answer's choices; ``first_index`` places them (an emulated fan-out's
        branch answers at its own index)."""
        wire = self._read(body)
        if wire is None:
            return
        for position, choice in enumerate(wire.choices):
            index = first_index + (choice.index if choice.index is not None else position)
            self._choice(index, choice, choice.message)

    def piece(self, raw: bytes, summaries: Sequence[ResponseSummary] = ()) -> None:
        """One relayed piece (``StreamPiece``: whole events, each ending with its blank
        line and only there, every data event one JSON object), its choices at their
        own indexes. When its summaries were read with the candidates' text
        (``CandidateSummary``: the relay's splitter read them so) they are used as they
        are; otherwise the bytes are kept, and read with the others of their batch."""
        if summaries and type(summaries[0]) is CandidateSummary:
            self._choices(summaries)
            return
        self._pieces.append(raw)
        self._held_bytes += len(raw)
        if self._held_bytes >= HOLD_BYTES:
            self._read_held()

    def finish(self, complete: bool = True) -> Evidence | None:
        """The counts, when every candidate was read and the answer ``complete`` (a cut
        stream's candidates are not all there); the digests are dropped either way."""
        if self._pieces:
            self._read_held()
        self._hash_pending()
        evidence = self._candidates.finish()
        return evidence if complete and not self._unreadable else None

    def _read_held(self) -> None:
        """The kept events in one decode."""
        datas = _datas(b"".join(self._pieces))
        self._pieces, self._held_bytes = [], 0
        if self._unreadable:
            return
        try:
            wires = _decode_all(b"[" + b",".join(datas) + b"]")
        except msgspec.DecodeError:  # ValidationError included: a shape we cannot compare
            self._unreadable = True
            return
        self._choices(wires)

    def _choices(self, chunks: Sequence[Any]) -> None:
        """Stream chunks (``CandidatesWire`` or ``CandidateSummary``): text deltas kept
        per candidate, to be hashed as one string each (``_hash_pending``); any other
        delta (tool calls, text beside a legacy text) fed at once, after the text
        before it."""
        if self._unreadable:
            return
        candidates, pending = self._candidates, self._pending
        for chunk in chunks:
            for choice in chunk.choices:
                i = choice.index or 0
                delta = choice.delta
                if delta is None or not delta.tool_calls:
                    content = delta.content if delta is not None else None
                    if not (content and choice.text):  # one text at most: the common case
                        piece = content or choice.text
                        if not piece:
                            candidates.seen(i)
                        elif (parts := pending.get(i)) is None:
                            pending[i] = [piece]
                        else:
                            parts.append(piece)
                        continue
                parts = pending.pop(i, None)  # what came before goes first
                if parts:
                    candidates.text(i, "".join(parts))
                self._choice(i, choice, delta)
            self._parts += 1
        if self._parts >= _PENDING_PARTS:
            self._hash_pending()

    def _hash_pending(self) -> None:
        candidates = self._candidates
        for i, parts in self._pending.items():
            candidates.text(i, parts[0] if len(parts) == 1 else "".join(parts))
        self._pending, self._parts = {}, 0

    def _read(self, data: bytes) -> CandidatesWire | None:
        if self._unreadable:
            return None
        try:
            return _decode(data)
        except msgspec.DecodeError:  # ValidationError included: a shape we cannot compare
            self._unreadable = True
            return None

    def _choice(self, index: int, choice: ChoiceWire, message: MessageWire | None) -> None:
        candidates = self._candidates
        if message is not None and message.content:  # the common chunk: one text delta
            candidates.text(index, message.content)
        else:
            candidates.seen(index)
        if choice.text:
            candidates.text(index, choice.text)
        if message is None or not message.tool_calls:
            return
        for position, call in enumerate(message.tool_calls):
            fn = call.function
            at = call.index if call.index is not None else position
            candidates.tool_call(index, at, fn.name if fn else None, fn.arguments if fn else None)


def _datas(raw: bytes) -> list[bytes]:
    """The data of every event of relayed pieces that may carry choices (not
    ``[DONE]``, not comments): a one-line ``data: {`` event sliced, any other form
    through ``event_data``."""
    out = []
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {") and b"\n" not in event:
            out.append(event[6:])
        elif event:
            data = event_data(event + b"\n\n")
            if data.startswith(b"{"):
                out.append(data)
    return out


def evidence_headers(evidence: Evidence | None) -> dict[str, str]:
    """``x-ncap-candidates-distinct`` and ``-agreement`` (the majority share, to three
    decimals) of a non-streamed answer with two or more candidates."""
    if evidence is None:
        return {}
    return {
        "x-ncap-candidates-distinct": str(evidence.distinct),
        "x-ncap-candidates-agreement": f"{evidence.agreement:.3f}",
    }
