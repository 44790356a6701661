"""OpenTelemetry GenAI spans and metrics over a real OTLP/HTTP round trip.

The gateway exports to a test OTLP receiver (an aiohttp server decoding the protobuf
``ExportTraceServiceRequest`` / ``ExportMetricsServiceRequest`` with the
``opentelemetry-proto`` package). An n=3 streamed request on a native route and an n=4
request fanned out on an emulating route carry the client's ``traceparent``; the spans
must continue that trace, hand it on to every upstream request, carry the GenAI
attributes, and nothing the client sent or the upstream generated (a canary in every
field) may appear anywhere in what the receiver got.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from ncap.config import Config
from ncap.http.app import create_app
from tests.support import ServerThread, gateway_config

CANARY = "CANARY-91c4e"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
REASONS = ("stop", "length", "tool_calls", "stop")


@dataclass
class _Receiver:
    """What the OTLP receiver got: raw bodies, decoded spans and metrics."""

    raw: list[bytes] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    resources: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, list[Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        app.router.add_post("/v1/metrics", self._metrics)
        return app

    async def _traces(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        body = await request.read()
        decoded = ExportTraceServiceRequest.FromString(body)
        with self.lock:
            self.raw.append(body)
            for rs in decoded.resource_spans:
                self.resources.append(_attrs(rs.resource.attributes))
                for ss in rs.scope_spans:
                    self.spans.extend(ss.spans)
        return _protobuf(ExportTraceServiceResponse().SerializeToString())

    async def _metrics(self, request: web.Request) -> web.Response:
        body = await request.read()
        decoded = ExportMetricsServiceRequest.FromString(body)
        with self.lock:
            self.raw.append(body)
            for rm in decoded.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        self.metrics.setdefault(metric.name, []).append(metric)
        return _protobuf(ExportMetricsServiceResponse().SerializeToString())


def _protobuf(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/x-protobuf")


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


@dataclass
class _Upstream:
    """A Chat Completions upstream that records each request's trace headers."""

    traceparents: list[str | None] = field(default_factory=list)
    # every header it got, to find the client's canary in none of them
    headers: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.traceparents.append(request.headers.get("traceparent"))
        self.headers.append(repr(list(request.headers.items())))
        n = body.get("n") or 1
        usage = {
            "prompt_tokens": 20,
            "completion_tokens": 5 * n,
            "total_tokens": 20 + 5 * n,
            "prompt_tokens_details": {"cached_tokens": 8},
            "completion_tokens_details": {"reasoning_tokens": 2},
        }
        base = {"id": f"chatcmpl-{CANARY}", "created": 1, "model": f"m-{CANARY}"}
        # a fan-out branch is one choice: its reason is drawn from its own position
        offset = len(self.traceparents) - 1 if n == 1 else 0
        reasons = [REASONS[(offset + i) % len(REASONS)] for i in range(n)]
        if not body.get("stream"):
            choices = [
                {
                    "index": i,
                    "finish_reason": reasons[i],
                    "message": {"role": "assistant", "content": f"answer {CANARY}"},
                }
                for i in range(n)
            ]
            answer = {**base, "object": "chat.completion", "choices": choices, "usage": usage}
            return web.json_response(answer, headers={"x-request-id": CANARY})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        chunk = {**base, "object": "chat.completion.chunk"}
        for i in range(n):
            delta = {"index": i, "delta": {"role": "assistant", "content": CANARY}}
            await response.write(_sse({**chunk, "choices": [delta]}))
        for i in range(n):
            end = {"index": i, "delta": {}, "finish_reason": reasons[i]}
            await response.write(_sse({**chunk, "choices": [end]}))
        await response.write(_sse({**chunk, "choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        return response


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


@pytest.fixture
def receiver() -> Iterator[tuple[_Receiver, str]]:
    got = _Receiver()
    server = ServerThread(got.app).start()
    try:
        yield got, server.url
    finally:
        server.stop()


@pytest.fixture
def upstream() -> Iterator[tuple[_Upstream, str]]:
    fake = _Upstream()
    server = ServerThread(fake.app).start()
    try:
        yield fake, server.url + "/v1"
    finally:
        server.stop()


def _config(upstream_url: str, tmp: Path, otlp: dict[str, Any]) -> Config:
    fanout = {
        "provider": "openai",
        "base_url": upstream_url,
        "upstream_model": "fan-upstream",
        "api_key_env": "NCAP_TEST_UPSTREAM_KEY",
        "pricing": {"input_per_mtok": 0.1, "output_per_mtok": 0.4},
        "contract": {"candidates": "emulate", "max_candidates": 8},
    }
    return gateway_config(
        upstream_url,
        tmp,
        observability={"access_log": False, "otlp": otlp},
        models={"fake-model": ["fake"], "fan-model": ["fanout"]},
        routes={"fanout": fanout},
    )


def _requests(client: openai.OpenAI, traceparent: str) -> list[str]:
    """An n=3 stream and an n=4 fan-out, every user-filled field carrying the canary."""
    common: Any = {
        "messages": [
            {"role": "system", "content": f"system {CANARY}"},
            {"role": "user", "content": f"user {CANARY}", "name": f"n{CANARY}"},
        ],
        "user": CANARY,
        "metadata": {"k": CANARY},
        "stop": [CANARY],
        "temperature": 0.7,
        "seed": 42,
        "max_tokens": 50,
        "extra_headers": {
            "traceparent": traceparent,
            "tracestate": f"vendor={CANARY}",
            "baggage": f"k={CANARY}",
            "X-Canary": CANARY,
        },
    }
    ids = []
    stream = client.chat.completions.with_raw_response.create(
        model="fake-model", n=3, stream=True, stream_options={"include_usage": True}, **common
    )
    chunks = list(stream.parse())
    assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason) == 3
    ids.append(stream.headers["x-request-id"])
    fan = client.chat.completions.with_raw_response.create(model="fan-model", n=4, **common)
    assert len(fan.parse().choices) == 4
    ids.append(fan.headers["x-request-id"])
    return ids


def test_genai_spans_and_metrics_over_otlp(
    receiver: tuple[_Receiver, str], upstream: tuple[_Upstream, str], tmp_path: Path
) -> None:
    got, endpoint = receiver
    fake, upstream_url = upstream
    config = _config(upstream_url, tmp_path, {"endpoint": endpoint, "service_name": "gw-test"})
    server = ServerThread(lambda: create_app(config, instance_id="otel")).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
        stream_id, fan_id = _requests(client, f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
    finally:
        server.stop()  # shutdown flushes the batch span processor and the last metrics

    assert got.raw, "the receiver got nothing"
    for body in got.raw:  # nothing a user sent or an upstream generated, anywhere
        assert CANARY.encode() not in body and CANARY.lower().encode() not in body.lower()
    assert {r.get("service.name") for r in got.resources} == {"gw-test"}

    by_request = _request_spans(got.spans)
    streamed, fanned = by_request[stream_id], by_request[fan_id]
    for span in (streamed, fanned):  # the client's trace continued
        assert span.trace_id.hex() == CLIENT_TRACE and span.parent_span_id.hex() == CLIENT_SPAN
        assert span.kind == Span.SPAN_KIND_SERVER

    s = _attrs(streamed.attributes)
    assert streamed.name == "chat fake-model"
    assert s["gen_ai.operation.name"] == "chat" and s["gen_ai.provider.name"] == "openai"
    assert s["gen_ai.request.model"] == "fake-model"
    assert s["gen_ai.response.model"] == "fake-model"
    assert s["gen_ai.request.choice.count"] == 3
    assert s["gen_ai.request.max_tokens"] == 50 and s["gen_ai.request.seed"] == 42
    assert s["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert sorted(s["gen_ai.response.finish_reasons"]) == ["length", "stop", "tool_calls"]
    assert s["gen_ai.response.id"] == stream_id
    assert s["gen_ai.usage.input_tokens"] == 20 and s["gen_ai.usage.output_tokens"] == 15
    assert s["gen_ai.usage.cache_read.input_tokens"] == 8
    assert s["gen_ai.usage.reasoning.output_tokens"] == 2
    assert s["ncap.candidates_requested"] == 3 and s["ncap.candidates_effective"] == 3
    assert s["ncap.candidates_returned"] == 3 and s["ncap.policy_result"] == "allow"
    assert s["ncap.reserved_tokens"] > 0 and s["ncap.reserved_cost_micros"] > 0
    assert s["ncap.cost_micros"] > 0 and s["ncap.stream"] is True

    f = _attrs(fanned.attributes)
    assert f["gen_ai.request.choice.count"] == 4 and f["ncap.emulated"] is True
    assert f["gen_ai.response.model"] == "fan-upstream"
    assert sorted(f["gen_ai.response.finish_reasons"]) == sorted(REASONS)
    assert f["gen_ai.usage.input_tokens"] == 4 * 20  # each branch paid the prompt
    assert f["gen_ai.usage.output_tokens"] == 4 * 5
    assert f["ncap.candidates_returned"] == 4 and f["ncap.attempts"] == 4

    attempts = [sp for sp in got.spans if sp.kind == Span.SPAN_KIND_CLIENT]
    children = {
        parent.span_id: [a for a in attempts if a.parent_span_id == parent.span_id]
        for parent in (streamed, fanned)
    }
    assert len(children[streamed.span_id]) == 1 and len(children[fanned.span_id]) == 4
    [one] = children[streamed.span_id]
    a = _attrs(one.attributes)
    assert one.name == "chat fake-model" and a["gen_ai.request.choice.count"] == 3
    assert a["gen_ai.usage.output_tokens"] == 15 and a["ncap.outcome"] == "completed"
    for branch in children[fanned.span_id]:
        b = _attrs(branch.attributes)
        assert branch.name == "chat fan-upstream" and "gen_ai.request.choice.count" not in b
        assert b["gen_ai.request.model"] == "fan-upstream"
        assert len(b["gen_ai.response.finish_reasons"]) == 1
    # every upstream request carried its own attempt span as parent, in the client's trace
    sent = [t for t in fake.traceparents if t is not None]
    assert len(sent) == len(fake.traceparents) == 5
    assert {t.split("-")[1] for t in sent} == {CLIENT_TRACE}
    assert {t.split("-")[2] for t in sent} == {sp.span_id.hex() for sp in attempts}
    assert not [h for h in fake.headers if CANARY.lower() in h.lower()]  # no tracestate

    _check_metrics(got)


def _request_spans(spans: list[Span]) -> dict[str, Span]:
    out = {}
    for span in spans:
        if span.kind == Span.SPAN_KIND_SERVER:
            out[_attrs(span.attributes)["ncap.request_id"]] = span
    return out


def _check_metrics(got: _Receiver) -> None:
    names = set(got.metrics)
    assert {
        "gen_ai.server.request.duration",
        "gen_ai.server.time_to_first_token",
        "gen_ai.client.token.usage",
    } <= names
    duration = _points(got, "gen_ai.server.request.duration")
    assert sum(p.count for p in duration) == 2
    assert {_attrs(p.attributes)["gen_ai.request.model"] for p in duration} == {
        "fake-model",
        "fan-model",
    }
    ttft = _points(got, "gen_ai.server.time_to_first_token")
    assert sum(p.count for p in ttft) == 1  # the streamed request only
    tokens = _points(got, "gen_ai.client.token.usage")
    by_type: dict[str, float] = {}
    for p in tokens:
        kind = _attrs(p.attributes)["gen_ai.token.type"]
        by_type[kind] = by_type.get(kind, 0) + p.sum
    assert by_type == {"input": 20 + 4 * 20, "output": 15 + 4 * 5}
    assert got.metrics["gen_ai.server.request.duration"][0].unit == "s"


def _points(got: _Receiver, name: str) -> list[Any]:
    """The last export's data points (cumulative temporality: the last is the total)."""
    return list(got.metrics[name][-1].histogram.data_points)


def test_standard_otel_variables_and_sampling(
    receiver: tuple[_Receiver, str],
    upstream: tuple[_Upstream, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``otlp: {sampling: 0}`` and nothing else, the endpoint and service name come
    from ``OTEL_*``; no root trace is kept, but a client's sampled trace is."""
    got, endpoint = receiver
    fake, upstream_url = upstream
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    config = _config(upstream_url, tmp_path, {"sampling": 0.0})
    server = ServerThread(lambda: create_app(config, instance_id="otel-env")).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
        messages: Any = [{"role": "user", "content": "hi"}]
        client.chat.completions.create(model="fake-model", messages=messages)
        kept = client.chat.completions.with_raw_response.create(
            model="fake-model",
            messages=messages,
            extra_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
        )
    finally:
        server.stop()
    requests = _request_spans(got.spans)
    assert list(requests) == [kept.headers["x-request-id"]]
    assert {r.get("service.name") for r in got.resources} == {"from-env"}
    # the unsampled request still told its upstream (sampled flag off)
    first = fake.traceparents[0]
    assert first is not None and int(first.split("-")[3], 16) & 1 == 0
    assert "gen_ai.server.request.duration" in got.metrics  # metrics are not sampled
