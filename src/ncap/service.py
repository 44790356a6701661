"""The request lifecycle: validate → policy → reserve → dispatch (retry/fallback) → settle.

``Gateway.chat`` turns raw request bytes and an authenticated caller into a ``Reply``
(a complete body, or a stream of SSE bytes). Everything here talks to providers and
stores through their protocols; ``http.app`` builds the concrete ones.

Attempts: each try of a route (first call, retry, fallback) is an attempt with its own
ledger event. A streamed attempt may only be retried before its first event reached the
client; after that a failure ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from ncap.accounting import Accounting, AttemptReport, Caller, Plan
from ncap.config import Config, Route
from ncap.errors import (
    InvalidRequest,
    ModelNotFound,
    NcapError,
    Overloaded,
    RateLimited,
    SlowDown,
    UpstreamError,
    UpstreamTimeout,
)
from ncap.protocol.responses import ErrorEnvelope, ResponseSummary
from ncap.protocol.validate import parse_chat_request
from ncap.providers.base import AttemptFailed, Provider, UpstreamResult
from ncap.streaming.sse import DONE, StreamEvent, encode_event

__all__ = ["Gateway", "Reply", "RouteRuntime"]

T = TypeVar("T")
_encode = msgspec.json.Encoder().encode
_error_decoder = msgspec.json.Decoder(ErrorEnvelope)
_MAX_RETRY_AFTER_S = 60.0


@dataclass(frozen=True, slots=True)
class RouteRuntime:
    id: str
    route: Route
    provider: Provider


@dataclass(slots=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    # bookkeeping the http layer awaits once the body is written
    after: Coroutine[Any, Any, None] | None = None


@dataclass(slots=True)
class _StreamOpen:
    """An upstream stream whose first event has arrived (so the attempt succeeded)."""

    stack: AsyncExitStack
    provider_request_id: str | None
    events: AsyncIterator[StreamEvent]
    first: StreamEvent | None
    started: float


@dataclass(slots=True)
class _Tally:
    """What a relayed stream said about itself, per choice ``index``."""

    provider_request_id: str | None = None
    model: str = ""
    finish: dict[int, str | None] = field(default_factory=dict)
    usage: Any = None
    done: bool = False

    def add(self, summary: ResponseSummary) -> None:
        if self.provider_request_id is None:
            self.provider_request_id = summary.id
        for choice in summary.choices:
            index = choice.index if choice.index is not None else 0
            if choice.finish_reason is not None or index not in self.finish:
                self.finish[index] = choice.finish_reason
        if summary.usage is not None:
            self.usage = summary.usage


class Gateway:
    def __init__(
        self,
        config: Config,
        routes: Mapping[str, RouteRuntime],
        accounting: Accounting,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.config = config
        self.routes = routes
        self.accounting = accounting
        self._sleep = sleep
        self._extras = {
            alias: frozenset(f for rid in chain for f in routes[rid].route.extra_fields)
            for alias, chain in config.models.items()
        }

    def models_for(self, caller: Caller) -> list[str]:
        workload = self.config.workloads[caller.workload_id]
        return [alias for alias in self.config.models if workload.allows_model(alias)]

    async def chat(self, raw: bytes, caller: Caller, request_id: str) -> Reply:
        body, request = parse_chat_request(raw, extra_fields=self._extra_fields)
        chain = self._chain(request.model, caller)
        plan = await self.accounting.admit(request_id, caller, request.model, body, chain)
        try:
            self._prepare_body(body, plan)
            if plan.emulated and plan.stream:
                return await self._fan_out_stream(plan, body, chain[0])
            if plan.stream:
                return await self._stream(plan, body)
            if plan.emulated:
                return await self._fan_out(plan, body, chain[0])
            return await self._complete(plan, body)
        except BaseException:
            await self.accounting.abandon(plan)
            raise

    def _routed(self, plan: Plan, body: dict[str, Any], rt: RouteRuntime) -> dict[str, Any]:
        return _for_route(body, rt, self._extra_fields(plan.alias))

    def _extra_fields(self, model: object) -> frozenset[str]:
        return self._extras.get(model, frozenset()) if isinstance(model, str) else frozenset()

    def _chain(self, alias: str, caller: Caller) -> list[RouteRuntime]:
        route_ids = self.config.models.get(alias)
        workload = self.config.workloads[caller.workload_id]
        if route_ids is None or not workload.allows_model(alias):
            raise ModelNotFound(
                f"The model `{alias}` does not exist or you do not have access to it.",
                param="model",
            )
        return [self.routes[rid] for rid in route_ids]

    @staticmethod
    def _prepare_body(body: dict[str, Any], plan: Plan) -> None:
        """An explicit output ceiling on every attempt, so the reservation is real."""
        if not plan.ceiling_from_request:
            body["max_completion_tokens"] = plan.per_candidate_ceiling

    # -- non-streaming ---------------------------------------------------------------

    async def _complete(self, plan: Plan, body: dict[str, Any]) -> Reply:
        async def attempt(rt: RouteRuntime, number: int) -> tuple[UpstreamResult, float]:
            return await self._call(plan, rt, number, self._routed(plan, body, rt))

        rt, (result, started) = await self._attempts(plan, attempt)
        report = _outcome_of(result.summary, result.provider_request_id)
        headers = plan.headers(rt.id)
        headers["x-ncap-candidates-returned"] = str(len(result.summary.choices))
        headers["content-type"] = "application/json"
        # settled while the answer is on its way: the attempt's reserved row is already
        # durable, so a crash in between leaves it for recovery (gateway_lost)
        settle = self.accounting.attempt_answered(plan, plan.attempts, rt, report, started)
        return Reply(200, headers, result.body, after=settle)

    # -- fan-out emulation -----------------------------------------------------------

    async def _fan_out(self, plan: Plan, body: dict[str, Any], rt: RouteRuntime) -> Reply:
        """n by k = n single-candidate requests on a route without native n: every
        branch is an attempt with its own ledger row and hold (each prefill is paid and
        recorded), all or nothing, merged in branch order."""
        k, branch_body = await self._start_branches(plan, body, rt)
        results = await asyncio.gather(
            *(self._call(plan, rt, number, branch_body) for number in range(1, k + 1)),
            return_exceptions=True,
        )
        answered = [
            (number, r) for number, r in enumerate(results, 1) if not isinstance(r, BaseException)
        ]
        settle = self._settle_branches(plan, rt, answered)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:  # all or nothing: the answered branches are settled (they were paid)
            await settle
            first = failures[0]
            raise _client_error(first) if isinstance(first, AttemptFailed) else first
        merged, returned = _merge_branches(plan.request_id, [r for _, (r, _) in answered])
        headers = plan.headers(rt.id)
        headers["x-ncap-candidates-returned"] = str(returned)
        headers["content-type"] = "application/json"
        return Reply(200, headers, merged, after=settle)

    async def _start_branches(
        self, plan: Plan, body: dict[str, Any], rt: RouteRuntime
    ) -> tuple[int, dict[str, Any]]:
        """The single-candidate body and the k branches' reserved rows, written together
        so that they share one group commit."""
        k = plan.decision.effective
        routed = self._routed(plan, body, rt)
        plan.attempts = k
        await asyncio.gather(
            *(self.accounting.attempt_started(plan, n, rt) for n in range(1, k + 1))
        )
        return k, {f: v for f, v in routed.items() if f != "n"}

    async def _call(
        self, plan: Plan, rt: RouteRuntime, number: int, body: dict[str, Any]
    ) -> tuple[UpstreamResult, float]:
        """One non-streamed attempt; a failure is recorded on its row, then raised."""
        started = time.monotonic()
        try:
            result = await rt.provider.complete(body, timeout=rt.route.timeout_s)
        except (AttemptFailed, NcapError) as exc:
            await self.accounting.attempt_failed(plan, number, rt, _as_failure(exc), started)
            raise
        return result, started

    async def _settle_branches(
        self,
        plan: Plan,
        rt: RouteRuntime,
        answered: list[tuple[int, tuple[UpstreamResult, float]]],
    ) -> None:
        for number, (result, started) in answered:
            report = _outcome_of(result.summary, result.provider_request_id)
            await self.accounting.attempt_answered(plan, number, rt, report, started)

    async def _fan_out_stream(self, plan: Plan, body: dict[str, Any], rt: RouteRuntime) -> Reply:
        """The streamed fan-out: k single-candidate streams opened together (all or
        nothing before the first byte), relayed as one stream with each branch's
        choice at its own ``index``, usage summed at the end."""
        k, branch_body = await self._start_branches(plan, body, rt)
        opened = await asyncio.gather(
            *(self._open(plan, rt, n, branch_body) for n in range(1, k + 1)),
            return_exceptions=True,
        )
        branches = [(n, o) for n, o in enumerate(opened, 1) if isinstance(o, _StreamOpen)]
        failures = [o for o in opened if isinstance(o, BaseException)]
        if failures:
            await self._abort_branches(plan, rt, branches)
            first = failures[0]
            raise _client_error(first) if isinstance(first, AttemptFailed) else first
        headers = plan.headers(rt.id)
        headers.update({"content-type": "text/event-stream", "cache-control": "no-cache"})
        return Reply(200, headers, stream=self._relay_branches(plan, rt, branches))

    async def _open(
        self, plan: Plan, rt: RouteRuntime, number: int, body: dict[str, Any]
    ) -> _StreamOpen:
        """One streamed attempt up to its first event; a failure is recorded, then raised."""
        started = time.monotonic()
        try:
            return await self._open_stream(rt, body, started)
        except (AttemptFailed, NcapError) as exc:
            await self.accounting.attempt_failed(plan, number, rt, _as_failure(exc), started)
            raise

    async def _abort_branches(
        self, plan: Plan, rt: RouteRuntime, branches: list[tuple[int, _StreamOpen]]
    ) -> None:
        """Branches that opened when another did not: closed, and held as cut streams
        (they may have started generating)."""
        for number, branch in branches:
            await branch.stack.aclose()
            report = _stream_report(_Tally(branch.provider_request_id), "fan_out_aborted")
            await self.accounting.stream_finished(plan, number, rt, report, branch.started)

    async def _relay_branches(
        self, plan: Plan, rt: RouteRuntime, branches: list[tuple[int, _StreamOpen]]
    ) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[tuple[int, StreamEvent | BaseException | None]] = asyncio.Queue()
        tallies = {n: _Tally(provider_request_id=b.provider_request_id) for n, b in branches}
        pumps = [asyncio.create_task(_pump(n, b, queue)) for n, b in branches]
        cut: str | None = "client_disconnect"
        try:
            live = len(branches)
            while live:
                number, item = await queue.get()
                if item is None:
                    live -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                out = _rebase(item, tallies[number], number - 1, plan.request_id)
                if out:
                    yield out
            cut = None if all(t.done for t in tallies.values()) else "stream_truncated"
            usage = _summed_usage(tallies.values())
            if cut is None and plan.client_wants_usage and usage is not None:
                model = next((t.model for t in tallies.values() if t.model), plan.alias)
                yield _usage_chunk(plan.request_id, model, usage)
            yield _error_event(UpstreamError("An upstream stream ended early.")) if cut else DONE
        except (AttemptFailed, NcapError):
            cut = "upstream_reset"
            yield _error_event(UpstreamError("An upstream stream failed mid-way."))
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            settle = self._settle_streams(plan, rt, branches, tallies, cut)
            await asyncio.shield(settle)

    async def _settle_streams(
        self,
        plan: Plan,
        rt: RouteRuntime,
        branches: list[tuple[int, _StreamOpen]],
        tallies: dict[int, _Tally],
        cut: str | None,
    ) -> None:
        for number, branch in branches:
            await branch.stack.aclose()
            tally = tallies[number]
            report = _stream_report(tally, None if tally.done else (cut or "stream_truncated"))
            await self.accounting.stream_finished(plan, number, rt, report, branch.started)

    # -- streaming -------------------------------------------------------------------

    async def _stream(self, plan: Plan, body: dict[str, Any]) -> Reply:
        async def attempt(rt: RouteRuntime, number: int) -> _StreamOpen:
            return await self._open(plan, rt, number, self._routed(plan, body, rt))

        rt, opened = await self._attempts(plan, attempt)
        headers = plan.headers(rt.id)
        headers.update({"content-type": "text/event-stream", "cache-control": "no-cache"})
        return Reply(200, headers, stream=self._relay(plan, rt, opened))

    async def _open_stream(
        self, rt: RouteRuntime, body: Mapping[str, Any], started: float
    ) -> _StreamOpen:
        stack = AsyncExitStack()
        try:
            rid, events = await stack.enter_async_context(
                rt.provider.stream(body, timeout=rt.route.timeout_s)
            )
            first = await anext(events, None)
        except BaseException:
            await stack.aclose()
            raise
        return _StreamOpen(stack, rid, events, first, started)

    async def _relay(
        self, plan: Plan, rt: RouteRuntime, opened: _StreamOpen
    ) -> AsyncIterator[bytes]:
        """Forward each upstream event as it arrives; settle when the stream ends or is
        cut (a cut stream stays pending with its reservation held)."""
        tally = _Tally(provider_request_id=opened.provider_request_id)
        number, started = plan.attempts, opened.started
        cut: str | None = "client_disconnect"
        try:
            async with opened.stack:
                event = opened.first
                while event is not None:
                    out = self._take(event, tally, plan)
                    if out:
                        yield out
                    if tally.done:
                        break
                    event = await anext(opened.events, None)
                cut = None if tally.done else "stream_truncated"
                if cut:
                    yield _error_event(UpstreamError("The upstream stream ended early."))
        except AttemptFailed as exc:
            cut = "upstream_reset" if exc.kind != "protocol" else "malformed_stream"
            yield _error_event(UpstreamError("The upstream stream failed mid-way."))
        except NcapError as exc:  # a local provider's own error mid-stream
            cut = "upstream_error"
            yield _error_event(exc)
        finally:
            report = _stream_report(tally, cut)
            finished = self.accounting.stream_finished(plan, number, rt, report, started)
            await asyncio.shield(finished)

    @staticmethod
    def _take(event: StreamEvent, tally: _Tally, plan: Plan) -> bytes | None:
        if event.summary is None:
            tally.done = event.done or event.raw == DONE
            return event.raw
        tally.add(event.summary)
        usage_only = event.summary.usage is not None and not event.summary.choices
        if usage_only and not plan.client_wants_usage:
            return None  # the usage chunk the gateway asked for on its own behalf
        return event.raw

    # -- retries and fallbacks -------------------------------------------------------

    async def _attempts(
        self, plan: Plan, call: Callable[[RouteRuntime, int], Awaitable[T]]
    ) -> tuple[RouteRuntime, T]:
        """Try the chain in order, each route up to 1 + retries times, with exponential
        backoff and jitter, honouring Retry-After. Only retryable failures move on."""
        last: AttemptFailed | None = None
        for rt in plan.usable_routes:
            for i in range(rt.route.retries + 1):
                if i > 0 and last is not None:  # a fallback is tried at once
                    await self._sleep(_delay(rt.route, i, last))
                plan.attempts += 1
                await self.accounting.attempt_started(plan, plan.attempts, rt)
                try:
                    return rt, await call(rt, plan.attempts)
                except AttemptFailed as exc:
                    last = exc
                    if not exc.retryable:
                        raise _client_error(exc) from None
        assert last is not None
        raise _client_error(last) from None


async def _pump(
    number: int,
    branch: _StreamOpen,
    queue: asyncio.Queue[tuple[int, StreamEvent | BaseException | None]],
) -> None:
    """One branch's events into the shared queue; None when it ends, or its failure."""
    try:
        event = branch.first
        while event is not None:
            await queue.put((number, event))
            event = await anext(branch.events, None)
    except (AttemptFailed, NcapError) as exc:
        await queue.put((number, exc))
        return
    await queue.put((number, None))


