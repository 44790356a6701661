"""The kit every fake upstream is built from: what a fake saw (``FakeState``), which
faults a request gets (``request_faults``, the fault profiles of ``_fake_faults``), and
how an answer goes out with them (``answer_json``, ``stream_events``: cut, corrupted,
paced or fragmented as the plan says), in whatever wire shape the fake speaks.

The OpenAI fake (``fake_upstream``), the Gemini fake and the Anthropic fake use these
public names only, so a fault profile means the same thing on every fake.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from aiohttp import web

from ncap.testing._fake_content import CandidatePattern
from ncap.testing._fake_faults import (
    PROFILES,
    ErrorReply,
    Faults,
    Plan,
    candidates_refusal,
    error_reply,
    parse_faults,
    resolve_plan,
)
from ncap.testing._fake_render import Events

__all__ = [
    "MALFORMED",
    "MIN_CACHE_TOKENS",
    "PROFILES",
    "ErrorReply",
    "Events",
    "FakeState",
    "Faults",
    "Plan",
    "PromptCache",
    "abort",
    "answer_json",
    "app_runner",
    "candidates_refusal",
    "error_reply",
    "parse_faults",
    "request_faults",
    "resolve_plan",
    "served",
    "shape_events",
    "sleep_while_connected",
    "stream_events",
    "value_for_schema",
    "write_events",
]

_RECENT_BODIES = 64
MALFORMED = b'{"id": "chatcmpl-fake", "object": "chat.completion", "choices": [{"index": 0, "mess'
"""A JSON body cut mid-way: what ``malformed_json`` sends unless a fake gives its own."""


MIN_CACHE_TOKENS = 1024
"""The shortest prompt a fake caches (OpenAI's and Anthropic's minimum)."""


def value_for_schema(schema: Any) -> Any:
    """A value of a JSON schema's type (a fake's tool call arguments): every required
    property (all of them when none is marked), strings "fake", numbers 1."""
    if not isinstance(schema, dict):
        return {}
    kind = str(schema.get("type") or "").lower()
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        required = schema.get("required") or list(props)
        return {name: value_for_schema(props.get(name)) for name in required}
    return {"string": "fake", "integer": 1, "number": 1.5, "boolean": True, "array": []}.get(kind)


class PromptCache:
    """The prompt prefixes a fake has cached, as a provider caches them: an entry is
    readable only once the request that wrote it finished its prefill (``ready_after``
    seconds after it arrived: its first byte) and for ``ttl_s`` after its last use. A
    request that arrives while the entry is still being written misses and writes too
    (requests sent together each pay the full prompt)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[float, float]] = {}  # key -> (ready, expires)
        self.reads = 0
        self.writes = 0

    def use(self, key: str, *, ready_after: float, ttl_s: float) -> bool:
        """Whether ``key`` is read from the cache now (else it is written)."""
        now = time.monotonic()
        ready, expires = self.entries.get(key, (math.inf, 0.0))
        if ready <= now < expires:
            self.entries[key] = (ready, now + ttl_s)
            self.reads += 1
            return True
        self.writes += 1
        if ready == math.inf or ready <= now:  # no write under way: this one writes
            self.entries[key] = (now + ready_after, now + ready_after + ttl_s)
        return False


class FakeState:
    """What one fake instance saw, and its per-key fail counters (kept on the app)."""

    def __init__(self, faults: Faults, latency_ms: float) -> None:
        self.faults = faults
        self.base_latency_ms = latency_ms
        self.default_plan = resolve_plan(faults, {}, latency_ms)
        self.instance = secrets.token_hex(4)
        self.serial = 0  # ids stay unique across resets
        self.in_flight = 0
        self.reset()

    def reset(self) -> None:
        self.requests = 0
        self.by_endpoint: dict[str, int] = {}
        self.by_key: dict[str, int] = {}
        self.last_headers: Mapping[str, str] | None = None
        # X-Client-Request-Id of every request, as a provider's usage records keep it
        self.client_request_ids: list[str] = []
        self.recent_bodies: deque[bytes] = deque(maxlen=_RECENT_BODIES)
        self.max_in_flight = self.in_flight
        self.disconnects = 0
        self.prompt_cache = PromptCache()
        self.patterns = CandidatePattern()  # x-fake-candidates: each pattern's next label

    def record(self, endpoint: str, headers: Mapping[str, str], body: bytes) -> str:
        """Count one request; returns its provider request id."""
        self.serial += 1
        self.requests += 1
        self.by_endpoint[endpoint] = self.by_endpoint.get(endpoint, 0) + 1
        key = headers.get("x-fake-fail-key")
        if key is None and "x-fake-fail-times" in headers:
            key = "default"
        if key is not None:
            self.by_key[key] = self.by_key.get(key, 0) + 1
        self.last_headers = headers
        client_id = headers.get("X-Client-Request-Id")
        if client_id is not None:
            self.client_request_ids.append(client_id)
        self.recent_bodies.append(body)
        return f"req_fake_{self.instance}_{self.serial}"

    def stats(self) -> dict[str, Any]:
        headers = self.last_headers or {}
        seen = {"Authorization": headers.get("Authorization")}
        seen.update((k.lower(), v) for k, v in headers.items() if k.lower() != "authorization")
        bodies = [_decode_body(body) for body in self.recent_bodies]
        return {
            "requests": self.requests,
            "by_endpoint": dict(self.by_endpoint),
            "by_key": dict(self.by_key),
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "disconnects": self.disconnects,
            "cache_reads": self.prompt_cache.reads,
            "cache_writes": self.prompt_cache.writes,
            "last_headers_seen": seen,
            "last_body": bodies[-1] if bodies else None,
            "recent_bodies": bodies,
        }


