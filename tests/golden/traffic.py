"""Golden traffic: one scripted run of every request shape the gateway serves, through
the real app (``create_app`` in a server thread, as the other whole-app tests run it) in
front of the fake OpenAI-compatible, Anthropic and Gemini upstreams, recorded whole.

Per step: the status, every response header (sorted), the body's exact bytes (a
stream's relayed bytes), the bodies the upstreams received, the step's ledger rows
(every column) and its access-log line. After the script: the budget counters and
holds of every workload and the ``/metrics`` text. ``normalize`` then replaces only
what legitimately differs from run to run (ids, clocks, latencies; see its doc), so
two runs of the same code give equal recordings, whatever the stores.

``python -m tests.golden.record`` writes ``traffic.json``; ``test_golden_traffic.py``
replays the script and compares.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import yaml

from ncap.auth.keys import hash_key
from ncap.config import Config, parse_config
from ncap.http.app import STORES, create_app
from ncap.http.signals import ACCESS_LOGGER
from ncap.testing.fake_anthropic import ANTHROPIC_STATE, create_anthropic_app
from ncap.testing.fake_gemini import GEMINI_STATE, create_gemini_app
from ncap.testing.fake_kit import FakeState
from ncap.testing.fake_upstream import STATE
from ncap.testing.fake_upstream import create_app as create_fake_app
from tests.support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, ServerThread

__all__ = [
    "GOLDEN",
    "VARIANTS",
    "diff",
    "dump_golden",
    "load_golden",
    "record_variant",
    "route_keys",
]

GOLDEN = Path(__file__).with_name("traffic.json")

ANTHROPIC_KEY_ENV, ANTHROPIC_KEY = "NCAP_GOLDEN_ANTHROPIC_KEY", "sk-ant-golden"
GEMINI_KEY_ENV, GEMINI_KEY = "NCAP_GOLDEN_GEMINI_KEY", "gemini-golden"
ROUTE_KEYS = {
    UPSTREAM_KEY_ENV: UPSTREAM_KEY,
    ANTHROPIC_KEY_ENV: ANTHROPIC_KEY,
    GEMINI_KEY_ENV: GEMINI_KEY,
}
CLIENT_KEY = "sk-golden-default-0123456789"
TIGHT_KEY = "sk-golden-tight-0123456789"
WORKLOADS = ("default", "tight")
INSTANCE = "golden-gw"

# the stores each recording runs on: in-process, the shipped default (a SQLite ledger,
# in-process budgets rebuilt from it), and SQLite for both
VARIANTS: dict[str, Callable[[Path], dict[str, str]]] = {
    "memory": lambda tmp: {"ledger": "memory://", "budgets": "memory://"},
    "default": lambda tmp: {"ledger": f"sqlite:///{tmp}/ledger.db"},
    "sqlite": lambda tmp: {
        "ledger": f"sqlite:///{tmp}/ledger.db",
        "budgets": f"sqlite:///{tmp}/budgets.db",
    },
}

CONTRACT = {
    "candidates": "native",
    "max_candidates": 8,
    "output_cap": "per_candidate",
    "stream_usage": "include_usage",
}
PRICING = {"input_per_mtok": 0.15, "output_per_mtok": 0.6}


def _openai_route(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "provider": "openai",
        "base_url": url,
        "upstream_model": "fake-model",
        "api_key_env": UPSTREAM_KEY_ENV,
        "timeout_s": 5,
        "retries": 1,
        "backoff_s": 0.01,
        "pricing": PRICING,
        "contract": CONTRACT,
        **extra,
    }


def config(upstreams: dict[str, str], stores: dict[str, str]) -> Config:
    """Every route shape the script needs, two keyed workloads (one with a day's token
    budget small enough to run out) and the stores of the variant."""
    oa, anthropic, gemini = upstreams["openai"], upstreams["anthropic"], upstreams["gemini"]
    raw: dict[str, Any] = {
        "server": {"metrics_cache_s": 0, "idempotency_keep_answers": True},
        "stores": stores,
        "keys": [
            {"hash": hash_key(CLIENT_KEY), "workload": "default", "label": "golden"},
            {"hash": hash_key(TIGHT_KEY), "workload": "tight", "label": "tight"},
        ],
        "workloads": {
            "default": {"max_candidates": 4, "output_ceiling": 64},
            "tight": {"max_candidates": 2, "output_ceiling": 32, "tokens_per_day": 100},
        },
        "models": {
            "fake-model": ["fake"],
            "emu-model": ["emu"],
            "retry-model": ["flaky"],
            "fallback-model": ["broken", "fake"],
            "broken-model": ["broken"],
            "timeout-model": ["hangs"],
            "slow-model": ["slow"],
            "claude": ["anthropic"],
            "gem": ["gemini"],
        },
        "routes": {
            "fake": _openai_route(oa),
            "emu": _openai_route(oa, contract={**CONTRACT, "candidates": "emulate"}),
            # the first request of its key meets a 429, its retry is answered
            "flaky": _openai_route(
                oa,
                headers={
                    "x-fake-fault": "rate_limit=0",
                    "x-fake-fail-times": "1",
                    "x-fake-fail-key": "flaky",
                },
            ),
            "broken": _openai_route(oa, headers={"x-fake-fault": "error_500"}),
            "hangs": _openai_route(
                oa, retries=0, timeout_s=0.3, headers={"x-fake-fault": "timeout"}
            ),
            # events 50 ms apart: a client that hangs up leaves while the stream runs
            "slow": _openai_route(oa, headers={"x-fake-fault": "slow_chunks=50"}),
            "anthropic": {
                "provider": "anthropic",
                "base_url": anthropic,
                "upstream_model": "claude-fake",
                "api_key_env": ANTHROPIC_KEY_ENV,
                "retries": 1,
                "backoff_s": 0.01,
                "pricing": {"input_per_mtok": 3.0, "output_per_mtok": 15.0},
                "contract": {
                    "candidates": "emulate",
                    "max_candidates": 8,
                    "stream_usage": "include_usage",
                },
            },
            "gemini": {
                "provider": "gemini",
                "base_url": gemini,
                "upstream_model": "gemini-2.5-flash",
                "api_key_env": GEMINI_KEY_ENV,
                "retries": 1,
                "backoff_s": 0.01,
                "pricing": {"input_per_mtok": 0.3, "output_per_mtok": 2.5},
                "contract": {
                    "candidates": "native",
                    "max_candidates": 8,
                    "stream_usage": "include_usage",
                },
            },
        },
    }
    return parse_config(yaml.safe_dump(raw))


# --- the script ---------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "Name two colours."}]
AUTH = {"Authorization": f"Bearer {CLIENT_KEY}"}
TIGHT = {"Authorization": f"Bearer {TIGHT_KEY}"}
JSON = {"Content-Type": "application/json"}
USAGE: dict[str, Any] = {"stream_options": {"include_usage": True}}


@dataclass
class Step:
    name: str
    path: str
    body: dict[str, Any] | bytes | None = None  # None: a GET
    headers: dict[str, str] = field(default_factory=lambda: dict(AUTH))
    stream: bool = False
    # a fan-out's merged stream interleaves its branches as they arrive: recorded per
    # choice index (each branch's events in order), not in arrival order
    fanout: bool = False
    # read the stream's first event, then hang up
    disconnect: bool = False
    # a body too large or variable to pin whole: its length and first bytes only
    digest: bool = False

    @property
    def completion(self) -> bool:
        return self.path in ("/v1/chat/completions", "/v1/completions")


def _chat(model: str = "fake-model", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": MESSAGES, "max_completion_tokens": 24, **extra}


def _legacy(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": "Say hello.", "max_tokens": 12, **extra}


CHAT, LEGACY = "/v1/chat/completions", "/v1/completions"

STEPS: list[Step] = [
    Step("models", "/v1/models"),
    Step("healthz", "/healthz", headers={}),
    Step("readyz", "/readyz", headers={}),
    Step("chat_n1", CHAT, _chat()),
    Step(
        "chat_n1_max_tokens",
        CHAT,
        {"model": "fake-model", "messages": MESSAGES, "max_tokens": 10, "temperature": 0.5},
    ),
    Step("chat_n3_native", CHAT, _chat(n=3)),
    Step("chat_n2_emulated", CHAT, _chat("emu-model", n=2)),
    Step("stream_n1_usage", CHAT, _chat(stream=True, **USAGE), stream=True),
    Step("stream_n1_no_usage", CHAT, _chat(stream=True), stream=True),
    Step("stream_n2_native_usage", CHAT, _chat(n=2, stream=True, **USAGE), stream=True),
    Step("stream_n2_native_no_usage", CHAT, _chat(n=2, stream=True), stream=True),
    Step(
        "stream_n3_emulated_usage",
        CHAT,
        _chat("emu-model", n=3, stream=True, **USAGE),
        stream=True,
        fanout=True,
    ),
    Step(
        "stream_n2_emulated_no_usage",
        CHAT,
        _chat("emu-model", n=2, stream=True),
        stream=True,
        fanout=True,
    ),
    Step("legacy_n1", LEGACY, _legacy()),
    Step("legacy_n2_best_of3", LEGACY, _legacy(n=2, best_of=3)),
    Step("legacy_stream_n2_usage", LEGACY, _legacy(n=2, stream=True, **USAGE), stream=True),
    Step("legacy_best_of_on_stream", LEGACY, _legacy(best_of=2, stream=True), stream=True),
    Step("anthropic_n2", CHAT, _chat("claude", n=2)),
    Step(
        "anthropic_stream_n2_usage",
        CHAT,
        _chat("claude", n=2, stream=True, **USAGE),
        stream=True,
        fanout=True,
    ),
    Step("gemini_n2", CHAT, _chat("gem", n=2)),
    Step("gemini_stream_n2_usage", CHAT, _chat("gem", n=2, stream=True, **USAGE), stream=True),
    Step("deny_n_above_cap", CHAT, _chat(n=6)),
    Step("deny_n_above_absolute", CHAT, _chat(n=40)),
    Step("deny_stream_n_above_cap", CHAT, _chat(n=5, stream=True), stream=True),
    Step("bad_json", CHAT, b'{"model": "fake-model", "messages": [', headers={**AUTH, **JSON}),
    Step("body_not_object", CHAT, b"[1, 2]", headers={**AUTH, **JSON}),
    Step("unknown_field", CHAT, _chat(frobnicate=True)),
    Step("best_of_on_chat", CHAT, _chat(best_of=3)),
    Step("n_wrong_type", CHAT, _chat(n="two")),
    Step("messages_missing", CHAT, {"model": "fake-model"}),
    Step("max_tokens_negative", CHAT, _chat(max_completion_tokens=-1)),
    Step("unknown_model", CHAT, _chat("no-such-model")),
    Step("no_api_key", CHAT, _chat(), headers={}),
    Step("bad_api_key", CHAT, _chat(), headers={"Authorization": "Bearer sk-wrong"}),
    Step("models_no_key", "/v1/models", headers={}),
    Step("upstream_429_then_ok", CHAT, _chat("retry-model")),
    Step("upstream_500_fallback", CHAT, _chat("fallback-model")),
    Step("upstream_500_seen", CHAT, _chat("broken-model")),
    Step("upstream_500_seen_stream", CHAT, _chat("broken-model", stream=True), stream=True),
    Step("upstream_timeout", CHAT, _chat("timeout-model")),
    Step("idempotent_first", CHAT, _chat(n=2), headers={**AUTH, "Idempotency-Key": "golden-1"}),
    Step("idempotent_replay", CHAT, _chat(n=2), headers={**AUTH, "Idempotency-Key": "golden-1"}),
    Step("idempotent_conflict", CHAT, _chat(n=3), headers={**AUTH, "Idempotency-Key": "golden-1"}),
    Step(
        "idempotent_stream_first",
        CHAT,
        _chat(stream=True),
        stream=True,
        headers={**AUTH, "Idempotency-Key": "golden-2"},
    ),
    Step(
        "idempotent_stream_repeat",
        CHAT,
        _chat(stream=True),
        stream=True,
        headers={**AUTH, "Idempotency-Key": "golden-2"},
    ),
    Step("client_retry_count", CHAT, _chat(), headers={**AUTH, "x-stainless-retry-count": "2"}),
    Step("tight_first", CHAT, _chat(max_completion_tokens=20), headers=dict(TIGHT)),
    Step("tight_exhausted", CHAT, _chat(max_completion_tokens=20), headers=dict(TIGHT)),
    Step(
        "stream_client_disconnect",
        CHAT,
        _chat("slow-model", stream=True),
        stream=True,
        disconnect=True,
        headers={**AUTH},
    ),
    Step("openapi", "/openapi.json", headers={}, digest=True),
]


# --- running it -----------------------------------------------------------------------


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def _access_log() -> Iterator[_Lines]:
    logger = logging.getLogger(ACCESS_LOGGER)
    sink, level, propagate = _Lines(), logger.level, logger.propagate
    logger.addHandler(sink)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield sink
    finally:
        logger.removeHandler(sink)
        logger.setLevel(level)
        logger.propagate = propagate


def _server(factory: Callable[[], Any], stack: ExitStack) -> ServerThread:
    server = ServerThread(factory).start()
    stack.callback(server.stop)
    return server


@dataclass
class _Upstreams:
    urls: dict[str, str]
    states: dict[str, FakeState]

    def serials(self) -> dict[str, int]:
        return {name: state.serial for name, state in self.states.items()}

    def received(self, before: dict[str, int]) -> dict[str, list[str]]:
        """The bodies each upstream received since ``before`` (sorted: a fan-out's
        branches arrive in any order)."""
        out: dict[str, list[str]] = {}
        for name, state in self.states.items():
            count = state.serial - before[name]
            if count:
                bodies = list(state.recent_bodies)[-count:]
                out[name] = sorted(b.decode() for b in bodies)
        return out


def _upstreams(stack: ExitStack) -> _Upstreams:
    oa = _server(lambda: create_fake_app(None), stack)
    an = _server(lambda: create_anthropic_app(api_key=ANTHROPIC_KEY), stack)
    ge = _server(lambda: create_gemini_app(api_key=GEMINI_KEY), stack)
    assert oa.app is not None and an.app is not None and ge.app is not None
    return _Upstreams(
        {"openai": oa.url + "/v1", "anthropic": an.url + "/v1", "gemini": ge.url + "/v1beta"},
        {
            "openai": oa.app[STATE],
            "anthropic": an.app[ANTHROPIC_STATE],
            "gemini": ge.app[GEMINI_STATE],
        },
    )


def _send(client: httpx.Client, base: str, step: Step) -> tuple[int, list[list[str]], bytes]:
    method = "GET" if step.body is None else "POST"
    content = step.body if isinstance(step.body, bytes) else None
    payload = None if isinstance(step.body, bytes) or step.body is None else step.body
    request = client.build_request(
        method, base + step.path, json=payload, content=content, headers=step.headers
    )
    response = client.send(request, stream=True)
    try:
        if step.disconnect:
            body = b""
            for piece in response.iter_raw():
                body += piece
                if b"\n\n" in body:
                    break
            body = body[: body.index(b"\n\n") + 2]
        else:
            body = response.read()
    finally:
        response.close()
    headers = sorted([k.lower(), v] for k, v in response.headers.multi_items())
    return response.status_code, headers, body


def _wait(
    sink: _Lines, request_id: str | None, rows: Callable[[], list[dict[str, Any]]]
) -> tuple[list[dict[str, Any]], list[str]]:
    """A request is over when its access-log line is written (after its settlement, or
    a stream's last byte) and no row of it is still ``reserved``."""
    deadline = time.monotonic() + 10
    while True:
        lines = [line for line in sink.lines if request_id and request_id in line]
        found = rows()
        if lines and all(r["state"] != "reserved" for r in found):
            return found, lines
        if time.monotonic() > deadline:
            raise AssertionError(f"request {request_id} did not end: {found} {lines}")
        time.sleep(0.01)


def plain(value: Any) -> Any:
    """A store's value as plain data, whatever type carries it (a dataclass, a
    ``msgspec.Struct``, a mapping, a tuple): fields by name, instants as ISO text,
    sequences as lists. The recording pins values, not the classes that hold them."""
    if isinstance(value, datetime):
        return value.isoformat()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    struct_fields = getattr(type(value), "__struct_fields__", None)
    if struct_fields is not None:
        return {name: plain(getattr(value, name)) for name in struct_fields}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def _run(tmp: Path, stores: Callable[[Path], dict[str, str]]) -> dict[str, Any]:
    """One run of the script on fresh upstreams and stores; the raw recording."""
    with ExitStack() as stack, _access_log() as sink:
        ups = _upstreams(stack)
        cfg = config(ups.urls, stores(tmp))
        gw = _server(lambda: create_app(cfg, instance_id=INSTANCE), stack)
        assert gw.app is not None
        app_stores = gw.app[STORES]

        def rows_of(request_id: str | None) -> list[dict[str, Any]]:
            if request_id is None:
                return []
            found = gw.call(app_stores.ledger.get(request_id))
            return [plain(e) for e in found]

        client = stack.enter_context(httpx.Client(timeout=30))
        steps: list[dict[str, Any]] = []
        for step in STEPS:
            before = ups.serials()
            status, headers, body = _send(client, gw.url, step)
            request_id = dict((k, v) for k, v in headers).get("x-request-id")
            if step.completion:
                rows, lines = _wait(sink, request_id, partial(rows_of, request_id))
            else:
                rows, lines = rows_of(request_id), []
            steps.append(
                {
                    "step": step.name,
                    "request_id": request_id,
                    "status": status,
                    "headers": headers,
                    "body": body,
                    "upstream": ups.received(before),
                    "ledger": rows,
                    "access_log": [json.loads(line) for line in lines],
                }
            )
        # every row of the run, in the ledger's own order (rows of no step would show)
        every = [plain(e) for e in gw.call(_export(app_stores.ledger))]
        budgets = app_stores.budgets
        usage = {w: plain(gw.call(budgets.usage(w))) for w in WORKLOADS}
        holds = [plain(h) for h in gw.call(budgets.outstanding())]
        metrics = client.get(gw.url + "/metrics").text
        return {
            "steps": steps,
            "ledger_ids": [(r["request_id"], r["attempt"]) for r in every],
            "usage": usage,
            "holds": holds,
            "metrics": metrics,
            "unmatched_access_log": [
                line
                for line in sink.lines
                if not any(s["request_id"] and s["request_id"] in line for s in steps)
            ],
        }


async def _export(ledger: Any) -> list[Any]:
    return [e async for e in ledger.export()]


# --- what may differ between runs ------------------------------------------------------

# gateway request ids (``RequestIds``): named after the step that received them
_REQUEST_ID = re.compile(r"req-[0-9a-f]{16}-[0-9a-f]+")
# ids the upstreams generate (their serial counters, their instance) and those the
# gateway derives from them or draws: numbered in order of appearance within a step
_IDS = re.compile(
    r"req_fake_[0-9a-f]{8}_\d+|chatcmpl-fake-\d+|cmpl-fake-\d+|msg_fake_\d+"
    r"|chatcmpl-[0-9a-f]{24}\b"
)
_CREATED = re.compile(rb'"created":\s?\d+')
# latency histograms: their buckets and sums follow the clock, their counts do not
_LATENCY_HISTOGRAMS = ("ncap_upstream_latency_seconds",)
# gauges that are instants or ages
_CLOCK_GAUGES = (
    "ncap_route_last_failure_timestamp_seconds",
    "ncap_pending_reconciliation_oldest_age_seconds",
)


class _Names:
    """Volatile values replaced by stable names, numbered in order of first appearance."""

    def __init__(self, request_names: dict[str, str]) -> None:
        self.requests = request_names
        self.ids: dict[str, str] = {}

    def text(self, value: str) -> str:
        value = _REQUEST_ID.sub(lambda m: self.requests.get(m[0], "<req:unknown>"), value)
        return _IDS.sub(self._id, value)

    def _id(self, match: re.Match[str]) -> str:
        return self.ids.setdefault(match[0], f"<id{len(self.ids) + 1}>")

    def deep(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.deep(v) for v in value]
        if isinstance(value, dict):
            return {k: self.deep(v) for k, v in value.items()}
        return value


def _headers(headers: list[list[str]], names: _Names, body: bytes) -> list[str]:
    """``Date`` is the clock; so is a budget refusal's ``Retry-After`` (the time left in
    the window that ran out: the day's or the month's). ``Server`` is the HTTP library's
    name and version, which an upgrade of it changes, not the gateway."""
    window = b'"code":"budget_exhausted"' in body
    out = []
    for key, value in headers:
        if key in ("date", "server") or (window and key in ("retry-after", "retry-after-ms")):
            value = f"<{key}>"
        out.append(f"{key}: {names.text(value)}")
    return out


def _body(raw: bytes, names: _Names, step: Step) -> Any:
    raw = _CREATED.sub(b'"created":0', raw)
    if step.digest:
        return {"bytes": len(raw)}
    text = names.text(raw.decode())
    if step.fanout:
        return _by_choice(text)
    lines = text.splitlines(keepends=True)
    return lines if step.stream else text


def _by_choice(text: str) -> dict[str, list[str]]:
    """A merged fan-out stream: its events grouped by choice index, each group in its
    order ("-": events of no choice, e.g. the usage chunk), every event's bytes exact."""
    groups: dict[str, list[str]] = {}
    for event in text.split("\n\n"):
        if not event:
            continue
        key = "-"
        if event.startswith("data: {"):
            choices = json.loads(event[6:]).get("choices") or []
            if choices:
                key = ",".join(str(c.get("index")) for c in choices)
        groups.setdefault(key, []).append(event + "\n\n")
    return groups


def _row(row: dict[str, Any], names: _Names) -> dict[str, Any]:
    row = names.deep(row)
    row["timestamp"] = "<timestamp>"
    if row["latency_ms"] is not None:
        row["latency_ms"] = "<latency>"
    return row


def _access_line(line: dict[str, Any], names: _Names) -> dict[str, Any]:
    line = names.deep(line)
    if line.get("latency_ms") is not None:
        line["latency_ms"] = "<latency>"
    for attempt in line.get("attempts_detail", []) or []:
        if attempt.get("latency_ms") is not None:
            attempt["latency_ms"] = "<latency>"
    return line


def _metrics(text: str) -> list[str]:
    """Each family's samples sorted: a family fed from a store read lists its label sets
    in the order the read returned them, which is not fixed."""
    out: list[str] = []
    block: list[str] = []
    for line in [*text.splitlines(), "# end"]:
        if not line.startswith("#"):
            block.append(_metric_line(line))
            continue
        out += sorted(block)
        block = []
        out.append(line)
    return out[:-1]


def _metric_line(line: str) -> str:
    name = line.split("{", 1)[0].split(" ", 1)[0]
    if name.endswith("_created"):
        return line.rsplit(" ", 1)[0] + " <instant>"
    if any(name in (f"{h}_bucket", f"{h}_sum") for h in _LATENCY_HISTOGRAMS):
        return line.rsplit(" ", 1)[0] + " <latency>"
    if name in _CLOCK_GAUGES:
        return line.rsplit(" ", 1)[0] + " <clock>"
    return line


def _hold(hold: dict[str, Any], names: _Names) -> dict[str, Any]:
    hold = names.deep(hold)
    hold["created_at"] = "<instant>"
    for window in ("minute", "day", "month"):
        hold[window] = f"<{window}>"
    return hold


def _ledger_order(ids: list[tuple[str, int]], names: _Names) -> list[list[Any]]:
    """The requests in the ledger's export order, each with its attempt numbers (sorted:
    a fan-out's branches write their rows concurrently)."""
    order: dict[str, list[int]] = {}
    for request_id, attempt in ids:
        order.setdefault(names.text(request_id), []).append(attempt)
    return [[request_id, sorted(attempts)] for request_id, attempts in order.items()]


def normalize(raw: dict[str, Any]) -> dict[str, Any]:
    """The recording with only what legitimately varies replaced: request ids (named
    after their step), generated upstream/completion ids (numbered per step), ``created``
    fields, ``Date`` headers, timestamps and latencies of ledger rows and access lines,
    holds' instants and window keys, and in ``/metrics`` the latency histograms' buckets
    and sums, ``_created`` samples and clock gauges."""
    request_names = {s["request_id"]: f"<req:{s['step']}>" for s in raw["steps"] if s["request_id"]}
    by_name = {step.name: step for step in STEPS}
    steps = []
    for s in raw["steps"]:
        names = _Names(request_names)
        step = by_name[s["step"]]
        steps.append(
            {
                "step": s["step"],
                "status": s["status"],
                "headers": _headers(s["headers"], names, s["body"]),
                "body": _body(s["body"], names, step),
                "upstream": names.deep(s["upstream"]),
                "ledger": [_row(r, names) for r in s["ledger"]],
                "access_log": [_access_line(line, names) for line in s["access_log"]],
            }
        )
    names = _Names(request_names)
    return {
        "steps": steps,
        "ledger_order": _ledger_order(raw["ledger_ids"], names),
        "usage": raw["usage"],
        "holds": sorted((_hold(h, names) for h in raw["holds"]), key=lambda h: h["hold_id"]),
        "metrics": _metrics(raw["metrics"]),
        "unmatched_access_log": raw["unmatched_access_log"],
    }


def record_variant(name: str, tmp: Path) -> dict[str, Any]:
    """The normalized recording of one run on the variant's stores. A run that crossed a
    minute boundary (the budget windows' smallest bucket) is run again on fresh stores:
    the minute counters would differ from a run inside one minute."""
    for attempt in range(2):
        if datetime.now(UTC).second >= 55:  # too close to the next minute to fit
            time.sleep(60.5 - datetime.now(UTC).second)
        start = datetime.now(UTC).replace(second=0, microsecond=0)
        work = tmp / f"{name}-{attempt}"
        work.mkdir(parents=True)
        raw = _run(work, VARIANTS[name])
        if datetime.now(UTC).replace(second=0, microsecond=0) == start:
            return normalize(raw)
    raise AssertionError("two runs in a row crossed a minute boundary")


@contextmanager
def route_keys() -> Iterator[None]:
    """The routes' upstream credentials, in the environment for the run."""
    import os

    saved = {k: os.environ.get(k) for k in ROUTE_KEYS}
    os.environ.update(ROUTE_KEYS)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def delta(base: Any, other: Any, path: tuple[Any, ...] = ()) -> list[list[Any]]:
    """``other`` as ``[path, value]`` replacements of ``base``'s parts (the smallest
    part that differs: a dict with other keys or a list of another length whole)."""
    if base == other:
        return []
    if isinstance(base, dict) and isinstance(other, dict) and base.keys() == other.keys():
        return [d for key in base for d in delta(base[key], other[key], (*path, key))]
    if isinstance(base, list) and isinstance(other, list) and len(base) == len(other):
        return [
            d
            for i, (a, b) in enumerate(zip(base, other, strict=True))
            for d in delta(a, b, (*path, i))
        ]
    return [[list(path), other]]


def apply(base: Any, changes: list[list[Any]]) -> Any:
    """``base`` with ``delta``'s replacements made (``base`` is not changed)."""
    import copy

    out = copy.deepcopy(base)
    for path, value in changes:
        if not path:
            return copy.deepcopy(value)
        target = out
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = copy.deepcopy(value)
    return out


def load_golden() -> dict[str, Any]:
    """Each variant's recording, from ``traffic.json`` (the shipped default's whole,
    the other variants as their differences from it)."""
    stored = json.loads(GOLDEN.read_text())
    base = stored["default"]
    return {"default": base} | {
        name: apply(base, changes) for name, changes in stored["differences"].items()
    }


def dump_golden(recordings: dict[str, Any]) -> str:
    base = recordings["default"]
    differences = {name: delta(base, rec) for name, rec in recordings.items() if name != "default"}
    stored = {"default": base, "differences": differences}
    return json.dumps(stored, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def diff(expected: Any, actual: Any) -> str:
    """A unified diff of two recordings, as indented JSON."""
    import difflib

    a = json.dumps(expected, indent=1, sort_keys=True).splitlines()
    b = json.dumps(actual, indent=1, sort_keys=True).splitlines()
    return "\n".join(difflib.unified_diff(a, b, "golden", "this run", lineterm="", n=4))
