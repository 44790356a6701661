"""An OpenAI-compatible fake provider with fault injection, for tests and benchmarks.

It answers ``POST /v1/chat/completions`` and ``POST /v1/completions`` with deterministic
text (see ``_fake_content``), honours ``n``, ``max_tokens``/``max_completion_tokens``,
``stream`` and ``stream_options.include_usage``, and injects the faults of
``_fake_faults`` per process (``--profile``) or per request (``x-fake-fault``,
``x-fake-*`` headers; ``x-fake-fail-times: K`` with ``x-fake-fail-key`` applies them to
the first K requests of that key only). ``GET /_fake/stats`` and ``POST /_fake/reset``
expose what it received. It is the baseline of the gateway's benchmarks, so a request
does little: one msgspec decode and encode, no logging, and a body seen before (under
the process's own plan) is answered from a cached template with a fresh id.

Run it in-process with ``running_fake_upstream()``, or as a process with
``python -m ncap.testing.fake_upstream --port P`` (uvloop when installed).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import msgspec
from aiohttp import web

from ncap.errors import UpstreamTimeout
from ncap.testing._fake_content import (
    ChoiceText,
    PromptMessage,
    choice_text,
    digest_messages,
    digest_prompt,
    labelled_choice,
    prompt_strings,
)
from ncap.testing._fake_faults import (
    Plan,
    candidates_refusal,
    error_reply,
    parse_faults,
    resolve_plan,
)
from ncap.testing._fake_render import (
    SERIAL_MARK,
    Generation,
    Template,
    UsageMode,
    chat_body,
    chat_events,
    text_body,
    text_events,
)
from ncap.testing.fake_kit import (
    MIN_CACHE_TOKENS,
    FakeState,
    answer_json,
    request_faults,
    served,
    sleep_while_connected,
    stream_events,
)

__all__ = [
    "FAKE_MODEL",
    "STATE",
    "FakeState",
    "FakeUpstream",
    "create_app",
    "main",
    "running_fake_upstream",
    "serve",
]

FAKE_MODEL = "fake-model"
_RECENT_BODIES = 64
_TEMPLATES = 4096  # cached plain answers per endpoint
_MODELS = msgspec.json.encode(
    {
        "object": "list",
        "data": [{"id": FAKE_MODEL, "object": "model", "created": 1700000000, "owned_by": "ncap"}],
    }
)
_MALFORMED = b'{"id": "chatcmpl-fake", "object": "chat.completion", "choices": [{"index": 0, "mess'


class _StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _ChatRequest(msgspec.Struct):
    model: str = FAKE_MODEL
    messages: list[PromptMessage] = []
    n: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None


class _TextRequest(msgspec.Struct):
    model: str = FAKE_MODEL
    prompt: Any = ""
    n: int | None = None
    best_of: int | None = None
    max_tokens: int | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None


_DECODE_CHAT = msgspec.json.Decoder(_ChatRequest).decode
_DECODE_TEXT = msgspec.json.Decoder(_TextRequest).decode


STATE = web.AppKey("ncap_fake_state", FakeState)

# --- request plumbing ---


def _has_fake_headers(headers: Mapping[str, str]) -> bool:
    # one C-level scan; a false positive only costs the slow path
    return "x-fake-" in ",".join(headers).lower()


def _plan(state: FakeState, headers: Mapping[str, str]) -> Plan:
    if not _has_fake_headers(headers):
        return state.default_plan
    return resolve_plan(request_faults(state, headers), headers, state.base_latency_ms)


def _json(status: int, body: bytes, rid: str) -> web.Response:
    headers = {"Content-Type": "application/json", "x-request-id": rid}
    return web.Response(status=status, body=body, headers=headers)


def _bad_request(message: str, rid: str) -> web.Response:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return _json(400, msgspec.json.encode({"error": error}), rid)


def _count(n: int | None) -> int:
    if n is None:
        return 1
    if not 1 <= n <= 128:
        raise ValueError("n must be between 1 and 128")
    return n


def _returned(n: int, plan: Plan) -> int:
    if "ignore_candidates" in plan.names:
        return 1
    if "extra_choices" in plan.names:
        return n + 1
    if "fewer_choices" in plan.names:
        return n - 1
    return n


def _usage_mode(plan: Plan, options: _StreamOptions | None) -> UsageMode:
    if options is None or not options.include_usage:
        return "none"
    if not plan.names.isdisjoint(("stream_no_usage", "missing_usage")):
        return "none"
    return "with_choices" if "usage_with_choices" in plan.names else "separate"


async def _before_answer(
    request: web.Request, state: FakeState, plan: Plan, rid: str
) -> web.Response | None:
    """Latency, then a hang (``timeout``) or an error reply, if the plan has one."""
    hang = plan.timeout_s if "timeout" in plan.names else 0.0
    wait = plan.latency_ms / 1000 + hang
    if wait > 0 and not await sleep_while_connected(request, wait):
        state.disconnects += 1
        return web.Response(status=499)  # nobody is listening
    if hang > 0:
        timeout = UpstreamTimeout("The fake upstream hung past its timeout.")
        return _json(504, msgspec.json.encode(timeout.envelope()), rid)
    reply = error_reply(plan)
    if reply is None:
        return None
    headers = {"Content-Type": reply.content_type, "x-request-id": rid, **reply.headers}
    return web.Response(status=reply.status, body=reply.body, headers=headers)


# --- answers ---


# --- endpoints ---


def _cap(*limits: int | None) -> int | None:
    given = [limit for limit in limits if limit is not None]
    return min(given) if given else None


def _chat_generation(
    req: _ChatRequest, n: int, plan: Plan, serial: str, created: int
) -> Generation:
    seed, prompt_tokens = digest_messages(req.messages)
    cap = _cap(req.max_completion_tokens, req.max_tokens)
    if plan.candidates:  # x-fake-candidates: already this request's labels, in order
        choices = [labelled_choice(label, cap, plan.completion_tokens) for label in plan.candidates]
    else:
        choices = [
            choice_text(seed, i, cap, plan.completion_tokens) for i in range(_returned(n, plan))
        ]
    return Generation(
        id=f"chatcmpl-fake-{serial}",
        created=created,
        model=req.model,
        choices=choices,
        prompt_tokens=prompt_tokens,
        cached_tokens=plan.cached_tokens,
        reasoning_tokens=plan.reasoning_tokens,
    )


def _text_generation(
    req: _TextRequest, n: int, plan: Plan, serial: str, created: int
) -> Generation:
    """Legacy: per prompt, ``best_of`` candidates of which the first ``n`` are returned
    and all are billed."""
    best_of = max(req.best_of or n, n)
    cap = 16 if req.max_tokens is None else req.max_tokens  # the legacy default
    choices: list[ChoiceText] = []
    prompt_tokens = unreturned = 0
    for prompt in prompt_strings(req.prompt):
        seed, tokens = digest_prompt(prompt)
        prompt_tokens += tokens
        candidates = [choice_text(seed, i, cap, plan.completion_tokens) for i in range(best_of)]
        choices.extend(candidates[: _returned(n, plan)])
        unreturned += sum(len(c.pieces) for c in candidates[n:])
    return Generation(
        id=f"cmpl-fake-{serial}",
        created=created,
        model=req.model,
        choices=choices,
        prompt_tokens=prompt_tokens,
        extra_completion_tokens=unreturned,
    )


def _with_cached_prompt(state: FakeState, plan: Plan, req: _ChatRequest) -> Plan:
    """``prompt_cache``: a prompt of ``MIN_CACHE_TOKENS`` or more is cached whole (in
    128-token steps, as OpenAI reports it); a repeat within the TTL reads it."""
    seed, tokens = digest_messages(req.messages)
    if tokens < MIN_CACHE_TOKENS:
        return plan
    key = f"{req.model}:{seed}"
    hit = state.prompt_cache.use(key, ready_after=plan.latency_ms / 1000, ttl_s=plan.cache_ttl_s)
    return replace(plan, cached_tokens=tokens // 128 * 128 if hit else 0)


_Request = TypeVar("_Request", bound=_ChatRequest | _TextRequest)


class _Endpoint(Generic[_Request]):
    """One completion endpoint: decode, generate, render. Plain answers under the
    process's own plan are kept per request body as templates (bounded), which makes a
    benchmark's repeated request cheap."""

    def __init__(
        self,
        name: str,
        decode: Callable[[bytes], _Request],
        generate: Callable[[_Request, int, Plan, str, int], Generation],
    ) -> None:
        self.name = name
        self.decode: Callable[[bytes], _Request] = decode
        self.generate: Callable[[_Request, int, Plan, str, int], Generation] = generate
        self.templates: dict[bytes, Template] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        body = await request.read()
        rid = state.record(self.name, request.headers, body)
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            return await self._serve(request, state, rid, body)
        except asyncio.CancelledError:  # the client went away (handler cancellation)
            state.disconnects += 1
            raise
        finally:
            state.in_flight -= 1

    async def _serve(
        self, request: web.Request, state: FakeState, rid: str, body: bytes
    ) -> web.StreamResponse:
        try:
            plan = _plan(state, request.headers)
            template = self.templates.get(body) if plan is state.default_plan else None
            parsed = self._parse(body) if template is None else None
        except (ValueError, msgspec.DecodeError) as exc:
            return _bad_request(str(exc), rid)
        if parsed is not None:
            return await self._serve_fresh(request, state, rid, body, plan, *parsed)
        assert template is not None
        answer = template.render(state.serial, int(time.time()))
        if not plan.names and plan.latency_ms <= 0:
            return _json(200, answer, rid)  # the benchmark's path: nothing to wait for
        early = await _before_answer(request, state, plan, rid)
        if early is not None:
            return early
        return await answer_json(request, plan, rid, answer)

    def _parse(self, body: bytes) -> tuple[_Request, int]:
        req = self.decode(body)
        return req, _count(req.n)

    async def _serve_fresh(
        self,
        request: web.Request,
        state: FakeState,
        rid: str,
        body: bytes,
        plan: Plan,
        req: _Request,
        n: int,
    ) -> web.StreamResponse:
        if "prompt_cache" in plan.names and isinstance(req, _ChatRequest):
            plan = _with_cached_prompt(state, plan, req)  # read as the request arrives
        early = await _before_answer(request, state, plan, rid)
        if early is not None:
            return early
        refusal = candidates_refusal(n, plan)
        if refusal is not None:
            return _json(refusal.status, refusal.body, rid)
        if plan.candidates:
            labels = state.patterns.take(plan.candidates, _returned(n, plan))
            plan = replace(plan, candidates=labels)
        if req.stream:
            gen = self.generate(req, n, plan, str(state.serial), int(time.time()))
            mode = _usage_mode(plan, req.stream_options)
            legacy = isinstance(req, _TextRequest)
            events = text_events(gen, mode) if legacy else chat_events(gen, mode)
            return await stream_events(request, state, plan, rid, events)
        template = self._template(req, n, plan)
        if plan is state.default_plan and len(self.templates) < _TEMPLATES:
            self.templates[body] = template
        return await answer_json(
            request, plan, rid, template.render(state.serial, int(time.time()))
        )

    def _template(self, req: _Request, n: int, plan: Plan) -> Template:
        gen = self.generate(req, n, plan, SERIAL_MARK, 0)
        with_usage = "missing_usage" not in plan.names
        render = text_body if isinstance(req, _TextRequest) else chat_body
        return Template.split(render(gen, with_usage=with_usage))