def _rebase(event: StreamEvent, tally: _Tally, index: int, request_id: str) -> bytes | None:
    """A branch's chunk as the merged stream's: its choice moved to the branch's index;
    its own usage chunk and ``[DONE]`` kept back (the merged stream ends once)."""
    if event.summary is None:
        tally.done = tally.done or event.done or event.raw == DONE
        return None
    tally.add(event.summary)
    if not event.summary.choices:
        return None
    chunk = msgspec.json.decode(_data_of(event.raw))
    tally.model = tally.model or str(chunk.get("model") or "")
    chunk["id"] = f"chatcmpl-{request_id}"
    chunk.pop("usage", None)
    for choice in chunk.get("choices") or []:
        choice["index"] = index
    return encode_event(_encode(chunk))


def _data_of(raw: bytes) -> bytes:
    return b"\n".join(line[5:].lstrip() for line in raw.splitlines() if line.startswith(b"data:"))


def _summed_usage(tallies: Iterable[_Tally]) -> dict[str, int] | None:
    usages = [t.usage for t in tallies]
    if any(u is None or u.prompt_tokens is None or u.completion_tokens is None for u in usages):
        return None
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _usage_chunk(request_id: str, model: str, usage: dict[str, int]) -> bytes:
    chunk = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage,
    }
    return encode_event(_encode(chunk))


