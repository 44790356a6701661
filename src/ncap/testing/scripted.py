"""A scripted provider behind the real ``Provider`` port, for socket-free lifecycle
tests (in the spirit of httpx's ``MockTransport``).

Each attempt takes the next step of the script: ``Answer`` (a whole body), ``Stream``
(inline SSE text, parsed by the real ``ncap.streaming.sse``, optionally ending in a
failure), or ``Fail`` (an ``AttemptFailed`` or a provider's own ``NcapError``). The
bodies it was sent are kept in ``sent``, in order, for the test to inspect.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ncap.errors import NcapError
from ncap.protocol.responses import ResponseSummary
from ncap.providers.base import AttemptFailed, RequestKind, UpstreamResult
from ncap.streaming.sse import StreamPiece, iter_pieces

__all__ = ["Answer", "Fail", "ScriptedProvider", "Stream", "chat_body", "chunk", "sse"]

_encode = msgspec.json.Encoder().encode
_summary = msgspec.json.Decoder(ResponseSummary)


@dataclass(frozen=True, slots=True)
class Answer:
    body: bytes
    provider_request_id: str | None = None
    choice_tokens: tuple[int, ...] | None = None  # what a provider like the engine knows


@dataclass(frozen=True, slots=True)
class Stream:
    """SSE text relayed event by event; ``then`` is raised after the last event (a
    stream cut mid-way), else the stream ends cleanly."""

    text: bytes
    provider_request_id: str | None = "scripted-stream"
    then: AttemptFailed | NcapError | None = None


@dataclass(frozen=True, slots=True)
class Fail:
    error: AttemptFailed | NcapError


Step = Answer | Stream | Fail


@dataclass
class ScriptedProvider:
    """Answers attempts from ``steps`` in order; running out of steps is a test bug."""

    steps: Sequence[Step]
    sent: list[Mapping[str, Any]] = field(default_factory=list)
    closed: bool = False
    kinds: list[RequestKind] = field(default_factory=list)  # the endpoint of each attempt

    def _next(self, body: Mapping[str, Any]) -> Step:
        if len(self.sent) >= len(self.steps):
            raise AssertionError(
                f"script has {len(self.steps)} steps; attempt {len(self.sent) + 1}"
            )
        self.sent.append(body)
        return self.steps[len(self.sent) - 1]

    async def complete(
        self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
    ) -> UpstreamResult:
        self.kinds.append(kind)
        step = self._next(body)
        if isinstance(step, Fail):
            raise step.error
        if not isinstance(step, Answer):
            raise AssertionError("a whole answer was asked for; the script has a stream")
        summary = _summary.decode(step.body)
        return UpstreamResult(
            200,
            step.body,
            summary,
            step.provider_request_id or summary.id,
            choice_tokens=step.choice_tokens,
        )

    @asynccontextmanager
    async def stream(
        self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
    ) -> AsyncIterator[tuple[str | None, AsyncIterator[StreamPiece]]]:
        self.kinds.append(kind)
        step = self._next(body)
        if isinstance(step, Fail):
            raise step.error
        if not isinstance(step, Stream):
            raise AssertionError("a stream was asked for; the script has a whole answer")
        yield step.provider_request_id, _events(step)

    async def aclose(self) -> None:
        self.closed = True


async def _events(step: Stream) -> AsyncIterator[StreamPiece]:
    async for piece in iter_pieces(_lines(step.text)):
        yield piece
    if step.then is not None:
        raise step.then


async def _lines(text: bytes) -> AsyncIterator[bytes]:
    for line in text.splitlines(keepends=True):
        yield line


def chat_body(
    *contents: str, usage: tuple[int, int] | None = (10, 5), id_: str = "up-1", finish: str = "stop"
) -> bytes:
    """A chat.completion with one choice per content, and usage (prompt, completion)."""
    body: dict[str, Any] = {
        "id": id_,
        "object": "chat.completion",
        "created": 1,
        "model": "scripted",
        "choices": [
            {"index": i, "message": {"role": "assistant", "content": c}, "finish_reason": finish}
            for i, c in enumerate(contents)
        ],
    }
    if usage is not None:
        body["usage"] = _usage(*usage)
    return _encode(body)


def chunk(
    index: int | None = 0,
    content: str | None = None,
    *,
    finish: str | None = None,
    usage: tuple[int, int] | None = None,
    id_: str = "up-s",
) -> dict[str, Any]:
    """One chat.completion.chunk: a choice delta, or (``index=None``) the usage chunk."""
    choices = []
    if index is not None:
        delta = {} if content is None else {"content": content}
        choices = [{"index": index, "delta": delta, "finish_reason": finish}]
    out: dict[str, Any] = {
        "id": id_,
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "scripted",
        "choices": choices,
    }
    if usage is not None:
        out["usage"] = _usage(*usage)
    return out


def sse(*chunks: dict[str, Any], done: bool = True) -> bytes:
    """Chunks as SSE text, ending with ``[DONE]`` unless ``done=False``."""
    text = b"".join(b"data: " + _encode(c) + b"\n\n" for c in chunks)
    return text + (b"data: [DONE]\n\n" if done else b"")


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
