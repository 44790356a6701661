"""A fake Gemini API upstream with fault injection, for tests of the ``gemini`` provider.

It answers ``POST /v1beta/models/{model}:generateContent`` and
``POST /v1beta/models/{model}:streamGenerateContent?alt=sse`` the way the Gemini API does:
``candidateCount`` candidates (1 to 8, like Gemini 2.5), each naming its ``index`` (0 left
out, as proto3's JSON mapping does), ``finishReason`` STOP or MAX_TOKENS against
``maxOutputTokens``, ``usageMetadata`` with the candidates summed, streams as ``data:``
events framed by CRLF with no ``[DONE]``, usage growing on every event, and errors in
Google's ``{"error": {"code", "message", "status", "details"}}`` envelope. Unknown
top-level and ``generationConfig`` fields are refused, as Gemini refuses them. The API key
is read from ``x-goog-api-key`` or the ``key`` query parameter; with ``api_key`` set, a
missing key is a 403 and a wrong one Gemini's 400 ``API_KEY_INVALID``.

Faults: every profile of the OpenAI fake (``_fake_faults``; errors rendered the Gemini
way: 429 RESOURCE_EXHAUSTED with ``RetryInfo``, 503 UNAVAILABLE, 500 INTERNAL, 504
DEADLINE_EXCEEDED), selected the same way (``--profile``, ``x-fake-fault``,
``x-fake-fail-times``/``x-fake-fail-key``, ``x-fake-*`` parameters; ``usage_with_choices``
changes nothing here, since Gemini's usage always rides on the candidates' events), plus:

    refuse_candidates[=MAX]  candidateCount > MAX (default 1) is a 400: "Multiple
                             candidates is not enabled for this model" (MAX 1) or the
                             "supported range is from 1 (inclusive) to MAX+1 (exclusive)"
                             wording
    ignore_candidates        one candidate whatever candidateCount says
    shuffled_candidates      candidates listed (and streamed) highest index first
    safety_candidate         the last candidate is blocked: no content, finishReason SAFETY
    blocked_prompt[=REASON]  the prompt is blocked (a 200, or one stream event): no
                             candidates, ``promptFeedback.blockReason`` REASON (default
                             SAFETY) and ``usageMetadata`` with the prompt's count only

``x-fake-reasoning-tokens`` becomes ``thoughtsTokenCount`` and ``x-fake-cached-tokens``
``cachedContentTokenCount``. Run it in-process with ``running_fake_gemini()`` or as
``python -m ncap.testing.fake_gemini --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, replace
from typing import Any

import msgspec
from aiohttp import web

from ncap.testing._fake_content import (
    ChoiceText,
    PromptMessage,
    choice_text,
    digest_messages,
    labelled_choice,
)
from ncap.testing.fake_kit import (
    Events,
    FakeState,
    Faults,
    Plan,
    answer_json,
    parse_faults,
    request_faults,
    resolve_plan,
    served,
    sleep_while_connected,
    stream_events,
    value_for_schema,
)

__all__ = [
    "GEMINI_PROFILES",
    "GEMINI_STATE",
    "FakeGemini",
    "GeminiFakeState",
    "create_gemini_app",
    "main",
    "parse_gemini_faults",
    "running_fake_gemini",
]

GEMINI_PROFILES = frozenset(
    {
        "refuse_candidates",
        "ignore_candidates",
        "shuffled_candidates",
        "safety_candidate",
        "blocked_prompt",
    }
)
_MAX_CANDIDATES = 8  # Gemini 2.5's range: 1 (inclusive) to 9 (exclusive)
_REQUEST_FIELDS = frozenset(
    {
        "contents",
        "tools",
        "toolConfig",
        "safetySettings",
        "systemInstruction",
        "generationConfig",
        "cachedContent",
    }
)
_CONFIG_FIELDS = frozenset(
    {
        "stopSequences",
        "responseMimeType",
        "responseSchema",
        "responseJsonSchema",
        "responseModalities",
        "candidateCount",
        "maxOutputTokens",
        "temperature",
        "topP",
        "topK",
        "seed",
        "presencePenalty",
        "frequencyPenalty",
        "responseLogprobs",
        "logprobs",
        "thinkingConfig",
    }
)
_FINISH = {"stop": "STOP", "length": "MAX_TOKENS", "tool_calls": "STOP"}
_ENCODE = msgspec.json.Encoder().encode


class _Part(msgspec.Struct):
    text: str | None = None


class _Content(msgspec.Struct):
    parts: list[_Part] = []
    role: str | None = None


class _Config(msgspec.Struct, rename="camel"):
    candidate_count: int | None = None
    max_output_tokens: int | None = None


class _CallingConfig(msgspec.Struct, rename="camel"):
    mode: str | None = None
    allowed_function_names: list[str] = []


class _ToolConfig(msgspec.Struct, rename="camel"):
    function_calling_config: _CallingConfig | None = None


class _Request(msgspec.Struct, rename="camel"):
    contents: list[_Content] = []
    system_instruction: _Content | None = None
    tools: list[dict[str, Any]] = []
    tool_config: _ToolConfig | None = None
    generation_config: _Config | None = None


_DECODE = msgspec.json.Decoder(_Request).decode


class GeminiFakeState(FakeState):
    """The OpenAI fake's counters, plus how each request presented its API key."""

    def __init__(self, faults: Faults, latency_ms: float, api_key: str | None) -> None:
        self.api_key = api_key
        super().__init__(faults, latency_ms)

    def reset(self) -> None:
        super().reset()
        self.key_sources: list[str] = []  # "header", "query" or "none", per request

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "key_sources": list(self.key_sources)}