def _merge_branches(request_id: str, results: list[UpstreamResult]) -> tuple[bytes, int]:
    """One chat.completion from k single-candidate ones: choices re-indexed in branch
    order, usage summed (every branch's prompt was paid)."""
    bodies = [msgspec.json.decode(r.body) for r in results]
    choices = [choice for b in bodies for choice in b.get("choices") or []]
    for index, choice in enumerate(choices):
        choice["index"] = index
    merged = {**bodies[0], "id": f"chatcmpl-{request_id}", "choices": choices}
    usages = [b.get("usage") for b in bodies]
    if all(isinstance(u, dict) for u in usages):
        merged["usage"] = {
            key: sum(int(u.get(key) or 0) for u in usages)
            for key in ("prompt_tokens", "completion_tokens", "total_tokens")
        }
    else:
        merged.pop("usage", None)  # not all branches reported: the total is unknown
    return _encode(merged), len(choices)


def _for_route(body: dict[str, Any], rt: RouteRuntime, extras: frozenset[str]) -> dict[str, Any]:
    """The body as this route receives it: its upstream model, only the extra fields it
    allows (another route of the chain may allow more), and usage asked for on streams
    where its contract says the provider can deliver it."""
    route = rt.route
    foreign = [f for f in extras if f in body and f not in route.extra_fields]
    wants_usage = body.get("stream") is True and route.contract.stream_usage == "include_usage"
    if route.upstream_model is None and not foreign and not wants_usage:
        return body
    routed = {k: v for k, v in body.items() if k not in foreign}
    if route.upstream_model is not None:
        routed["model"] = route.upstream_model
    if wants_usage:
        routed["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return routed


def _as_failure(exc: AttemptFailed | NcapError) -> AttemptFailed:
    """A provider's own refusal (the local engine's queue full, a context overflow) is an
    attempt that generated nothing: recorded as such, then raised to the client as is."""
    if isinstance(exc, AttemptFailed):
        return exc
    return AttemptFailed("status", exc.status, dispatched=False, detail=str(exc.code))


def _delay(route: Route, retry: int, failure: AttemptFailed) -> float:
    if failure.retry_after is not None and failure.retry_after <= _MAX_RETRY_AFTER_S:
        return failure.retry_after
    base = route.backoff_s * (2 ** max(0, retry - 1))
    return float(base * random.uniform(0.75, 1.25))


def _outcome_of(summary: ResponseSummary, provider_request_id: str | None) -> AttemptReport:
    finish: dict[str, int] = {}
    for choice in summary.choices:
        reason = choice.finish_reason or "none"
        finish[reason] = finish.get(reason, 0) + 1
    return AttemptReport(
        provider_request_id=provider_request_id or summary.id,
        returned=len(summary.choices),
        finish_reasons=finish,
        usage=summary.usage,
        stream=False,
        cut=None,
    )


def _stream_report(tally: _Tally, cut: str | None) -> AttemptReport:
    finish: dict[str, int] = {}
    for reason in tally.finish.values():
        key = reason or "none"
        finish[key] = finish.get(key, 0) + 1
    return AttemptReport(
        provider_request_id=tally.provider_request_id,
        returned=len(tally.finish),
        finish_reasons=finish,
        usage=tally.usage,
        stream=True,
        cut=cut,
    )


def _error_event(error: NcapError) -> bytes:
    return encode_event(_encode(error.envelope()))


def _client_error(failure: AttemptFailed) -> NcapError:
    """The error the client sees once retries and fallbacks are spent (SPEC §3.2)."""
    if failure.kind == "timeout":
        return UpstreamTimeout("The upstream did not answer in time.")
    if failure.kind in ("connection", "protocol") or failure.status is None:
        return UpstreamError("The upstream failed to answer.")
    upstream_code = _upstream_code(failure.body)
    if failure.status == 429:
        if upstream_code == "rate_limit_exceeded":
            return RateLimited(
                "The upstream rate limit was reached.", retry_after=failure.retry_after
            )
        return SlowDown(
            "Your request rate increased too quickly upstream. Please back off.",
            retry_after=failure.retry_after,
        )
    if failure.status == 503:
        return Overloaded(
            "The model is temporarily overloaded. Please retry your request after a brief delay.",
            retry_after=failure.retry_after,
        )
    if failure.status in (400, 404, 422):
        return _relayed_client_error(failure)
    return UpstreamError(f"The upstream answered with status {failure.status}.")


def _upstream_code(body: bytes) -> str | None:
    try:
        return _error_decoder.decode(body).error.code
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _relayed_client_error(failure: AttemptFailed) -> NcapError:
    """An upstream's own 4xx about the request: keep its message, code and param."""
    try:
        err = _error_decoder.decode(failure.body).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return UpstreamError(f"The upstream rejected the request (status {failure.status}).")
    relayed = InvalidRequest(f"Upstream: {err.message}", param=err.param, code=err.code)
    return relayed
