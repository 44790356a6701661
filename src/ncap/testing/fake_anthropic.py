"""A fake Anthropic Messages API upstream with fault injection, for tests of the
``anthropic`` provider; the official ``anthropic`` SDK is its test client, so what it
sends is what the SDK parses.

It answers ``POST /v1/messages`` as the Messages API does: the key in ``x-api-key`` (or
as a bearer token) and ``anthropic-version`` required (401 ``authentication_error`` /
400 without them),
``max_tokens`` required, ``temperature`` 0 to 1, unknown top-level fields refused; one
message per request (no ``n``) whose text is deterministic for the prompt
(``_fake_content``), ``stop_reason`` end_turn or max_tokens; tools by ``tool_choice``
(``any``/``tool`` always call, ``auto`` calls when the ``tool_every`` profile says,
``none`` never) with an input filled from the tool's schema; streams as named events
(``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``,
``content_block_stop``, ``message_delta`` with the output usage, ``message_stop``).

Prompt caching: a block marked ``cache_control`` makes the prompt up to it a cache
entry (at least ``MIN_CACHE_TOKENS``, as Anthropic requires) kept for ``cache_ttl_s``:
the first request writes it (``cache_creation_input_tokens``), the next within the TTL
reads it (``cache_read_input_tokens``); ``input_tokens`` is the rest of the prompt.

Faults: every profile of the OpenAI fake (``fake_kit``), rendered Anthropic's way: 429
``rate_limit_error`` with ``retry-after``, ``overloaded`` as 529 ``overloaded_error``,
500 ``api_error``, 400 ``invalid_request_error``, a hang as 504 ``timeout_error``; the
stream faults cut, corrupt, pace or fragment the event stream; plus:

    tool_every=K         with tool_choice auto, every K-th request calls the first tool
    stream_overloaded    a stream sends an ``error`` event (overloaded_error) after
                         ``message_start``
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from ncap.testing._fake_content import ChoiceText, choice_text
from ncap.testing.fake_kit import (
    MIN_CACHE_TOKENS,
    ErrorReply,
    Events,
    FakeState,
    Faults,
    Plan,
    answer_json,
    error_reply,
    parse_faults,
    request_faults,
    resolve_plan,
    served,
    sleep_while_connected,
    stream_events,
    value_for_schema,
)

__all__ = [
    "ANTHROPIC_PROFILES",
    "ANTHROPIC_STATE",
    "MIN_CACHE_TOKENS",
    "AnthropicFakeState",
    "FakeAnthropic",
    "create_anthropic_app",
    "main",
    "parse_anthropic_faults",
    "running_fake_anthropic",
]

ANTHROPIC_PROFILES = frozenset({"tool_every", "stream_overloaded"})
_FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "stream",
        "tools",
        "tool_choice",
        "metadata",
        "thinking",
        "service_tier",
        "cache_control",
        "container",
        "output_config",
    }
)
_ENCODE = msgspec.json.encode
_MALFORMED = b'{"type": "message", "id": "msg_fake", "content": [{"type": "te'
_RID = "request-id"


class AnthropicFakeState(FakeState):
    """The OpenAI fake's counters (and prompt cache), plus the key it expects and how
    long a cache entry lives."""

    def __init__(
        self, faults: Faults, latency_ms: float, api_key: str | None, cache_ttl_s: float
    ) -> None:
        self.api_key = api_key
        self.cache_ttl_s = cache_ttl_s
        super().__init__(faults, latency_ms)


ANTHROPIC_STATE = web.AppKey("ncap_fake_anthropic_state", AnthropicFakeState)


def parse_anthropic_faults(spec: str | None) -> Faults:
    """The OpenAI fake's profiles plus ``ANTHROPIC_PROFILES``; ValueError on an unknown."""
    own: set[str] = set()
    values: dict[str, str] = {}
    rest: list[str] = []
    for item in (spec or "").split(","):
        name, _, value = item.strip().partition("=")
        if name in ANTHROPIC_PROFILES:
            own.add(name)
            if value:
                values[name] = value.strip()
        else:
            rest.append(item)
    base = parse_faults(",".join(rest))
    return Faults(base.names | own, {**base.values, **values})


# --- errors, Anthropic's way ---


def _error(status: int, kind: str, message: str, rid: str = "", **headers: str) -> web.Response:
    body = {"type": "error", "error": {"type": kind, "message": message}, "request_id": rid}
    all_headers = {"Content-Type": "application/json", _RID: rid, **headers}
    return web.Response(status=status, body=_ENCODE(body), headers=all_headers)


_KINDS = {400: "invalid_request_error", 429: "rate_limit_error", 500: "api_error"}


