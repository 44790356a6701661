"""The translator interface: one implementation per schema pair (OpenAI Chat Completions
↔ an upstream's API), picked for a route by its kind in one place
(``ncap.providers.translator_for``).

A translator is pure: no I/O, no clock, no randomness (what it needs of those, the
adapter reads and hands over in a ``Reply``). It does four things:

- **request out**: the OpenAI body the lifecycle routed → the bytes to send, and what
  reading the answer needs to know of the request (its ``shape``);
- **response in**: a 200 body → the OpenAI bytes to relay and their settlement summary;
- **stream chunk in**: a ``StreamTranslator`` per stream, fed what the upstream sends
  and giving OpenAI SSE pieces to relay;
- **error in**: a non-200 answer → ``AttemptFailed``, the facts that
  ``ncap.lifecycle.failures`` alone classifies (retry, fallback, the client's error).

Every failure a translator raises is an ``AttemptFailed``; the adapter
(``providers.translated`` for translated pairs, ``providers.openai`` for the pass-through)
only does the HTTP and scrubs the route's secrets from what it relays.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from ncap.protocol.responses import ResponseSummary
from ncap.providers.base import AttemptFailed, RequestKind
from ncap.streaming.sse import StreamPiece

__all__ = ["Answer", "Reply", "Sent", "StreamTranslator", "Translator", "random_id"]

S = TypeVar("S")
S_contra = TypeVar("S_contra", contravariant=True)


# Sent, Reply and Answer are built on every request: msgspec's frozen structs are built
# in C, about ten times faster than frozen dataclasses.


class Sent(msgspec.Struct, Generic[S], frozen=True):
    """A request as it goes upstream: its bytes, and what reading the answer needs to
    know of it (Anthropic's forced ``response_format`` tool; None for most pairs)."""

    data: bytes
    shape: S


class Reply(msgspec.Struct, frozen=True):
    """What the adapter knows of an answer besides its body: its head, and the values
    a pure translator may not make itself (the clock, a random id)."""

    headers: Mapping[str, str]
    request_id: str | None  # the head's id of the request, bounded and scrubbed
    created: int
    model: str  # the route's upstream model
    scrub_id: Callable[[str | None], str | None]  # bounds and scrubs an id from the body
    spare_id: Callable[[], str]  # a random id, for an answer that names none
    first_event: bytes | None = None  # a stream's first event data, read before handover


class Answer(msgspec.Struct, frozen=True):
    """A whole answer in OpenAI's terms: the bytes to relay and what they say."""

    body: bytes
    summary: ResponseSummary
    provider_request_id: str | None


class StreamTranslator(Protocol):
    """One stream: what the upstream sends in, OpenAI SSE pieces out."""

    @property
    def provider_request_id(self) -> str | None:
        """The upstream's id of this request (from the head, or its first event)."""
        ...

    def events(self, data: bytes) -> StreamPiece | None:
        """The upstream's next event data in (for the pass-through, the body's next
        read), the OpenAI events to relay out as one piece; None when nothing changed."""
        ...

    def end(self) -> StreamPiece | None:
        """At the upstream's end of stream: the last piece (usage, ``[DONE]``) when the
        stream completed; nothing for a cut stream, which settles as pending."""
        ...


class Translator(Protocol[S_contra]):
    """One schema pair, OpenAI ↔ an upstream (see the module docstring)."""

    def request(self, body: Mapping[str, Any], kind: RequestKind, *, model: str) -> Sent[Any]:
        """Request out. Raises ``InvalidValue`` (a 400 naming the field) for what the
        upstream cannot honour, and for an endpoint it does not serve."""
        ...

    def response(self, payload: bytes, reply: Reply, shape: S_contra) -> Answer:
        """Response in: a 200 body as OpenAI's; ``AttemptFailed`` when it cannot be read."""
        ...

    def stream(self, reply: Reply, shape: S_contra) -> StreamTranslator:
        """Stream chunk in: the translator of one stream, opened as ``reply`` says."""
        ...

    def error(self, status: int, headers: Mapping[str, str], payload: bytes) -> AttemptFailed:
        """Error in: a non-200 answer as the facts the failure table reads."""
        ...


def random_id() -> str:
    """A ``Reply.spare_id``: random, so made by the adapter, never by a translator."""
    return secrets.token_hex(12)
