"""The access log (``ncap.access``) and the OpenTelemetry spans: one line and one
request span per request, one span per attempt, and none of them carries anything a
user sent or an upstream generated (a canary in every field a user can fill, and in
every field of the upstream's answer)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from ncap.config import Config
from ncap.http.app import create_app
from tests.support import ServerThread, gateway_config

CANARY = "CANARY-7f3a9"


def _answer(n: int) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{CANARY}",
        "object": "chat.completion",
        "created": 1,
        "model": f"m-{CANARY}",
        "system_fingerprint": CANARY,
        "choices": [
            {
                "index": i,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": f"answer {CANARY}",
                    "tool_calls": [
                        {
                            "id": f"call_{CANARY}",
                            "type": "function",
                            "function": {
                                "name": f"f_{CANARY}",
                                "arguments": f'{{"q": "{CANARY}"}}',
                            },
                        }
                    ],
                },
            }
            for i in range(n)
        ],
        "usage": {"prompt_tokens": 11, "completion_tokens": 7 * n, "total_tokens": 11 + 7 * n},
    }


def _chunks(n: int) -> list[dict[str, Any]]:
    base = {"id": f"chatcmpl-{CANARY}", "object": "chat.completion.chunk", "created": 1}
    out = [
        {**base, "model": CANARY, "choices": [{"index": i, "delta": {"content": CANARY}}]}
        for i in range(n)
    ]
    out += [
        {**base, "model": CANARY, "choices": [{"index": i, "delta": {}, "finish_reason": "stop"}]}
        for i in range(n)
    ]
    out.append({**base, "model": CANARY, "choices": [], "usage": _answer(n)["usage"]})
    return out


async def _upstream(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    n = body.get("n") or 1
    headers = {"x-request-id": CANARY, "x-canary": CANARY}
    if not body.get("stream"):
        return web.json_response(_answer(n), headers=headers)
    response = web.StreamResponse(headers={**headers, "content-type": "text/event-stream"})
    await response.prepare(request)
    for chunk in _chunks(n):
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


def _canary_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _upstream)
    return app


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def access_lines() -> Iterator[_Lines]:
    handler, logger = _Lines(), logging.getLogger("ncap.access")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


@pytest.fixture
def upstream() -> Iterator[str]:
    server = ServerThread(_canary_app).start()
    try:
        yield server.url + "/v1"
    finally:
        server.stop()


def _config(upstream: str, tmp: Path, **extra: Any) -> Config:
    return gateway_config(
        upstream,
        tmp,
        observability={"access_log": True, "traces": True},
        **extra,
    )


def _serve(config: Config, provider: Any = None) -> ServerThread:
    return ServerThread(
        lambda: create_app(config, instance_id="signals", tracer_provider=provider)
    ).start()


def _requests(client: openai.OpenAI) -> list[str]:
    """Every field a user can fill carries the canary; returns the request ids seen."""
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": f"lookup_{CANARY}",
                "description": CANARY,
                "parameters": {"type": "object", "properties": {CANARY: {"type": "string"}}},
            },
        }
    ]
    messages: Any = [
        {"role": "system", "content": f"system {CANARY}"},
        {"role": "user", "content": f"user {CANARY}", "name": f"n{CANARY}"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{CANARY}",
                    "type": "function",
                    "function": {
                        "name": f"lookup_{CANARY}",
                        "arguments": json.dumps({"q": CANARY}),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": f"call_{CANARY}", "content": f"tool {CANARY}"},
    ]
    common: Any = {
        "model": "fake-model",
        "messages": messages,
        "tools": tools,
        "user": CANARY,
        "metadata": {"k": CANARY},
        "stop": [CANARY],
        "extra_headers": {"X-Canary": CANARY, "User-Agent": CANARY},
    }
    ids = []
    raw = client.chat.completions.with_raw_response.create(n=2, **common)
    ids.append(raw.headers["x-request-id"])
    stream = client.chat.completions.with_raw_response.create(
        n=2, stream=True, stream_options={"include_usage": True}, **common
    )
    list(stream.parse())
    ids.append(stream.headers["x-request-id"])
    for bad in ({"n": 9}, {"temperature": 7}):  # a policy denial, a validation error
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**common, **bad)
        ids.append(refused.value.response.headers["x-request-id"])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(**{**common, "model": f"model-{CANARY}"})
    return ids


def test_no_content_in_access_log_or_spans(
    upstream: str, tmp_path: Path, access_lines: _Lines
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = _serve(_config(upstream, tmp_path), provider)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=CANARY, max_retries=0)
        ids = _requests(client)
    finally:
        server.stop()  # drains the settlements, so every line is written
    lines = [json.loads(line) for line in access_lines.lines]
    assert len(lines) == 5
    # lines come in the order requests end (a stream's after its settlement)
    by_request = {line["request_id"]: line for line in lines}
    assert set(ids) < set(by_request)
    spans = exporter.get_finished_spans()
    dumped = [_span_text(s) for s in spans]
    for text in [*access_lines.lines, *dumped]:
        assert CANARY not in text
        assert CANARY.lower() not in text.lower()

    whole, streamed, denied, invalid = (by_request[i] for i in ids)
    [unknown] = [line for rid, line in by_request.items() if rid not in ids]
    assert whole["status"] == 200 and whole["candidates_requested"] == 2
    assert whole["candidates_returned"] == 2 and whole["output_tokens"] == 14
    assert whole["input_tokens"] == 11 and whole["route"] == "fake"
    assert whole["policy_result"] == "allow" and whole["latency_ms"] > 0
    assert streamed["stream"] is True and streamed["output_tokens"] == 14
    assert denied["status"] == 400 and denied["policy_result"] == "deny"
    assert denied["policy_reason"] == "candidate_count_exceeds_policy"
    assert denied["candidates_requested"] == 9 and denied["attempts"] == 0
    assert invalid["status"] == 400 and invalid["error_code"] == "invalid_value"
    assert "policy_result" not in invalid  # refused before policy
    assert unknown["status"] == 404 and "model" not in unknown

    requests = [s for s in spans if s.kind == SpanKind.SERVER]
    attempts = [s for s in spans if s.kind == SpanKind.CLIENT]
    # named by the GenAI conventions once the model is known: "{operation} {model}"
    assert {s.name for s in requests} == {"chat fake-model", "ncap.request"}
    assert {s.name for s in attempts} == {"chat fake-model"}
    assert len(requests) == 5 and len(attempts) == 2
    for span in attempts:
        assert span.parent is not None
        assert span.parent.span_id in {r.context.span_id for r in requests}
        assert span.attributes is not None and span.attributes["ncap.route"] == "fake"
        assert span.attributes["ncap.output_tokens"] == 14
    by_id = {r.attributes["ncap.request_id"]: r for r in requests if r.attributes}
    assert by_id[ids[0]].attributes is not None
    assert by_id[ids[0]].attributes["ncap.candidates_returned"] == 2


def _span_text(span: Any) -> str:
    return json.dumps(
        {
            "name": span.name,
            "attributes": dict(span.attributes or {}),
            "events": [(e.name, dict(e.attributes or {})) for e in span.events],
            "status": str(span.status.description),
            "resource": dict(span.resource.attributes),
        },
        default=str,
    )


def test_access_log_off_and_traces_off_by_default(
    upstream: str, tmp_path: Path, access_lines: _Lines
) -> None:
    config = gateway_config(upstream, tmp_path, observability={"access_log": False})
    assert config.observability.traces is False
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = _serve(config, provider)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
        client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "x"}]
        )
    finally:
        server.stop()
    assert access_lines.lines == []
    assert exporter.get_finished_spans() == ()