def _fault_reply(plan: Plan, rid: str) -> web.Response | None:
    """The OpenAI fake's error for the plan, in Anthropic's envelope and statuses."""
    reply: ErrorReply | None = error_reply(plan)
    if reply is None:
        return None
    delay = {k: v for k, v in reply.headers.items() if k == "retry-after"}
    if reply.status == 503:
        return _error(529, "overloaded_error", "Overloaded", rid, **delay)
    if reply.content_type != "application/json":
        html = {"Content-Type": reply.content_type, _RID: rid}
        return web.Response(status=reply.status, body=reply.body, headers=html)
    message = msgspec.json.decode(reply.body)["error"]["message"]
    kind = _KINDS.get(reply.status, "api_error")
    return _error(reply.status, kind, message, rid, **delay)


def _refusal(
    request: web.Request, state: AnthropicFakeState, raw: Any, rid: str
) -> web.Response | None:
    """What the Messages API refuses before generating: the key, the version, the body."""
    # x-api-key, as the API reference says; the official SDK (2.x) sends its key as a
    # bearer token, which the API takes too
    bearer = request.headers.get("Authorization", "").removeprefix("Bearer ")
    key = request.headers.get("x-api-key") or bearer
    if state.api_key is not None and key != state.api_key:
        return _error(401, "authentication_error", "invalid x-api-key", rid)
    if "anthropic-version" not in request.headers:
        return _error(400, "invalid_request_error", "anthropic-version: header is required", rid)
    if not isinstance(raw, dict):
        return _error(400, "invalid_request_error", "body: Input should be an object", rid)
    for name in raw:
        if name not in _FIELDS:
            return _error(
                400, "invalid_request_error", f"{name}: Extra inputs are not permitted", rid
            )
    for name in ("model", "messages", "max_tokens"):
        if name not in raw:
            return _error(400, "invalid_request_error", f"{name}: Field required", rid)
    temperature = raw.get("temperature")
    if isinstance(temperature, int | float) and not 0 <= temperature <= 1:
        message = "temperature: Input should be less than or equal to 1"
        return _error(400, "invalid_request_error", message, rid)
    return None


# --- the prompt and the cache ---


def _block_text(block: Any) -> str:
    if isinstance(block, str):
        return block
    if not isinstance(block, dict):
        return ""
    if block.get("type") == "text":
        return str(block.get("text") or "")
    if block.get("type") == "tool_result":
        content = block.get("content")
        return content if isinstance(content, str) else "".join(map(_block_text, content or []))
    if block.get("type") == "tool_use":
        return str(block.get("name")) + _ENCODE(block.get("input")).decode()
    return ""


def _prompt_blocks(raw: dict[str, Any]) -> list[tuple[str, Any]]:
    """(role, block) for every block of the prompt, system first, in order."""
    system = raw.get("system")
    blocks: list[tuple[str, Any]] = []
    for block in [system] if isinstance(system, str) else (system or []):
        blocks.append(("system", block))
    for message in raw.get("messages") or []:
        content = message.get("content")
        for block in [content] if isinstance(content, str) else (content or []):
            blocks.append((str(message.get("role")), block))
    return blocks


def _tokens(text: str) -> int:
    return len(text) // 4 + 1


@dataclass(frozen=True, slots=True)
class _Prompt:
    seed: int
    tokens: int
    cache_read: int = 0
    cache_write: int = 0


def _prompt(raw: dict[str, Any], state: AnthropicFakeState, plan: Plan) -> _Prompt:
    """The prompt's seed and tokens, split into cache read / written / uncached."""
    digest = hashlib.blake2b(digest_size=8)
    tokens = 0
    marked: tuple[str, int] | None = None
    for role, block in _prompt_blocks(raw):
        text = _block_text(block)
        digest.update(f"{role}\x00{text}\x01".encode())
        tokens += _tokens(text)
        if isinstance(block, dict) and block.get("cache_control"):
            marked = (digest.copy().hexdigest() + str(raw.get("model")), tokens)
    seed = int.from_bytes(digest.digest(), "little")
    if marked is None or marked[1] < MIN_CACHE_TOKENS:
        return _Prompt(seed, tokens)
    key, prefix = marked
    # written once this request's prefill is done: its first byte, after the latency
    ready_after = plan.latency_ms / 1000
    if state.prompt_cache.use(key, ready_after=ready_after, ttl_s=state.cache_ttl_s):
        return _Prompt(seed, tokens - prefix, cache_read=prefix)
    return _Prompt(seed, tokens - prefix, cache_write=prefix)


# --- the answer ---