GEMINI_STATE = web.AppKey("ncap_fake_gemini_state", GeminiFakeState)


def parse_gemini_faults(spec: str | None) -> Faults:
    """The OpenAI fake's profiles plus ``GEMINI_PROFILES``; ValueError on an unknown one."""
    own: set[str] = set()
    values: dict[str, str] = {}
    rest: list[str] = []
    for item in (spec or "").split(","):
        name, _, value = item.strip().partition("=")
        if name in GEMINI_PROFILES:
            own.add(name)
            if value:
                values[name] = value.strip()
        else:
            rest.append(item)
    base = parse_faults(",".join(rest))
    return Faults(base.names | own, {**base.values, **values})


# --- errors, Google's way ---


def _google_error(
    status: int, grpc: str, message: str, details: list[dict[str, Any]] | None = None
) -> web.Response:
    error: dict[str, Any] = {"code": status, "message": message, "status": grpc}
    if details:
        error["details"] = details
    return web.Response(
        status=status, body=_ENCODE({"error": error}), content_type="application/json"
    )


def _fault_reply(plan: Plan) -> web.Response | None:
    """The error a plan answers with instead of a generation, if any."""
    names = plan.names
    if not names.isdisjoint(("rate_limit", "slow_down", "rate_limit_exceeded")):
        delay = f"{plan.retry_after or '1'}s"
        info = {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay}
        return _google_error(429, "RESOURCE_EXHAUSTED", "You exceeded your current quota.", [info])
    if "overloaded" in names:
        return _google_error(503, "UNAVAILABLE", "The model is overloaded. Please try again later.")
    if "server_error_400" in names:
        return _google_error(400, "INVALID_ARGUMENT", "Request contains an invalid argument.")
    if "error_500" in names:
        return _google_error(500, "INTERNAL", "An internal error has occurred.")
    if "bad_gateway_html" in names:
        html = b"<html><head><title>502 Bad Gateway</title></head><body>502</body></html>"
        return web.Response(status=502, body=html, content_type="text/html")
    return None


def _key_error(request: web.Request, state: GeminiFakeState) -> web.Response | None:
    header = request.headers.get("x-goog-api-key") or None
    query = request.query.get("key") or None
    key = header if header is not None else query
    state.key_sources.append("header" if header is not None else "query" if query else "none")
    if state.api_key is None:
        return None
    if not key:
        return _google_error(
            403,
            "PERMISSION_DENIED",
            "Method doesn't allow unregistered callers (callers without established "
            "identity). Please use API Key or other form of API consumer identity.",
        )
    if key != state.api_key:
        info = {
            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
            "reason": "API_KEY_INVALID",
            "domain": "googleapis.com",
        }
        return _google_error(
            400, "INVALID_ARGUMENT", "API key not valid. Please pass a valid API key.", [info]
        )
    return None


def _unknown_field(raw: Any) -> str | None:
    if not isinstance(raw, dict):
        return "(root)"
    unknown = [k for k in raw if k not in _REQUEST_FIELDS]
    config = raw.get("generationConfig")
    if isinstance(config, dict):
        unknown += [f"generation_config.{k}" for k in config if k not in _CONFIG_FIELDS]
    return unknown[0] if unknown else None


