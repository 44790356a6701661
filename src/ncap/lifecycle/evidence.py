"""The hook between relayed answers and ``ncap.domain.evidence``: a whole body's
choices, or a stream's chunks one at a time, fed to one ``Candidates`` per request.

``EvidenceFeed.chunk`` is what a relay calls per event with choices; it decodes only
the candidates' text and tool calls (``ncap.protocol.candidates``). Nothing here can
fail a request: an answer whose candidates cannot be read yields no evidence.
"""

from __future__ import annotations

import os

import msgspec

from ncap.domain.evidence import Candidates, Evidence
from ncap.protocol.candidates import CandidatesWire, ChoiceWire, MessageWire

__all__ = ["EvidenceFeed", "evidence_headers"]

_decode = msgspec.json.Decoder(CandidatesWire).decode
# the hashes' key, one per process (immutable): a digest means nothing outside it, and
# none is ever stored
_PROCESS_KEY = os.urandom(32)


class EvidenceFeed:
    """One request's candidates as they pass (``body`` per whole answer, ``chunk``
    per stream event), then ``finish`` once."""

    __slots__ = ("_candidates", "_unreadable")

    def __init__(self) -> None:
        self._candidates = Candidates(_PROCESS_KEY)
        self._unreadable = False

    def body(self, body: bytes, first_index: int = 0) -> None:
        """A whole answer's choices; ``first_index`` places them (an emulated fan-out's
        branch answers at its own index)."""
        wire = self._read(body)
        if wire is None:
            return
        for position, choice in enumerate(wire.choices):
            index = first_index + (choice.index if choice.index is not None else position)
            self._choice(index, choice, choice.message)

    def chunk(self, data: bytes, index: int | None = None) -> None:
        """One stream event's JSON; ``index`` overrides the choices' own (a fan-out
        branch's single choice)."""
        wire = self._read(data)
        if wire is None:
            return
        for choice in wire.choices:
            at = index if index is not None else (choice.index or 0)
            self._choice(at, choice, choice.delta)

    def finish(self, complete: bool = True) -> Evidence | None:
        """The counts, when every candidate was read and the answer ``complete`` (a cut
        stream's candidates are not all there); the digests are dropped either way."""
        evidence = self._candidates.finish()
        return evidence if complete and not self._unreadable else None

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


def evidence_headers(evidence: Evidence | None) -> dict[str, str]:
    """``x-ncap-candidates-distinct`` and ``-agreement`` (the majority share, to three
    decimals) of a non-streamed answer with two or more candidates."""
    if evidence is None:
        return {}
    return {
        "x-ncap-candidates-distinct": str(evidence.distinct),
        "x-ncap-candidates-agreement": f"{evidence.agreement:.3f}",
    }
