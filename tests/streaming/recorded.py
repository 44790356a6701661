"""Recorded upstream streams played through the real providers' stream plumbing and the
whole lifecycle (in-memory stores, no socket): what the client receives, byte for byte,
and what was settled.

Each provider is the real one (``OpenAIProvider``, ``GeminiProvider``) with its HTTP
transport replaced by a recording: the upstream's body in the reads it arrived in. The
local engine's stream is its provider's chunk-to-event step over recorded chunks.
A fan-out's branches release their reads in one fixed global order (``Conductor``), so
that the merged stream's interleaving does not depend on how the relay schedules.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ncap.config import Route, parse_route
from ncap.protocol.responses import ChatCompletionChunk
from ncap.providers import local
from ncap.providers.base import RequestKind
from ncap.providers.gemini import GeminiProvider
from ncap.providers.openai import OpenAIProvider
from tests.lifecycle.harness import CALLER, EMULATE, NATIVE, Harness, harness, route

_encode = msgspec.json.Encoder().encode

Reads = Sequence[bytes]


class Conductor:
    """Releases reads one at a time in a fixed order of turns (branch, read number); a
    turn is given only after the previous one's bytes had every chance to be relayed."""

    def __init__(self, order: Sequence[tuple[int, int]]) -> None:
        self.order = list(order)
        self.turns = {turn: asyncio.Event() for turn in self.order}
        self.done = {turn: asyncio.Event() for turn in self.order}

    async def run(self) -> None:
        for turn in self.order:
            self.turns[turn].set()
            await self.done[turn].wait()
            for _ in range(50):  # let the read's bytes travel through every layer
                await asyncio.sleep(0)

    async def take(self, branch: int, number: int) -> None:
        await self.turns[(branch, number)].wait()

    def taken(self, branch: int, number: int) -> None:
        self.done[(branch, number)].set()


@dataclass
class _Content:
    reads: Reads
    cut: BaseException | None
    branch: int
    conductor: Conductor | None

    _reads: AsyncIterator[bytes] | None = None

    async def readany(self) -> bytes:
        """``http1.Body``'s: the next bytes, ``b""`` at the end."""
        if self._reads is None:
            self._reads = self.iter_any()
        return await anext(self._reads, b"")

    def set_exception(self, exc: BaseException) -> None:
        raise AssertionError(f"a recorded stream timed out: {exc}")

    async def iter_any(self) -> AsyncIterator[bytes]:
        for number, read in enumerate(self.reads):
            if self.conductor is not None:
                await self.conductor.take(self.branch, number)
                self.conductor.taken(self.branch, number)
            yield read
        if self.cut is not None:
            raise self.cut

    async def __aiter__(self) -> AsyncIterator[bytes]:  # ``http1.Body``'s line iteration
        buf = b""
        async for read in self.iter_any():
            buf += read
            *lines, buf = buf.split(b"\n")
            for line in lines:
                yield line + b"\n"
        if buf:
            yield buf


@dataclass
class _Response:
    content: _Content
    connection: None = None
    headers: Mapping[str, str] = field(default_factory=lambda: {"x-request-id": "rid-rec"})


@dataclass
class RecordedTransport:
    """Stands for ``HttpTransport``: every stream opened gets the next recording."""

    recordings: list[tuple[Reads, BaseException | None]]
    conductor: Conductor | None = None
    opened: int = 0
    url: str = "http://recorded.invalid"

    @asynccontextmanager
    async def open(
        self,
        data: bytes,
        *,
        timeout: float,
        url: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[_Response]:
        reads, cut = self.recordings[self.opened]
        branch = self.opened
        self.opened += 1
        yield _Response(_Content(reads, cut, branch, self.conductor))

    def request_id(self, headers: Mapping[str, str]) -> str | None:
        return headers.get("x-request-id")

    # the route has no credential: nothing to scrub (``HttpTransport``'s with no secrets)
    def scrub_bytes(self, data: bytes) -> bytes:
        return data

    def scrub_id(self, value: str | None) -> str | None:
        return value

    def scrub(self, failure: Any) -> Any:
        return failure

    async def aclose(self) -> None:
        return None


def openai_provider(transport: RecordedTransport) -> OpenAIProvider:
    provider = OpenAIProvider(
        _route(provider="openai", base_url="http://rec.invalid/v1"), route_id="r"
    )
    provider._transports = {"chat": transport, "completions": transport}  # type: ignore[dict-item]
    return provider


def gemini_provider(transport: RecordedTransport) -> GeminiProvider:
    provider = GeminiProvider(
        _route(provider="gemini", upstream_model="gemini-2.5-flash"), route_id="g"
    )
    provider._transport = transport  # type: ignore[assignment]
    return provider


def _route(**fields: Any) -> Route:
    return parse_route({"pricing": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}, **fields})


@dataclass
class _EngineStream:
    """What ``local._events`` reads of the engine's request stream: admitted at once,
    the choices' token counts once it finished."""

    finished: Any = None
    started: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.started.set()


@dataclass
class RecordedEngine:
    """The local provider's stream step over recorded engine chunks."""

    chunks: list[dict[str, Any]]
    choice_tokens: tuple[int, ...]

    @asynccontextmanager
    async def stream(
        self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
    ) -> AsyncIterator[tuple[str | None, AsyncIterator[Any]]]:
        stream = _EngineStream()
        events = local._events(stream, self._chunks(stream), lambda: timeout)  # type: ignore[arg-type]
        yield "chatcmpl-engine", events

    async def _chunks(self, stream: _EngineStream) -> AsyncIterator[ChatCompletionChunk]:
        for chunk in self.chunks:
            if chunk.get("usage"):
                stream.finished = _Finished(self.choice_tokens)
            yield msgspec.convert(chunk, ChatCompletionChunk)

    async def complete(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("streams only")

    async def aclose(self) -> None:
        return None


@dataclass
class _Finished:
    choice_tokens: tuple[int, ...]


def gateway(tmp: Path, provider: Any, *, emulate: bool = False, gemini: bool = False) -> Harness:
    contract = dict(EMULATE if emulate else NATIVE)
    extra: dict[str, Any] = {}
    if gemini:
        extra = {"provider": "gemini", "upstream_model": "gemini-2.5-flash", "base_url": None}
    return harness(tmp, {"r": (route(contract, retries=0, **extra), provider)})


async def play(
    h: Harness,
    body: dict[str, Any],
    *,
    kind: RequestKind = "chat",
    conductor: Conductor | None = None,
    request_id: str = "req-1",
) -> dict[str, Any]:
    """The client's bytes (joined) and the settlement, as one JSON-able record."""
    raw = _encode({"model": "m", **body})
    conducting = asyncio.ensure_future(conductor.run()) if conductor else None
    if kind == "chat":
        reply = await h.gateway.chat(raw, CALLER, request_id)
    else:
        reply = await h.gateway.completions(raw, CALLER, request_id)
    assert reply.stream is not None
    out = b"".join([chunk async for chunk in reply.stream])
    if conducting is not None:
        conducting.cancel()
    rows = [
        {
            "attempt": r.attempt,
            "state": r.state,
            "input_tokens": r.input_tokens,
            "output_tokens_total": r.output_tokens_total,
            "output_tokens_per_choice": list(r.output_tokens_per_choice or []) or None,
            "finish_reasons": r.finish_reasons,
            "returned": r.returned_candidate_count,
            "usage_source": r.usage_source,
            "provider_request_id": r.provider_request_id,
        }
        for r in await h.rows(request_id)
    ]
    return {"out": out.decode(), "rows": rows, "held": len(await h.outstanding())}