def _tool_call(
    raw: dict[str, Any], plan: Plan, faults: Faults, serial: int
) -> dict[str, Any] | None:
    """The tool this request calls, per ``tool_choice``; None to answer in text."""
    tools = raw.get("tools") or []
    choice = raw.get("tool_choice") or {"type": "auto"}
    if not tools or choice.get("type") == "none":
        return None
    if choice.get("type") == "tool":
        tool = next((t for t in tools if t.get("name") == choice.get("name")), tools[0])
    elif choice.get("type") == "any":
        tool = tools[0]
    else:
        every = int(faults.values.get("tool_every", "0")) if "tool_every" in plan.names else 0
        if every <= 0 or serial % every:
            return None
        tool = tools[0]
    return {
        "type": "tool_use",
        "id": f"toolu_fake_{serial}",
        "name": tool.get("name"),
        "input": value_for_schema(tool.get("input_schema")),
    }


@dataclass(frozen=True, slots=True)
class _Generation:
    id: str
    model: str
    prompt: _Prompt
    text: ChoiceText | None
    tool: dict[str, Any] | None
    stop_reason: str

    @property
    def output_tokens(self) -> int:
        tool = _tokens(_ENCODE(self.tool["input"]).decode()) if self.tool else 0
        return (len(self.text.pieces) if self.text else 0) + tool

    def usage(self, *, output: bool = True) -> dict[str, int]:
        return {
            "input_tokens": self.prompt.tokens,
            "cache_creation_input_tokens": self.prompt.cache_write,
            "cache_read_input_tokens": self.prompt.cache_read,
            "output_tokens": self.output_tokens if output else 1,
        }


def _generate(
    raw: dict[str, Any], prompt: _Prompt, plan: Plan, faults: Faults, serial: int
) -> _Generation:
    tool = _tool_call(raw, plan, faults, serial)
    cap = int(raw["max_tokens"])
    forced = plan.completion_tokens
    text = None if tool is not None else choice_text(prompt.seed, 0, cap, forced)
    stop = "tool_use" if tool is not None else "end_turn"
    if text is not None and text.finish_reason == "length":
        stop = "max_tokens"
    return _Generation(f"msg_fake_{serial:06d}", str(raw["model"]), prompt, text, tool, stop)


def _message(gen: _Generation) -> bytes:
    content: list[dict[str, Any]] = []
    if gen.text is not None:
        content.append({"type": "text", "text": gen.text.content})
    if gen.tool is not None:
        content.append(gen.tool)
    return _ENCODE(
        {
            "id": gen.id,
            "type": "message",
            "role": "assistant",
            "model": gen.model,
            "content": content,
            "stop_reason": gen.stop_reason,
            "stop_sequence": None,
            "usage": gen.usage(),
        }
    )


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _ENCODE({"type": kind, **data}) + b"\n\n"


def _events(gen: _Generation, plan: Plan) -> Events:
    start: dict[str, Any] = {
        "id": gen.id,
        "type": "message",
        "role": "assistant",
        "model": gen.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": gen.usage(output=False),
    }
    out = [_sse("message_start", {"message": start})]
    if "stream_overloaded" in plan.names:
        error = {"type": "overloaded_error", "message": "Overloaded"}
        return Events([*out, _sse("error", {"error": error})], 1, 2)
    first_content = 0
    if gen.text is not None:
        out.append(
            _sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        )
        out.append(_sse("ping", {}))
        first_content = len(out)
        for piece in gen.text.pieces:
            delta = {"type": "text_delta", "text": piece}
            out.append(_sse("content_block_delta", {"index": 0, "delta": delta}))
        out.append(_sse("content_block_stop", {"index": 0}))
    if gen.tool is not None:
        index = 1 if gen.text is not None else 0
        block = {**gen.tool, "input": {}}
        out.append(_sse("content_block_start", {"index": index, "content_block": block}))
        first_content = first_content or len(out)
        arguments = _ENCODE(gen.tool["input"]).decode()
        for cut in range(0, len(arguments), 8):
            delta = {"type": "input_json_delta", "partial_json": arguments[cut : cut + 8]}
            out.append(_sse("content_block_delta", {"index": index, "delta": delta}))
        out.append(_sse("content_block_stop", {"index": index}))
    first_finish = len(out)
    usage = {"output_tokens": gen.output_tokens}
    if "stream_no_usage" in plan.names or "missing_usage" in plan.names:
        usage = {}
    stop: dict[str, str | None] = {"stop_reason": gen.stop_reason, "stop_sequence": None}
    out.append(_sse("message_delta", {"delta": stop, "usage": usage}))
    out.append(_sse("message_stop", {}))
    return Events(out, first_content, first_finish)