def _refusal(n: int, faults: Faults) -> web.Response | None:
    """candidateCount outside what the (faked) model accepts."""
    maximum = _MAX_CANDIDATES
    if "refuse_candidates" in faults.names:
        maximum = int(faults.values.get("refuse_candidates", "1"))
    if 1 <= n <= maximum:
        return None
    if n > 1 and maximum == 1:
        message = "Multiple candidates is not enabled for this model"
    else:
        message = (
            f"Unable to submit request because it has a candidateCount value of {n} but the "
            f"supported range is from 1 (inclusive) to {maximum + 1} (exclusive). Update the "
            "value and try again."
        )
    return _google_error(400, "INVALID_ARGUMENT", message)


# --- generation ---


@dataclass(frozen=True, slots=True)
class _Generation:
    model: str
    response_id: str
    choices: list[tuple[int, ChoiceText | None]]  # (index, text); None: blocked (SAFETY)
    prompt_tokens: int
    cached_tokens: int
    thoughts_tokens: int
    call: dict[str, Any] | None = None  # the function every candidate calls (mode ANY)


def _forced_call(req: _Request) -> dict[str, Any] | None:
    """With ``functionCallingConfig.mode: ANY`` every candidate calls a function: the
    first allowed one, its arguments filled from its parameters' schema."""
    config = req.tool_config.function_calling_config if req.tool_config else None
    if config is None or config.mode != "ANY":
        return None
    declarations = [d for t in req.tools for d in t.get("functionDeclarations") or []]
    allowed = [d for d in declarations if d.get("name") in config.allowed_function_names]
    chosen = (allowed or declarations or [None])[0]
    if chosen is None:
        return None
    # protobuf's JSON takes either spelling (the official SDK sends snake_case)
    names = ("parametersJsonSchema", "parameters_json_schema", "parameters")
    schema = next((chosen[k] for k in names if chosen.get(k)), None)
    return {"name": chosen.get("name"), "args": value_for_schema(schema)}


def _generate(req: _Request, model: str, plan: Plan, rid: str) -> _Generation:
    messages = [
        PromptMessage(role=c.role or "user", content="".join(p.text or "" for p in c.parts))
        for c in ([req.system_instruction] if req.system_instruction else []) + req.contents
    ]
    seed, prompt_tokens = digest_messages(messages)
    config = req.generation_config or _Config()
    n = 1 if "ignore_candidates" in plan.names else (config.candidate_count or 1)
    if "extra_choices" in plan.names:
        n += 1
    elif "fewer_choices" in plan.names:
        n = max(0, n - 1)
    cap, forced = config.max_output_tokens, plan.completion_tokens
    choices: list[tuple[int, ChoiceText | None]] = [
        (i, choice_text(seed, i, cap, forced)) for i in range(n)
    ]
    if plan.candidates:  # x-fake-candidates: this request's labels, in order
        labels = enumerate(plan.candidates)
        choices = [(i, labelled_choice(label, cap, forced)) for i, label in labels]
    if "safety_candidate" in plan.names and choices:
        choices[-1] = (choices[-1][0], None)
    if "shuffled_candidates" in plan.names:
        choices.reverse()
    return _Generation(
        model=model,
        response_id=rid,
        choices=choices,
        prompt_tokens=prompt_tokens,
        cached_tokens=min(plan.cached_tokens, prompt_tokens),
        thoughts_tokens=plan.reasoning_tokens,
        call=_forced_call(req),
    )


def _usage(gen: _Generation, candidates_tokens: int) -> dict[str, int]:
    """Proto3-style: zero counts left out."""
    usage = {"promptTokenCount": gen.prompt_tokens}
    if gen.cached_tokens:
        usage["cachedContentTokenCount"] = gen.cached_tokens
    if candidates_tokens:
        usage["candidatesTokenCount"] = candidates_tokens
    if gen.thoughts_tokens:
        usage["thoughtsTokenCount"] = gen.thoughts_tokens
    usage["totalTokenCount"] = gen.prompt_tokens + candidates_tokens + gen.thoughts_tokens
    return usage


def _candidate(
    index: int, text: str | None, finish: str | None, tool: str | None = None
) -> dict[str, Any]:
    """A candidate of ``text``; with ``tool``, ``text`` is the call's JSON arguments."""
    out: dict[str, Any] = {}
    if tool is not None and text is not None:
        call = {"name": tool, "args": msgspec.json.decode(text)}
        out["content"] = {"parts": [{"functionCall": call}], "role": "model"}
    elif text is not None:
        out["content"] = {"parts": [{"text": text}], "role": "model"}
    if finish is not None:
        out["finishReason"] = finish
    if index:
        out["index"] = index
    return out