def _decode_body(body: bytes) -> Any:
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body.decode("utf-8", "replace")


def request_faults(
    state: FakeState, headers: Mapping[str, str], parse: Any = parse_faults
) -> Faults:
    """The process profile, replaced by ``x-fake-fault``; empty once the key's fail
    budget (``x-fake-fail-times``) is spent."""
    spec = headers.get("x-fake-fault")
    faults = state.faults if spec is None else parse(spec)
    if spec is None and "x-fake-latency-ms" in headers:
        faults = Faults(faults.names | {"latency"}, faults.values)
    times = headers.get("x-fake-fail-times")
    if times is not None:
        key = headers.get("x-fake-fail-key", "default")
        if state.by_key.get(key, 0) > int(times):
            return Faults()
    return faults


async def sleep_while_connected(request: web.Request, seconds: float) -> bool:
    """Sleep in short slices while the client stays connected; False once it left.
    Works without aiohttp's handler cancellation (tests may run the app without it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        transport = request.transport
        if transport is None or transport.is_closing():
            return False
        remaining = deadline - loop.time()
        if remaining <= 0:
            return True
        await asyncio.sleep(min(remaining, 0.1))


async def answer_json(
    request: web.Request,
    plan: Plan,
    rid: str,
    body: bytes,
    *,
    malformed: bytes = MALFORMED,
    rid_header: str = "x-request-id",
) -> web.StreamResponse:
    """A complete JSON answer, corrupted or cut per the plan."""
    if "malformed_json" in plan.names:
        body = malformed
    headers = {"Content-Type": "application/json", rid_header: rid}
    if "reset_mid_stream" not in plan.names:
        return web.Response(status=200, body=body, headers=headers)
    response = web.StreamResponse(headers=headers)
    response.content_length = len(body)
    await response.prepare(request)
    await response.write(body[: len(body) // 2])
    abort(request)
    return response


def shape_events(plan: Plan, events: Events, malformed: bytes = MALFORMED) -> list[bytes]:
    """Apply the stream faults that change which events are sent."""
    data = events.data
    if not plan.names.isdisjoint(("reset_mid_stream", "truncated_stream")):
        after = plan.after_chunks if plan.after_chunks is not None else events.first_content + 2
        data = data[: max(0, min(after, events.first_finish))]
    if "malformed_json" in plan.names and events.first_content <= len(data):
        cut = events.first_content
        data = [*data[:cut], b"data: " + malformed + b"\n\n", *data[cut:]]
    return data


async def write_events(
    request: web.Request, response: web.StreamResponse, plan: Plan, data: list[bytes]
) -> None:
    """Write the events: all at once, or one by one with the plan's pauses/fragments."""
    names = plan.names
    paced = not names.isdisjoint(("slow_chunks", "first_chunk_then_pause", "fragmented_stream"))
    if not paced:
        await response.write(b"".join(data))
        return
    for position, event in enumerate(data):
        if "fragmented_stream" in names:
            for start in range(0, len(event), plan.fragment_bytes):
                await response.write(event[start : start + plan.fragment_bytes])
                await asyncio.sleep(0)
        else:
            await response.write(event)
        pause = 0.0
        if position == 0 and "first_chunk_then_pause" in names:
            pause = plan.pause_ms / 1000
        elif "slow_chunks" in names:
            pause = plan.chunk_delay_ms / 1000
        if pause > 0 and not await sleep_while_connected(request, pause):
            raise ConnectionResetError("client went away")


def abort(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


async def stream_events(
    request: web.Request,
    state: FakeState,
    plan: Plan,
    rid: str,
    events: Events,
    *,
    malformed: bytes = MALFORMED,
    rid_header: str = "x-request-id",
) -> web.StreamResponse:
    headers = {
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        rid_header: rid,
    }
    response = web.StreamResponse(headers=headers)
    try:
        await response.prepare(request)
        await write_events(request, response, plan, shape_events(plan, events, malformed))
        if "reset_mid_stream" in plan.names:
            abort(request)
        else:
            await response.write_eof()
    except ConnectionResetError:
        state.disconnects += 1
    return response


def app_runner(app: web.Application, shutdown_timeout: float) -> web.AppRunner:
    # handler_cancellation: a client that leaves cancels its handler (no hung tasks)
    return web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout
    )


@asynccontextmanager
async def served(
    app: web.Application,
    host: str,
    port: int = 0,
    *,
    shutdown_timeout: float = 0.5,
    backlog: int = 128,
) -> AsyncIterator[int]:
    """Serve a fake's app on ``host:port`` (0: an ephemeral port) for the duration of
    the block; yields the port it bound."""
    runner = app_runner(app, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, backlog=backlog).start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