# --- the endpoint ---


async def _messages(request: web.Request) -> web.StreamResponse:
    state = request.app[ANTHROPIC_STATE]
    body = await request.read()
    rid = state.record("messages", request.headers, body)
    serial = state.serial  # this request's number, before another one arrives
    state.in_flight += 1
    state.max_in_flight = max(state.max_in_flight, state.in_flight)
    try:
        return await _serve(request, state, rid, serial, body)
    finally:
        state.in_flight -= 1


async def _serve(
    request: web.Request, state: AnthropicFakeState, rid: str, serial: int, body: bytes
) -> web.StreamResponse:
    try:
        raw = msgspec.json.decode(body)
        faults = request_faults(state, request.headers, parse_anthropic_faults)
        plan = resolve_plan(faults, request.headers, state.base_latency_ms)
    except (ValueError, msgspec.DecodeError) as exc:
        return _error(400, "invalid_request_error", f"Invalid request: {exc}", rid)
    refused = _refusal(request, state, raw, rid)
    if refused is not None:
        return refused
    prompt = _prompt(raw, state, plan)  # the cache is read as the request arrives
    early = await _before_answer(request, state, plan, rid)
    if early is not None:
        return early
    gen = _generate(raw, prompt, plan, faults, serial)
    if raw.get("stream") is True:
        events = _events(gen, plan)
        return await stream_events(
            request, state, plan, rid, events, malformed=_MALFORMED, rid_header=_RID
        )
    return await answer_json(
        request, plan, rid, _message(gen), malformed=_MALFORMED, rid_header=_RID
    )


async def _before_answer(
    request: web.Request, state: AnthropicFakeState, plan: Plan, rid: str
) -> web.StreamResponse | None:
    hang = plan.timeout_s if "timeout" in plan.names else 0.0
    wait = plan.latency_ms / 1000 + hang
    if wait > 0 and not await sleep_while_connected(request, wait):
        state.disconnects += 1
        return web.Response(status=499)
    if hang > 0:
        return _error(504, "timeout_error", "Request timed out", rid)
    return _fault_reply(plan, rid)


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[ANTHROPIC_STATE].stats())


async def _reset(request: web.Request) -> web.Response:
    request.app[ANTHROPIC_STATE].reset()
    return web.json_response({"ok": True})


def create_anthropic_app(
    profile: str | None = None,
    latency_ms: float = 0.0,
    api_key: str | None = None,
    cache_ttl_s: float = 300.0,
) -> web.Application:
    """The fake's aiohttp app; ValueError for an unknown profile."""
    app = web.Application()
    faults = parse_anthropic_faults(profile)
    app[ANTHROPIC_STATE] = AnthropicFakeState(faults, latency_ms, api_key, cache_ttl_s)
    app.router.add_post("/v1/messages", _messages)
    app.router.add_get("/_fake/stats", _stats)
    app.router.add_post("/_fake/reset", _reset)
    return app


@dataclass(frozen=True, slots=True)
class FakeAnthropic:
    """A running in-process fake: its API base URL (``…/v1``) and its counters."""

    base_url: str
    state: AnthropicFakeState

    def stats(self) -> dict[str, Any]:
        return self.state.stats()

    def reset(self) -> None:
        self.state.reset()


@asynccontextmanager
async def running_fake_anthropic(
    profile: str | None = None,
    *,
    latency_ms: float = 0.0,
    api_key: str | None = None,
    cache_ttl_s: float = 300.0,
    host: str = "127.0.0.1",
) -> AsyncIterator[FakeAnthropic]:
    """Serve the fake on an ephemeral port of ``host`` for the duration of the block."""
    app = create_anthropic_app(profile, latency_ms, api_key, cache_ttl_s)
    async with served(app, host) as port:
        yield FakeAnthropic(f"http://{host}:{port}/v1", app[ANTHROPIC_STATE])


async def _serve_forever(host: str, port: int, app: web.Application) -> None:
    async with served(app, host, port, shutdown_timeout=1.0) as bound:
        print(f"ncap fake-anthropic listening on http://{host}:{bound}/v1", flush=True)
        await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ncap.testing.fake_anthropic")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8092)
    parser.add_argument("--profile", default=None, help="name[=value],... (see the docstring)")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--cache-ttl-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    try:
        app = create_anthropic_app(args.profile, args.latency_ms, args.api_key, args.cache_ttl_s)
    except ValueError as exc:
        parser.error(str(exc))
    with suppress(KeyboardInterrupt):
        asyncio.run(_serve_forever(args.host, args.port, app))


if __name__ == "__main__":
    main()