def _called(gen: _Generation) -> list[dict[str, Any]]:
    """Every candidate calling the forced function, finished (STOP)."""
    out = []
    for i, _ in gen.choices:
        candidate: dict[str, Any] = {
            "content": {"parts": [{"functionCall": gen.call}], "role": "model"},
            "finishReason": "STOP",
        }
        if i:
            candidate["index"] = i
        out.append(candidate)
    return out


def _body(gen: _Generation, *, with_usage: bool) -> bytes:
    if gen.call is not None:
        called: dict[str, Any] = {"candidates": _called(gen)}
        if with_usage:
            called["usageMetadata"] = _usage(gen, 5 * len(gen.choices))
        called["modelVersion"] = gen.model
        called["responseId"] = gen.response_id
        return _ENCODE(called)
    candidates = [
        _candidate(i, c.content, _FINISH[c.finish_reason], c.tool)
        if c is not None
        else _candidate(i, None, "SAFETY")
        for i, c in gen.choices
    ]
    visible = sum(len(c.pieces) for _, c in gen.choices if c is not None)
    out: dict[str, Any] = {"candidates": candidates}
    if with_usage:
        out["usageMetadata"] = _usage(gen, visible)
    out["modelVersion"] = gen.model
    out["responseId"] = gen.response_id
    return _ENCODE(out)


def _blocked(gen: _Generation, reason: str) -> bytes:
    """A prompt Gemini blocked: no candidates, the feedback, the prompt's usage."""
    usage = {"promptTokenCount": gen.prompt_tokens, "totalTokenCount": gen.prompt_tokens}
    out = {
        "promptFeedback": {"blockReason": reason},
        "usageMetadata": usage,
        "modelVersion": gen.model,
        "responseId": gen.response_id,
    }
    return _ENCODE(out)


def _events(gen: _Generation, *, with_usage: bool) -> Events:
    """One event per step carrying every candidate that moved: its next piece, and its
    finishReason with its last piece (a blocked candidate finishes at step 0); a forced
    function call is one event."""
    if gen.call is not None:
        return Events([b"data: " + _body(gen, with_usage=with_usage) + b"\r\n\r\n"], 0, 0)
    steps = max((_steps(c) for _, c in gen.choices if c is not None), default=0)
    data: list[bytes] = []
    first_finish = -1
    sent = 0
    for step in range(max(steps, 1)):
        candidates: list[dict[str, Any]] = []
        for i, choice in gen.choices:
            if choice is None:
                if step == 0:
                    candidates.append(_candidate(i, None, "SAFETY"))
                continue
            if step >= _steps(choice):
                continue
            last = step == _steps(choice) - 1
            finish = _FINISH[choice.finish_reason] if last else None
            if choice.tool is not None:  # Gemini sends a function call whole
                candidates.append(_candidate(i, choice.content, finish, choice.tool))
            else:
                candidates.append(_candidate(i, choice.pieces[step], finish))
            sent += 1
        if any("finishReason" in c for c in candidates) and first_finish < 0:
            first_finish = len(data)
        event: dict[str, Any] = {"candidates": candidates}
        if with_usage:
            event["usageMetadata"] = _usage(gen, sent)
        event["modelVersion"] = gen.model
        event["responseId"] = gen.response_id
        data.append(b"data: " + _ENCODE(event) + b"\r\n\r\n")
    return Events(data, 0, len(data) if first_finish < 0 else first_finish)


def _steps(choice: ChoiceText) -> int:
    return 1 if choice.tool is not None else len(choice.pieces)


# --- the endpoint ---


def _plan(state: GeminiFakeState, headers: Mapping[str, str]) -> tuple[Plan, Faults]:
    faults = request_faults(state, headers, parse_gemini_faults)
    return resolve_plan(faults, headers, state.base_latency_ms), faults


async def _generate_content(request: web.Request) -> web.StreamResponse:
    state = request.app[GEMINI_STATE]
    model, _, method = request.match_info["target"].partition(":")
    body = await request.read()
    rid = state.record(method, request.headers, body)
    state.in_flight += 1
    state.max_in_flight = max(state.max_in_flight, state.in_flight)
    try:
        return await _serve(request, state, rid, model, method, body)
    finally:
        state.in_flight -= 1


