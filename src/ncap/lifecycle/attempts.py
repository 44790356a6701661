"""Attempts: one try of one route each (first call, retry, fallback), with its own
ledger row and hold (retries and fallbacks: docs/configuration.md).

``Attempts.first_answer`` walks the chain in order, each route up to 1 + retries
times, with exponential backoff and jitter, honouring Retry-After; only retryable
failures move on. ``call`` and ``open`` run one attempt (whole, or a stream up to its
first event): a failure is recorded on the attempt's row, then raised. A streamed
attempt may only be retried before its first event reached the client.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

from ncap.config import Route
from ncap.errors import NcapError
from ncap.lifecycle.failures import as_failure, client_error, may_fall_back, retryable
from ncap.lifecycle.plan import Attempt, Holds, Plan, RouteRuntime
from ncap.lifecycle.settle import Accounting
from ncap.providers.base import (
    CLIENT_REQUEST_ID,
    TRACE_HEADERS,
    AttemptFailed,
    RequestKind,
    UpstreamResult,
)
from ncap.stores.ports import hold_id_for
from ncap.streaming.sse import StreamPiece

__all__ = ["Attempts", "StreamOpen", "for_route"]

T = TypeVar("T")
_MAX_RETRY_AFTER_S = 60.0
_NO_CEILING: Mapping[str, int] = MappingProxyType({})


@dataclass(slots=True)
class StreamOpen:
    """An upstream stream whose first piece (events of one read) has arrived (so the
    attempt succeeded)."""

    stack: AsyncExitStack
    provider_request_id: str | None
    events: AsyncIterator[StreamPiece]
    first: StreamPiece | None


class Attempts:
    def __init__(self, accounting: Accounting, sleep: Callable[[float], Awaitable[None]]) -> None:
        self.accounting = accounting
        self._sleep = sleep

    async def first_answer(
        self, plan: Plan, holds: Holds, call: Callable[[Attempt], Awaitable[T]]
    ) -> tuple[Attempt, T]:
        """The first attempt along the chain that answers, and its answer."""
        last: AttemptFailed | None = None
        number = 0
        for rt in plan.usable_routes:
            for i in range(rt.route.retries + 1):
                if i > 0 and last is not None:  # a fallback is tried at once
                    await self._sleep(_delay(rt.route, i, last))
                number += 1
                attempt = await self.accounting.begin(plan, holds, number, rt)
                try:
                    return attempt, await call(attempt)
                except AttemptFailed as exc:
                    last = exc
                    if retryable(exc):
                        continue
                    if may_fall_back(exc):
                        break  # the route's limit, not the request's: a fallback may serve
                    raise _told(client_error(exc), plan, rt) from None
        assert last is not None
        raise _told(client_error(last), plan, attempt.route) from None

    async def call(self, attempt: Attempt, body: Mapping[str, Any]) -> UpstreamResult:
        """One non-streamed attempt; a failure is recorded on its row, then raised."""
        rt = attempt.route
        hold = attempt.hold  # its id is the attempt's (``hold_id_for``)
        number = attempt.number
        rid = hold.hold_id if hold is not None else hold_id_for(attempt.plan.request_id, number)
        CLIENT_REQUEST_ID.set(rid)
        if attempt.trace is not None:
            TRACE_HEADERS.set(attempt.trace)  # this task's upstream request carries it
        try:
            result = await rt.provider.complete(
                body, timeout=rt.route.timeout_s, kind=attempt.plan.kind
            )
        except (AttemptFailed, NcapError) as exc:
            if rt.health is not None:
                rt.health.failed(exc)
            await self.accounting.failed(attempt, as_failure(exc))
            raise
        if rt.health is not None and rt.health.up is not True:  # up already: nothing moves
            rt.health.answered()
        return result

    async def open(self, attempt: Attempt, body: Mapping[str, Any]) -> StreamOpen:
        """One streamed attempt up to its first event; a failure is recorded, then raised."""
        CLIENT_REQUEST_ID.set(hold_id_for(attempt.plan.request_id, attempt.number))
        if attempt.trace is not None:
            TRACE_HEADERS.set(attempt.trace)
        try:
            return await _open_stream(attempt.route, body, attempt.plan.kind)
        except (AttemptFailed, NcapError) as exc:
            await self.accounting.failed(attempt, as_failure(exc))
            raise


def _told(error: NcapError, plan: Plan, rt: RouteRuntime) -> NcapError:
    """The client's error, with the request's ``x-ncap-*`` headers (the last route tried)."""
    error.request_headers = plan.headers(rt.id)
    return error


async def _open_stream(rt: RouteRuntime, body: Mapping[str, Any], kind: RequestKind) -> StreamOpen:
    """The stream opened and its first piece read. The route answered once the stream
    opened; a failure of the first event is the route's too (as one mid-way is)."""
    stack = AsyncExitStack()
    try:
        rid, events = await stack.enter_async_context(
            rt.provider.stream(body, timeout=rt.route.timeout_s, kind=kind)
        )
        if rt.health is not None:
            rt.health.answered()
        first = await anext(events, None)
    except BaseException as exc:
        await stack.aclose()
        if rt.health is not None:
            rt.health.failed(exc)
        raise
    return StreamOpen(stack, rid, events, first)


def for_route(
    body: dict[str, Any],
    rt: RouteRuntime,
    extras: frozenset[str],
    *,
    stream: bool,
    ceiling: Mapping[str, int] = _NO_CEILING,
) -> dict[str, Any]:
    """The body as this route receives it: its upstream model, only the extra fields it
    allows (another route of the chain may allow more), the output ceiling the plan
    sends (``ceiling``: none when the request set its own), and usage asked for on
    streams where its contract says the provider can deliver it. The client's body is
    never changed: a copy is made when anything differs."""
    route = rt.route
    foreign = [f for f in extras if f in body and f not in route.extra_fields]
    wants_usage = stream and route.contract.stream_usage == "include_usage"
    if route.upstream_model is None and not foreign and not wants_usage and not ceiling:
        return body
    if foreign:
        routed = {k: v for k, v in body.items() if k not in foreign}
        routed.update(ceiling)
    else:
        routed = {**body, **ceiling}
    if route.upstream_model is not None:
        routed["model"] = route.upstream_model
    if wants_usage:
        routed["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return routed


def _delay(route: Route, retry: int, failure: AttemptFailed) -> float:
    if failure.retry_after is not None and failure.retry_after <= _MAX_RETRY_AFTER_S:
        return failure.retry_after
    base = route.backoff_s * (2 ** max(0, retry - 1))
    return float(base * random.uniform(0.75, 1.25))