async def _models(request: web.Request) -> web.Response:
    return web.Response(body=_MODELS, headers={"Content-Type": "application/json"})


async def _stats(request: web.Request) -> web.Response:
    stats = request.app[STATE].stats()
    return web.Response(
        body=msgspec.json.encode(stats), headers={"Content-Type": "application/json"}
    )


async def _reset(request: web.Request) -> web.Response:
    request.app[STATE].reset()
    return web.Response(body=b'{"ok":true}', headers={"Content-Type": "application/json"})


def create_app(profile: str | None = None, latency_ms: float = 0.0) -> web.Application:
    """The fake's aiohttp app; ``profile`` applies to every request without ``x-fake-fault``.
    Raises ValueError for an unknown profile."""
    app = web.Application()
    app[STATE] = FakeState(parse_faults(profile), latency_ms)
    chat = _Endpoint("chat.completions", _DECODE_CHAT, _chat_generation)
    text = _Endpoint("completions", _DECODE_TEXT, _text_generation)
    app.router.add_post("/v1/chat/completions", chat.handle)
    app.router.add_post("/v1/completions", text.handle)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/_fake/stats", _stats)
    app.router.add_post("/_fake/reset", _reset)
    return app


# --- running it ---


@dataclass(frozen=True, slots=True)
class FakeUpstream:
    """A running in-process fake: its OpenAI base URL and its counters."""

    base_url: str
    state: FakeState

    def stats(self) -> dict[str, Any]:
        return self.state.stats()

    def reset(self) -> None:
        self.state.reset()


