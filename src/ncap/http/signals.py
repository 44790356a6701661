"""Operators' signals per request: one sanitized JSON access-log line on the logger
``ncap.access``, and optional OpenTelemetry spans (one per request, one per attempt,
named and annotated by the GenAI conventions) and GenAI metrics (``ncap.http.telemetry``).

What goes in is chosen field by field, never copied from the request: the gateway's
request id, the workload and environment of the key, configured route and model ids,
the HTTP status and error code, the policy result and reason, candidate counts,
token counts, cost and latency. No prompt, completion, header or tool argument can
reach a line or a span: nothing read from the body is passed in, and of the headers
only the trace context's ids and flags are kept (the canary tests in
``tests/http/test_signals.py`` and ``tests/http/test_otel_genai.py`` check it).

The lifecycle reports each closed attempt (and a denial) through
``Accounting(observers=…)``; the handler opens a record when a request arrives and
closes it when the request ends: after the last byte of a stream, or at its error. A
whole answer's record is closed by the lifecycle's settlement service
(``settled``) once the answer's settlement is done, so its tokens are known.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from msgspec import UNSET, UnsetType

from ncap.config import Route
from ncap.http.telemetry import PROVIDER_NAMES, Telemetry, finish_reason
from ncap.lifecycle import Attempt, Caller, Plan

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

__all__ = [
    "BatchedStreamHandler",
    "RequestSignals",
    "access_logger",
    "log_access_to_stdout",
]

ACCESS_LOGGER = "ncap.access"
_encode = msgspec.json.Encoder().encode  # an AccessLine: its fields are in key order


def access_logger() -> logging.Logger:
    return logging.getLogger(ACCESS_LOGGER)


def log_access_to_stdout() -> None:
    """For ``ncap serve``: the access lines on stdout, one JSON object per line, unless
    the operator's logging configuration already gave the logger a handler."""
    logger = access_logger()
    if logger.handlers:
        return
    handler = BatchedStreamHandler(sys.stdout, plain=True)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class BatchedStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A ``StreamHandler`` that writes its lines in batches, at most every
    ``interval_s`` (and at close, or when ``max_pending`` lines wait), not one write per
    record: the event loop only appends the formatted line to a list, and a background
    thread makes the one system call per batch (the GIL is released while it writes).
    So no line waits longer than ``interval_s`` and the loop never blocks on stdout; a
    ``kill -9`` can lose at most that much of the access log (never a ledger row: the
    ledger is its own store).
    """

    def __init__(
        self,
        stream: Any,
        interval_s: float = 0.25,
        max_pending: int = 4096,
        *,
        plain: bool = False,
    ) -> None:
        super().__init__(stream)
        if plain:
            self.setFormatter(logging.Formatter("%(message)s"))
        self._plain_formatter = self.formatter if plain else None
        self._interval_s = interval_s
        self._max_pending = max_pending
        self._pending: list[str] = []
        self._stop = threading.Event()
        self._flusher = threading.Thread(
            target=self._flush_periodically, name="ncap-access-log", daemon=True
        )
        self._flusher.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self.write_line(text)

    def takes_lines(self, logger: logging.Logger) -> bool:
        """Whether a line for ``logger`` can skip the ``LogRecord`` machinery: this is its
        only handler, formatting is the plain message and nothing filters."""
        return (
            self._plain_formatter is not None
            and self.formatter is self._plain_formatter
            and not self.filters
            and not logger.filters
            and logger.handlers == [self]
        )

    def write_line(self, text: str) -> None:
        """What ``logger.info(text)`` would emit through this handler, minus the record."""
        with self.lock:  # type: ignore[union-attr]  # the flusher swaps the list under it
            self._pending.append(text + self.terminator)
            full = len(self._pending) >= self._max_pending
        if full:
            self.flush_now()

    def flush(self) -> None:
        """Lines go out in batches (``flush_now``), not at each record."""

    def flush_now(self) -> None:
        self.acquire()
        try:
            lines, self._pending = self._pending, []
            if lines and self.stream:
                self.stream.write("".join(lines))
                if hasattr(self.stream, "flush"):
                    self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stdout (EPIPE) must not take the gateway down
        finally:
            self.release()

    def close(self) -> None:
        self._stop.set()
        self.flush_now()
        super().close()

    def _flush_periodically(self) -> None:
        while not self._stop.wait(self._interval_s):
            if self._pending:
                self.flush_now()


class _Record(msgspec.Struct, gc=False):
    """One open request's record (a struct: built in C, one per request). Not tracked by
    the garbage collector: it never takes part in a reference cycle (it holds the
    request's values; nothing it holds refers back to it)."""

    request_id: str
    started: float
    started_ns: int
    span: Span | None = None
    caller: Caller | None = None
    plan: Plan | None = None
    attempts: list[_Closed] = msgspec.field(default_factory=list)
    status: int | None = None
    error_code: str | None = None
    latency_ms: float | None = None
    # the lifecycle's settlement was done before the status was known: end at ``responded``
    settled: bool = False
    # open attempt spans by attempt number (telemetry only)
    attempt_spans: dict[int, Span] = msgspec.field(default_factory=dict)


class RequestSignals:
    """The open requests' records, keyed by request id (an instance's own state)."""

    def __init__(self, *, access_log: bool, telemetry: Telemetry | None = None) -> None:
        self._log = access_logger() if access_log else None
        self._otel = telemetry
        self._open: dict[str, _Record] = {}
        # whether anyone listens: without an access log or telemetry, no record is kept
        self.enabled = self._log is not None or self._otel is not None

    @property
    def telemetry(self) -> Telemetry | None:
        return self._otel

    def shutdown(self) -> None:
        """Flush and close the exporters telemetry made (a no-op without them)."""
        if self._otel is not None:
            self._otel.shutdown()

    def attempt_begun(self, attempt: Attempt) -> None:
        """Open the attempt's span (a child of the request's) and give the attempt the
        ``traceparent`` its upstream request carries. Only told when telemetry is on
        (``create_app`` registers this observer's start hook then)."""
        record = self._open.get(attempt.plan.request_id)
        if record is None or record.span is None or self._otel is None:
            return
        from opentelemetry.trace import SpanKind, set_span_in_context

        record.plan = attempt.plan  # known before the first chunk (time to first token)
        route = attempt.route.route
        model = route.upstream_model or attempt.plan.alias
        # an unsampled trace's spans record nothing: their attributes are not built
        recording = record.span.is_recording()
        span = self._otel.tracer.start_span(
            f"{_operation(attempt.plan)} {model}",
            context=set_span_in_context(record.span),
            kind=SpanKind.CLIENT,
            attributes=_gen_ai_request(
                attempt.plan, route.provider, model, attempt.plan.candidates_per_attempt
            )
            if recording
            else None,
        )
        record.attempt_spans[attempt.number] = span
        carrier: dict[str, str] = {}
        self._otel.propagator.inject(carrier, context=set_span_in_context(span))
        attempt.trace = carrier

    def begin(self, request_id: str, headers: Mapping[str, str] | None = None) -> None:
        """A request arrived; with telemetry its span continues the client's trace
        (``traceparent`` in ``headers``)."""
        if not self.enabled:
            return
        record = _Record(request_id, time.monotonic(), time.time_ns())
        if self._otel is not None:
            from opentelemetry.trace import SpanKind

            parent = _parent(self._otel, headers) if headers is not None else None
            record.span = self._otel.tracer.start_span(
                "ncap.request",  # renamed ``{operation} {model}`` once the model is known
                context=parent,
                kind=SpanKind.SERVER,
                start_time=record.started_ns,
                attributes={"ncap.request_id": request_id},
            )
        self._open[request_id] = record

    def caller(self, request_id: str, caller: Caller) -> None:
        record = self._open.get(request_id)
        if record is not None:
            record.caller = caller

    def responded(self, request_id: str, status: int, error_code: str | None = None) -> None:
        """The answer's status is known (its body may still be on its way)."""
        record = self._open.get(request_id)
        if record is not None and record.status is None:
            record.status, record.error_code = status, error_code
            record.latency_ms = round((time.monotonic() - record.started) * 1000, 3)
            if record.settled:
                self.end(request_id)

    def settled(self, request_id: str) -> None:
        """The settlement service ran a whole answer's settlement (its tokens are known):
        the record ends now, or at ``responded`` if the handler has not written the
        answer yet (an idempotency key's store write can come in between)."""
        record = self._open.get(request_id)
        if record is None:
            return
        if record.status is None:
            record.settled = True
        else:
            self.end(request_id)

    def first_chunk(self, request_id: str) -> None:
        """A streamed answer's first chunk went out (``gen_ai.server.time_to_first_token``)."""
        if self._otel is None:
            return
        record = self._open.get(request_id)
        plan = record.plan if record is not None else None
        if record is not None and plan is not None:
            elapsed = time.monotonic() - record.started
            attributes = _metric_attributes(plan, plan.usable_routes[0].route, plan.alias)
            self._otel.time_to_first_token.record(elapsed, attributes)

    # -- the lifecycle's hook (Accounting observer) ---------------------------------------

    def attempt_closed(
        self, plan: Plan, attempt: Attempt | None, final: Mapping[str, Any], outcome: str
    ) -> None:
        record = self._open.get(plan.request_id)
        if record is None:
            return
        record.plan = plan
        if attempt is None:
            record.attempts.append(_Closed(0, None, outcome, final))
            return
        closed = _Closed(attempt.number, attempt.route.id, outcome, final)
        record.attempts.append(closed)
        if self._otel is not None:
            view = _attempt_view(plan, closed)
            span = record.attempt_spans.pop(attempt.number, None)
            if span is not None:
                _end_attempt_span(span, view)
            self._count_tokens(plan, attempt, view)

    def _count_tokens(self, plan: Plan, attempt: Attempt, view: Mapping[str, Any]) -> None:
        assert self._otel is not None
        route = attempt.route.route
        attributes = _metric_attributes(plan, route, route.upstream_model or plan.alias)
        for kind, key in (("input", "input_tokens"), ("output", "output_tokens")):
            if view.get(key) is not None:
                self._otel.token_usage.record(view[key], {**attributes, "gen_ai.token.type": kind})

    # -- the end ---------------------------------------------------------------------------

    def end(self, request_id: str) -> None:
        record = self._open.pop(request_id, None)
        if record is None:
            return
        logging_it = self._log is not None and self._log.isEnabledFor(logging.INFO)
        if not logging_it and self._otel is None:
            return  # nobody listens: the line is not even built
        line = _line(record)
        if logging_it and self._log is not None:
            text = _encode(line).decode()
            sink = self._log.handlers[0] if self._log.handlers else None
            if isinstance(sink, BatchedStreamHandler) and sink.takes_lines(self._log):
                sink.write_line(text)  # the stdout default: no LogRecord per request
            else:
                self._log.info(text)
        if self._otel is not None:
            self._end_request(record, line)

    def _end_request(self, record: _Record, line: AccessLine) -> None:
        assert self._otel is not None
        for span in record.attempt_spans.values():  # begun, never closed (cancelled)
            span.end()
        if record.span is not None:
            _end_span(record.span, record, line)
        plan = record.plan
        if plan is not None:
            route = _answering_route(plan, [a for a in record.attempts if a.number > 0])
            attributes = _metric_attributes(plan, route, plan.alias)
            if line.status is not None and line.status >= 400:
                attributes["error.type"] = str(line.error_code or line.status)
            elapsed = time.monotonic() - record.started
            self._otel.request_duration.record(elapsed, attributes)


def _parent(otel: Telemetry, headers: Mapping[str, str]) -> Context | None:
    """The client's trace to continue: its trace id, parent span id and flags only. Its
    ``tracestate`` (free text a client wrote) is not kept, so it can reach neither an
    exported span nor an upstream request."""
    from opentelemetry.trace import (
        NonRecordingSpan,
        SpanContext,
        get_current_span,
        set_span_in_context,
    )

    sent = get_current_span(otel.propagator.extract(headers)).get_span_context()
    if not sent.is_valid:
        return None
    bare = SpanContext(sent.trace_id, sent.span_id, is_remote=True, trace_flags=sent.trace_flags)
    return set_span_in_context(NonRecordingSpan(bare))


class _Closed(msgspec.Struct, frozen=True, gc=False):
    """An attempt (0: the request's denial) as its record keeps it: its final row
    columns as the books wrote them, read when the record ends."""

    number: int
    route: str | None
    outcome: str
    final: Mapping[str, Any]


def _attempt_view(plan: Plan, closed: _Closed) -> dict[str, Any]:
    """An attempt's span attributes and token counts (telemetry only)."""
    final = closed.final
    return {
        "attempt": closed.number,
        "route": closed.route,
        "outcome": closed.outcome,
        "state": final.get("state"),
        "returned": final.get("returned_candidate_count"),
        "input_tokens": final.get("input_tokens"),
        "output_tokens": final.get("output_tokens_total"),
        "cached_input_tokens": final.get("cached_input_tokens"),
        "reasoning_tokens": final.get("reasoning_tokens"),
        "finish_reasons": final.get("finish_reasons"),
        "cost_micros": final.get("cost_micros"),
        "latency_ms": final.get("latency_ms"),
        "requested": plan.decision.requested,
        "effective": plan.decision.effective,
    }


class AccessLine(msgspec.Struct, gc=False):
    """One request's access-log line. The fields are declared in sorted order, so the
    JSON object comes out with its keys sorted without sorting them per line; the
    plan's fields are left out (``UNSET``) for a request refused before it had one.
    Every field is given, by position: from keywords in another order than the
    fields', msgspec matches each name against the fields, which cost several times
    the line's other work."""

    attempts: int
    candidates_effective: int | UnsetType
    candidates_requested: int | UnsetType | None
    candidates_returned: int | UnsetType | None
    cost_micros: int | UnsetType | None
    emulated: bool | UnsetType
    environment: str | None
    error_code: str | None
    event: str
    exception_id: str | UnsetType | None
    input_tokens: int | UnsetType | None
    latency_ms: float | None
    model: str | UnsetType
    output_tokens: int | UnsetType | None
    policy_reason: str | UnsetType | None
    policy_result: str | UnsetType
    request_id: str
    reserved_tokens: int | UnsetType
    route: str | UnsetType | None
    states: list[str] | UnsetType
    status: int | None
    stream: bool | UnsetType
    workload: str | None

    def fields(self) -> dict[str, Any]:
        """The line's keys and values, in key order (the ones it has)."""
        return {
            name: value
            for name in self.__struct_fields__
            if (value := getattr(self, name)) is not UNSET
        }


def _line(record: _Record) -> AccessLine:
    """The access-log line: one pass over the attempts for every total (each a sum of
    the known counts, None when none is known: never a guessed zero)."""
    plan, caller = record.plan, record.caller
    attempts, denied = _dispatched(record.attempts)
    if plan is None:
        return _line_without_plan(record, len(attempts))
    returned, input_tokens, output_tokens, cost, states = _totals(attempts)
    decision = plan.decision
    return AccessLine(
        len(attempts),  # attempts
        decision.effective,  # candidates_effective
        decision.requested,  # candidates_requested
        returned,  # candidates_returned
        cost,  # cost_micros
        plan.emulated,
        caller.environment if caller else None,
        record.error_code,
        "request",  # event
        decision.exception_id,
        input_tokens,
        record.latency_ms,
        plan.alias,  # model
        output_tokens,
        record.error_code if denied else decision.policy_reason,  # policy_reason
        "deny" if denied else "allow",  # policy_result
        record.request_id,
        plan.reservation.total_tokens,  # reserved_tokens
        attempts[-1].route if attempts else plan.usable_routes[0].id,  # route
        states,
        record.status,
        plan.stream,
        caller.workload_id if caller else None,  # workload
    )


def _dispatched(closed: list[_Closed]) -> tuple[list[_Closed], bool]:
    """The dispatched attempts, and whether the request was denied (attempt 0)."""
    attempts: list[_Closed] = []
    denied = False
    for attempt in closed:
        if attempt.number > 0:
            attempts.append(attempt)
        elif attempt.number == 0:
            denied = True
    return attempts, denied


def _totals(
    attempts: list[_Closed],
) -> tuple[int | None, int | None, int | None, int | None, list[str]]:
    """Candidates returned, input and output tokens, cost (each None until a known
    count arrives), and the attempts' states, sorted."""
    returned = input_tokens = output_tokens = cost = None
    states = set()
    for a in attempts:
        final = a.final
        if a.outcome in _ANSWERED and (v := final.get("returned_candidate_count")) is not None:
            returned = v if returned is None else returned + v
        if (v := final.get("input_tokens")) is not None:
            input_tokens = v if input_tokens is None else input_tokens + v
        if (v := final.get("output_tokens_total")) is not None:
            output_tokens = v if output_tokens is None else output_tokens + v
        if (v := final.get("cost_micros")) is not None:
            cost = v if cost is None else cost + v
        states.add(str(final.get("state")))
    return returned, input_tokens, output_tokens, cost, sorted(states)


def _line_without_plan(record: _Record, attempts: int) -> AccessLine:
    """The line of a request that ended before it had a plan: the plan's fields left
    out (``UNSET``)."""
    caller = record.caller
    return AccessLine(
        attempts,
        UNSET,  # candidates_effective
        UNSET,  # candidates_requested
        UNSET,  # candidates_returned
        UNSET,  # cost_micros
        UNSET,  # emulated
        caller.environment if caller else None,
        record.error_code,
        "request",  # event
        UNSET,  # exception_id
        UNSET,  # input_tokens
        record.latency_ms,
        UNSET,  # model
        UNSET,  # output_tokens
        UNSET,  # policy_reason
        UNSET,  # policy_result
        record.request_id,
        UNSET,  # reserved_tokens
        UNSET,  # route
        UNSET,  # states
        record.status,
        UNSET,  # stream
        caller.workload_id if caller else None,  # workload
    )


_ANSWERED = ("completed", "stream_cut")  # the outcomes that returned candidates


def _sum(values: Any) -> int | None:
    """A total of known counts; None when none is known (never a guessed zero)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


_NCAP_ATTEMPT_FIELDS = (
    "attempt",
    "route",
    "outcome",
    "state",
    "returned",
    "input_tokens",
    "output_tokens",
    "cost_micros",
    "latency_ms",
    "requested",
    "effective",
)


def _attributes(view: Mapping[str, Any]) -> dict[str, Any]:
    """Span attributes: ``ncap.<name>``, only set values (OpenTelemetry takes no None)."""
    out: dict[str, Any] = {}
    for name, value in view.items():
        if value is None:
            continue
        out[f"ncap.{name}"] = value if isinstance(value, str | bool | int | float) else str(value)
    return out


def _operation(plan: Plan) -> str:
    return "chat" if plan.kind == "chat" else "text_completion"


def _gen_ai_request(plan: Plan, provider: str, model: str, count: int) -> dict[str, Any]:
    """The GenAI request attributes of a request or attempt span (``model``: the alias
    for the request, the upstream's model for an attempt; ``count``: the choices it
    asked for). Only config ids and numbers: the alias is a configured model (an
    unknown one never gets a plan)."""
    out: dict[str, Any] = {
        "gen_ai.operation.name": _operation(plan),
        "gen_ai.provider.name": PROVIDER_NAMES.get(provider, provider),
        "gen_ai.request.model": model,
    }
    if count != 1:
        out["gen_ai.request.choice.count"] = count
    sampling = plan.sampling
    if sampling.max_tokens is not None:
        out["gen_ai.request.max_tokens"] = sampling.max_tokens
    if sampling.temperature is not None:
        out["gen_ai.request.temperature"] = sampling.temperature
    if sampling.seed is not None:
        out["gen_ai.request.seed"] = sampling.seed
    return out


def _finish_list(counts: Mapping[str, int] | None) -> list[str]:
    """``gen_ai.response.finish_reasons``: one entry per returned choice."""
    out: list[str] = []
    for reason, count in sorted((counts or {}).items()):
        out.extend([finish_reason(reason)] * count)
    return out


def _gen_ai_usage(views: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Usage and finish reasons of the answered attempts, summed (a fan-out pays each
    branch's prompt)."""
    out: dict[str, Any] = {}
    usage = (
        ("gen_ai.usage.input_tokens", "input_tokens"),
        ("gen_ai.usage.output_tokens", "output_tokens"),
        ("gen_ai.usage.cache_read.input_tokens", "cached_input_tokens"),
        ("gen_ai.usage.reasoning.output_tokens", "reasoning_tokens"),
    )
    for name, key in usage:
        total = _sum(v.get(key) for v in views)
        if total is not None:
            out[name] = total
    answered = [v for v in views if v["outcome"] in _ANSWERED]
    reasons = [r for v in answered for r in _finish_list(v.get("finish_reasons"))]
    if reasons:
        out["gen_ai.response.finish_reasons"] = reasons
    return out


def _end_attempt_span(span: Span, view: Mapping[str, Any]) -> None:
    from opentelemetry.trace import Status, StatusCode

    if not span.is_recording():
        span.end()
        return
    span.set_attributes(_gen_ai_usage([view]))
    span.set_attributes(_attributes({k: view.get(k) for k in _NCAP_ATTEMPT_FIELDS}))
    if view["outcome"] not in ("completed", "stream_cut"):
        span.set_attribute("error.type", str(view["outcome"]))
        span.set_status(Status(StatusCode.ERROR, str(view["outcome"])))
    span.end()


def _metric_attributes(plan: Plan, route: Route, model: str) -> dict[str, Any]:
    """Bounded attributes: the configured model and the route's kind only."""
    return {
        "gen_ai.operation.name": _operation(plan),
        "gen_ai.provider.name": PROVIDER_NAMES.get(route.provider, route.provider),
        "gen_ai.request.model": model,
        "gen_ai.response.model": route.upstream_model or plan.alias,
    }


def _end_span(span: Span, record: _Record, line: AccessLine) -> None:
    from opentelemetry.trace import Status, StatusCode

    if not span.is_recording():
        span.end()
        return
    span.set_attributes(_attributes({k: v for k, v in line.fields().items() if k != "event"}))
    plan = record.plan
    if plan is not None:
        answered = [a for a in record.attempts if a.number > 0]
        route = _answering_route(plan, answered)
        span.update_name(f"{_operation(plan)} {plan.alias}")
        span.set_attributes(
            _gen_ai_request(plan, route.provider, plan.alias, plan.decision.effective)
        )
        span.set_attributes(_gen_ai_usage([_attempt_view(plan, a) for a in answered]))
        span.set_attributes(
            {
                "gen_ai.response.model": route.upstream_model or plan.alias,
                "gen_ai.response.id": record.request_id,
                "ncap.reserved_cost_micros": plan.reservation.cost_micros,
            }
        )
    status = line.status
    if status is not None and status >= 400:
        span.set_attribute("error.type", str(line.error_code or status))
    if status is not None and status >= 500:
        span.set_status(Status(StatusCode.ERROR, str(line.error_code or status)))
    span.end()


def _answering_route(plan: Plan, attempts: list[_Closed]) -> Route:
    """The route of the last attempt (the one whose answer the client got), else the
    primary."""
    last = attempts[-1].route if attempts else None
    for rt in plan.usable_routes:
        if rt.id == last:
            return rt.route
    return plan.usable_routes[0].route
