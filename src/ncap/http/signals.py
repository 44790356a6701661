"""Operators' signals per request: one sanitized JSON access-log line on the logger
``ncap.access``, and optional OpenTelemetry spans (one per request, one per attempt).

What goes in is chosen field by field, never copied from the request: the gateway's
request id, the workload and environment of the key, configured route and model ids,
the HTTP status and error code, the policy result and reason, candidate counts,
token counts, cost and latency. No prompt, completion, header or tool argument can
reach a line or a span, because nothing read from the body or headers is passed in
(the canary test in ``tests/http/test_signals.py`` checks it).

The lifecycle reports each closed attempt (and a denial) through
``Accounting(observer=…)``; the handler opens a record when a request arrives and
closes it when the request ends: after the settlement of a whole answer (so its
tokens are known), after the last byte of a stream, or at its error.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from ncap.lifecycle import Attempt, Caller, Plan

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

__all__ = [
    "BatchedStreamHandler",
    "RequestSignals",
    "access_logger",
    "log_access_to_stdout",
    "tracer_for",
]

ACCESS_LOGGER = "ncap.access"
_encode = msgspec.json.Encoder(order="sorted").encode


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


def tracer_for(enabled: bool, provider: Any = None) -> Tracer | None:
    """The tracer spans are made with, when traces are on: from ``provider`` (tests pass
    one with an in-memory exporter), else the process's (set by the operator, e.g. by
    running under ``opentelemetry-instrument``)."""
    if not enabled:
        return None
    try:
        from opentelemetry import trace
    except ImportError as exc:
        from ncap.errors import ConfigError

        raise ConfigError(
            "observability.traces needs OpenTelemetry: pip install 'ncap[otel]'"
        ) from exc
    source = provider if provider is not None else trace.get_tracer_provider()
    tracer: Tracer = source.get_tracer("ncap")
    return tracer


@dataclass(slots=True)
class _Record:
    request_id: str
    started: float
    started_ns: int
    span: Span | None = None
    caller: Caller | None = None
    plan: Plan | None = None
    attempts: list[dict[str, Any]] = field(default_factory=list)
    status: int | None = None
    error_code: str | None = None
    latency_ms: float | None = None


class RequestSignals:
    """The open requests' records, keyed by request id (an instance's own state)."""

    def __init__(self, *, access_log: bool, tracer: Tracer | None = None) -> None:
        self._log = access_logger() if access_log else None
        self._tracer = tracer
        self._open: dict[str, _Record] = {}

    @property
    def enabled(self) -> bool:
        return self._log is not None or self._tracer is not None

    def begin(self, request_id: str) -> None:
        if not self.enabled:
            return
        record = _Record(request_id, time.monotonic(), time.time_ns())
        if self._tracer is not None:
            record.span = self._tracer.start_span(
                "ncap.request",
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

    # -- the lifecycle's hook (Accounting observer) ---------------------------------------

    def attempt_closed(
        self, plan: Plan, attempt: Attempt | None, final: Mapping[str, Any], outcome: str
    ) -> None:
        record = self._open.get(plan.request_id)
        if record is None:
            return
        record.plan = plan
        view = _attempt_view(plan, attempt, final, outcome)
        record.attempts.append(view)
        if record.span is not None and self._tracer is not None and attempt is not None:
            self._attempt_span(record.span, view)

    def _attempt_span(self, parent: Span, view: dict[str, Any]) -> None:
        from opentelemetry import trace

        assert self._tracer is not None
        end = time.time_ns()
        start = end - int((view.get("latency_ms") or 0) * 1e6)
        span = self._tracer.start_span(
            "ncap.attempt",
            context=trace.set_span_in_context(parent),
            start_time=start,
            attributes=_attributes(view),
        )
        span.end(end_time=end)

    # -- the end ---------------------------------------------------------------------------

    def end(self, request_id: str) -> None:
        record = self._open.pop(request_id, None)
        if record is None:
            return
        logging_it = self._log is not None and self._log.isEnabledFor(logging.INFO)
        if not logging_it and record.span is None:
            return  # nobody listens: the line is not even built
        line = _line(record)
        if logging_it and self._log is not None:
            text = _encode(line).decode()
            sink = self._log.handlers[0] if self._log.handlers else None
            if isinstance(sink, BatchedStreamHandler) and sink.takes_lines(self._log):
                sink.write_line(text)  # the stdout default: no LogRecord per request
            else:
                self._log.info(text)
        if record.span is not None:
            _end_span(record.span, line)


def _attempt_view(
    plan: Plan, attempt: Attempt | None, final: Mapping[str, Any], outcome: str
) -> dict[str, Any]:
    return {
        "attempt": attempt.number if attempt is not None else 0,
        "route": attempt.route.id if attempt is not None else None,
        "outcome": outcome,
        "state": final.get("state"),
        "returned": final.get("returned_candidate_count"),
        "input_tokens": final.get("input_tokens"),
        "output_tokens": final.get("output_tokens_total"),
        "cost_micros": final.get("cost_micros"),
        "latency_ms": final.get("latency_ms"),
        "requested": plan.decision.requested,
        "effective": plan.decision.effective,
    }


def _line(record: _Record) -> dict[str, Any]:
    plan, caller = record.plan, record.caller
    attempts = [a for a in record.attempts if a["attempt"] > 0]
    last = attempts[-1] if attempts else None
    line: dict[str, Any] = {
        "event": "request",
        "request_id": record.request_id,
        "workload": caller.workload_id if caller else None,
        "environment": caller.environment if caller else None,
        "status": record.status,
        "error_code": record.error_code,
        "latency_ms": record.latency_ms,
        "attempts": len(attempts),
    }
    if plan is not None:
        denied = any(a["attempt"] == 0 for a in record.attempts)
        line.update(
            model=plan.alias,
            route=last["route"] if last else plan.usable_routes[0].id,
            stream=plan.stream,
            emulated=plan.emulated,
            policy_result="deny" if denied else "allow",
            policy_reason=record.error_code if denied else plan.decision.policy_reason,
            exception_id=plan.decision.exception_id,
            candidates_requested=plan.decision.requested,
            candidates_effective=plan.decision.effective,
            candidates_returned=_sum(a["returned"] for a in _answered(attempts)),
            reserved_tokens=plan.reservation.total_tokens,
            input_tokens=_sum(a["input_tokens"] for a in attempts),
            output_tokens=_sum(a["output_tokens"] for a in attempts),
            cost_micros=_sum(a["cost_micros"] for a in attempts),
            states=sorted({str(a["state"]) for a in attempts}),
        )
    return line


def _answered(attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [a for a in attempts if a["outcome"] in ("completed", "stream_cut")]


def _sum(values: Any) -> int | None:
    """A total of known counts; None when none is known (never a guessed zero)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _attributes(view: Mapping[str, Any]) -> dict[str, Any]:
    """Span attributes: ``ncap.<name>``, only set values (OpenTelemetry takes no None)."""
    out: dict[str, Any] = {}
    for name, value in view.items():
        if value is None:
            continue
        out[f"ncap.{name}"] = value if isinstance(value, str | bool | int | float) else str(value)
    return out


def _end_span(span: Span, line: Mapping[str, Any]) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attributes(_attributes({k: v for k, v in line.items() if k != "event"}))
    status = line.get("status")
    if isinstance(status, int) and status >= 500:
        span.set_status(Status(StatusCode.ERROR, str(line.get("error_code") or status)))
    span.end()