@asynccontextmanager
async def running_fake_upstream(
    profile: str | None = None, *, latency_ms: float = 0.0, host: str = "127.0.0.1"
) -> AsyncIterator[FakeUpstream]:
    """Serve the fake on an ephemeral port of ``host`` for the duration of the block."""
    app = create_app(profile, latency_ms)
    async with served(app, host) as port:
        yield FakeUpstream(f"http://{host}:{port}/v1", app[STATE])


async def _serve_until_signalled(
    host: str, port: int, profile: str | None, latency_ms: float, announce: Callable[[str], None]
) -> None:
    app = create_app(profile, latency_ms)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with served(app, host, port, shutdown_timeout=1.0, backlog=1024) as bound:
        announce(f"ncap fake-upstream listening on http://{host}:{bound}/v1")
        await stop.wait()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def serve(
    host: str,
    port: int,
    profile: str | None = None,
    latency_ms: float = 0.0,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM on uvloop when installed; ``announce`` gets the
    "listening on <base_url>" line once the port is bound (port 0 picks one)."""
    parse_faults(profile)  # fail before binding
    say = announce or (lambda line: print(line, flush=True))
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(_serve_until_signalled(host, port, profile, latency_ms, say))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ncap.testing.fake_upstream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--profile", default=None, help="name[=value],... (see _fake_faults)")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    try:
        serve(args.host, args.port, args.profile, args.latency_ms)
    except ValueError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