async def _serve(
    request: web.Request, state: GeminiFakeState, rid: str, model: str, method: str, body: bytes
) -> web.StreamResponse:
    if method not in ("generateContent", "streamGenerateContent"):
        return _google_error(404, "NOT_FOUND", f"Method {method!r} is not found.")
    stream = method == "streamGenerateContent"
    if stream and request.query.get("alt") != "sse":
        return _google_error(400, "INVALID_ARGUMENT", "The fake streams with alt=sse only.")
    refused = _key_error(request, state)
    if refused is not None:
        return refused
    try:
        plan, faults = _plan(state, request.headers)
        raw = msgspec.json.decode(body)
        req = _DECODE(body)
    except (ValueError, msgspec.DecodeError) as exc:
        return _google_error(400, "INVALID_ARGUMENT", f"Invalid JSON payload received. {exc}")
    unknown = _unknown_field(raw)
    if unknown is not None:
        return _google_error(
            400,
            "INVALID_ARGUMENT",
            f'Invalid JSON payload received. Unknown name "{unknown}": Cannot find field.',
        )
    early = await _before_answer(request, state, plan)
    if early is not None:
        return early
    n = (req.generation_config or _Config()).candidate_count or 1
    refusal = _refusal(n, faults)
    if refusal is not None:
        return refusal
    if plan.candidates:
        plan = replace(plan, candidates=state.patterns.take(plan.candidates, n))
    gen = _generate(req, model, plan, rid)
    if "blocked_prompt" in plan.names:
        blocked = _blocked(gen, faults.values.get("blocked_prompt", "SAFETY"))
        if stream:
            event = Events([b"data: " + blocked + b"\r\n\r\n"], 0, 0)
            return await stream_events(request, state, plan, rid, event)
        return await answer_json(request, plan, rid, blocked)
    if stream:
        usage = plan.names.isdisjoint(("missing_usage", "stream_no_usage"))
        return await stream_events(request, state, plan, rid, _events(gen, with_usage=usage))
    with_usage = "missing_usage" not in plan.names
    return await answer_json(request, plan, rid, _body(gen, with_usage=with_usage))


async def _before_answer(
    request: web.Request, state: GeminiFakeState, plan: Plan
) -> web.StreamResponse | None:
    """Latency, then a hang (``timeout``) or a fault's error reply."""
    hang = plan.timeout_s if "timeout" in plan.names else 0.0
    wait = plan.latency_ms / 1000 + hang
    if wait > 0 and not await sleep_while_connected(request, wait):
        state.disconnects += 1
        return web.Response(status=499)
    if hang > 0:
        return _google_error(
            504, "DEADLINE_EXCEEDED", "Deadline expired before operation could complete."
        )
    return _fault_reply(plan)


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[GEMINI_STATE].stats())


async def _reset(request: web.Request) -> web.Response:
    request.app[GEMINI_STATE].reset()
    return web.json_response({"ok": True})


def create_gemini_app(
    profile: str | None = None, latency_ms: float = 0.0, api_key: str | None = None
) -> web.Application:
    """The fake's aiohttp app; ValueError for an unknown profile."""
    app = web.Application()
    app[GEMINI_STATE] = GeminiFakeState(parse_gemini_faults(profile), latency_ms, api_key)
    app.router.add_post("/v1beta/models/{target}", _generate_content)
    app.router.add_get("/_fake/stats", _stats)
    app.router.add_post("/_fake/reset", _reset)
    return app


@dataclass(frozen=True, slots=True)
class FakeGemini:
    """A running in-process fake: its API base URL (``…/v1beta``) and its counters."""

    base_url: str
    state: GeminiFakeState

    def stats(self) -> dict[str, Any]:
        return self.state.stats()

    def reset(self) -> None:
        self.state.reset()


@asynccontextmanager
async def running_fake_gemini(
    profile: str | None = None,
    *,
    latency_ms: float = 0.0,
    api_key: str | None = None,
    host: str = "127.0.0.1",
) -> AsyncIterator[FakeGemini]:
    """Serve the fake on an ephemeral port of ``host`` for the duration of the block."""
    app = create_gemini_app(profile, latency_ms, api_key)
    async with served(app, host) as port:
        yield FakeGemini(f"http://{host}:{port}/v1beta", app[GEMINI_STATE])


async def _serve_forever(host: str, port: int, app: web.Application) -> None:
    async with served(app, host, port, shutdown_timeout=1.0) as bound:
        print(f"ncap fake-gemini listening on http://{host}:{bound}/v1beta", flush=True)
        await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ncap.testing.fake_gemini")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--profile", default=None, help="name[=value],... (see the docstring)")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args(argv)
    try:
        app = create_gemini_app(args.profile, args.latency_ms, args.api_key)
    except ValueError as exc:
        parser.error(str(exc))
    with suppress(KeyboardInterrupt):
        asyncio.run(_serve_forever(args.host, args.port, app))


if __name__ == "__main__":
    main()
