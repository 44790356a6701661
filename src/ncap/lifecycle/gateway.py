"""The request lifecycle, end to end: validate → admit → dispatch → relay → settle.

``Gateway.chat`` turns raw request bytes and an authenticated caller into a ``Reply``
(a complete body, or a stream of SSE bytes). Each concern is its own module; this one
only picks the path (single or fan-out, whole or streamed) and releases what an early
end left reserved. Everything talks to providers and stores through their protocols;
``http.app`` builds the concrete ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import msgspec

from ncap.config import Config
from ncap.errors import InvalidValue, ModelNotFound, NcapError, UnknownParameter
from ncap.lifecycle.admit import Admitter
from ncap.lifecycle.attempt_report import answered_report
from ncap.lifecycle.attempts import Attempts, StreamOpen, for_route
from ncap.lifecycle.evidence import EvidenceFeed, evidence_headers
from ncap.lifecycle.fanout import FanOut
from ncap.lifecycle.idempotency import Idempotency, IdempotentRequest
from ncap.lifecycle.plan import Attempt, Caller, Holds, Plan, Reply, RouteRuntime
from ncap.lifecycle.relay import relay
from ncap.lifecycle.settle import Accounting
from ncap.protocol.chat import ChatCompletionRequest
from ncap.protocol.completions import CompletionRequest
from ncap.protocol.limits import check_message_count
from ncap.protocol.validate import (
    MULTI_CANDIDATE_FIELDS,
    parse_chat_request,
    parse_completion_request,
)
from ncap.providers.base import UpstreamResult
from ncap.stores.ports import IdempotencyStore

__all__ = ["Gateway"]

# a fan-out branch asks for one candidate: the count fields are left out
_CANDIDATE_FIELDS = frozenset({"n", "best_of"})
_Req = TypeVar("_Req", ChatCompletionRequest, CompletionRequest)
_NO_FIELDS: dict[str, int] = {}


class Gateway:
    def __init__(
        self,
        config: Config,
        routes: Mapping[str, RouteRuntime],
        accounting: Accounting,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        idempotency: IdempotencyStore | None = None,
    ) -> None:
        self.config = config
        self.routes = routes
        self.accounting = accounting
        self._admitter = Admitter(
            config,
            accounting,
            grants=accounting.grants,
            metrics=accounting.metrics,
            clock=accounting.clock,
        )
        self._attempts = Attempts(accounting, sleep)
        self._fan_out = FanOut(accounting, self._attempts)
        self._idempotency = None
        if idempotency is not None:
            server = config.server
            self._idempotency = Idempotency(
                idempotency,
                accounting,
                ttl_s=server.idempotency_ttl_s,
                keep_answers=server.idempotency_keep_answers,
            )
        self._extras = {
            alias: frozenset(f for rid in chain for f in routes[rid].route.extra_fields)
            for alias, chain in config.models.items()
        }

    def models_for(self, caller: Caller) -> list[str]:
        workload = self.config.workloads[caller.workload_id]
        return [alias for alias in self.config.models if workload.allows_model(alias)]

    def chat(
        self, raw: bytes, caller: Caller, request_id: str, *, idempotency_key: str | None = None
    ) -> Awaitable[Reply]:
        """The request's lifecycle, as the coroutine to await. The body is parsed now: a
        body refused outright raises here, before anything is awaited."""
        try:
            body, request = self._parse(raw, parse_chat_request)
        except UnknownParameter as exc:
            return self._refusal(exc, raw, caller, request_id)
        chain = self._chain(request.model, caller)
        if idempotency_key is None or self._idempotency is None:
            return self._serve(request_id, caller, request, body, chain)
        n = request.n if isinstance(request.n, int) else None
        stream = request.stream is True
        req = IdempotentRequest(
            idempotency_key, raw, caller, request_id, request.model, chain[0], stream, n
        )
        return self._idempotency.run(
            req, lambda: self._serve(request_id, caller, request, body, chain)
        )

    def completions(self, raw: bytes, caller: Caller, request_id: str) -> Awaitable[Reply]:
        """The legacy ``/v1/completions``: the same lifecycle, with ``best_of`` as the
        candidate count (``ncap.lifecycle.admit``), on routes that serve the endpoint."""
        try:
            body, request = self._parse(raw, parse_completion_request)
        except UnknownParameter as exc:
            return self._refusal(exc, raw, caller, request_id)
        _one_prompt(request)
        chain = _legacy_routes(self._chain(request.model, caller))
        return self._serve(request_id, caller, request, body, chain)

    async def _serve(
        self,
        request_id: str,
        caller: Caller,
        request: ChatCompletionRequest | CompletionRequest,
        body: dict[str, Any],
        chain: list[RouteRuntime],
    ) -> Reply:
        plan, holds = await self._admitter.admit(request_id, caller, request, body, chain)
        try:
            return await self._dispatch(plan, holds, body)
        except BaseException as exc:
            await self.accounting.abandon(holds)
            if isinstance(exc, NcapError) and not exc.request_headers:
                exc.request_headers = plan.headers(plan.usable_routes[0].id)
            raise

    def _parse(
        self, raw: bytes, parse: Callable[..., tuple[dict[str, Any], _Req]]
    ) -> tuple[dict[str, Any], _Req]:
        """The validated body (chat or legacy)."""
        body, request = parse(raw, extra_fields=self._extra_fields)
        if isinstance(request, ChatCompletionRequest):  # a legacy prompt has no messages
            check_message_count(request.messages, self.config.limits.max_messages)
        return body, request

    def _refusal(
        self, exc: UnknownParameter, raw: bytes, caller: Caller, request_id: str
    ) -> Awaitable[Reply]:
        """An unknown field: raised at once, or, for a multi-candidate field the gateway
        refuses, the coroutine that records the denial row and then raises it."""
        field = exc.param
        if field is None or field not in MULTI_CANDIDATE_FIELDS:
            raise exc
        return self._deny_field(exc, field, raw, caller, request_id)

    async def _deny_field(
        self, exc: UnknownParameter, field: str, raw: bytes, caller: Caller, request_id: str
    ) -> Reply:
        body = msgspec.json.decode(raw)  # decoded once already: a JSON object
        chain = self._allowed_chain(body.get("model"), caller)
        await self.accounting.deny_field(request_id, caller, body, field, chain)
        raise exc

    def _allowed_chain(self, model: object, caller: Caller) -> list[RouteRuntime]:
        """The alias's chain when the caller may use it, else none (nothing recorded)."""
        if not isinstance(model, str):
            return []
        try:
            return self._chain(model, caller)
        except ModelNotFound:
            return []

    def _dispatch(self, plan: Plan, holds: Holds, body: dict[str, Any]) -> Awaitable[Reply]:
        """The path's coroutine, which the caller awaits (no coroutine of its own)."""
        if plan.emulated:
            rt = plan.usable_routes[0]
            routed = self._routed(plan, body, rt)
            branch = {f: v for f, v in routed.items() if f not in _CANDIDATE_FIELDS}
            fan_out = self._fan_out.stream if plan.stream else self._fan_out.complete
            return fan_out(plan, holds, branch, rt)
        if plan.stream:
            return self._stream(plan, holds, body)
        return self._complete(plan, holds, body)

    def _routed(self, plan: Plan, body: dict[str, Any], rt: RouteRuntime) -> dict[str, Any]:
        extras = self._extra_fields(plan.alias)
        return for_route(body, rt, extras, stream=plan.stream, ceiling=_sent_ceiling(plan))

    def _extra_fields(self, model: object) -> frozenset[str]:
        return self._extras.get(model, frozenset()) if isinstance(model, str) else frozenset()

    def _chain(self, alias: str, caller: Caller) -> list[RouteRuntime]:
        route_ids = self.config.models.get(alias)
        workload = self.config.workloads[caller.workload_id]
        if route_ids is None or not workload.allows_model(alias):
            shown = alias if len(alias) <= 128 else alias[:128] + "…"  # a client's text
            raise ModelNotFound(
                f"The model `{shown}` does not exist or you do not have access to it.",
                param="model",
            )
        return [self.routes[rid] for rid in route_ids]

    async def _complete(self, plan: Plan, holds: Holds, body: dict[str, Any]) -> Reply:
        def call(attempt: Attempt) -> Awaitable[UpstreamResult]:
            return self._attempts.call(attempt, self._routed(plan, body, attempt.route))

        attempt, result = await self._attempts.first_answer(plan, holds, call)
        evidence = None
        if len(result.summary.choices) > 1:
            feed = EvidenceFeed()
            feed.body(result.body)
            evidence = feed.finish()
        headers = plan.headers(attempt.route.id)
        headers["x-ncap-candidates-returned"] = str(len(result.summary.choices))
        headers.update(evidence_headers(evidence))
        headers["content-type"] = "application/json"
        # settled while the answer is on its way: the attempt's reserved row is already
        # durable, so a crash in between leaves it for recovery (gateway_lost)
        self.accounting.answered_beside([(attempt, answered_report(result, evidence))])
        return Reply(200, headers, result.body, settling=True)

    async def _stream(self, plan: Plan, holds: Holds, body: dict[str, Any]) -> Reply:
        def open_(attempt: Attempt) -> Awaitable[StreamOpen]:
            return self._attempts.open(attempt, self._routed(plan, body, attempt.route))

        attempt, opened = await self._attempts.first_answer(plan, holds, open_)
        headers = plan.headers(attempt.route.id)
        headers.update({"content-type": "text/event-stream", "cache-control": "no-cache"})
        return Reply(200, headers, stream=relay(self.accounting, attempt, opened))


def _sent_ceiling(plan: Plan) -> dict[str, int]:
    """The output ceiling every attempt sends when the request set none, so that the
    reservation is real (for the legacy endpoint the admitter already made it OpenAI's
    default of 16, within policy): added to each route's copy of the body, never
    written into the client's."""
    if plan.decision.ceiling_from_request:
        return _NO_FIELDS
    field = "max_tokens" if plan.kind == "completions" else "max_completion_tokens"
    return {field: plan.decision.per_candidate_ceiling}


def _one_prompt(request: CompletionRequest) -> None:
    """One prompt per request: a batch of k prompts is k × n completions, which the
    candidate policy and the per-request reservation do not describe."""
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
        raise InvalidValue(
            "Invalid value for 'prompt': the gateway takes one prompt per request (a "
            "string, one array of token ids, or an array holding one of them); send a "
            "batch as separate requests.",
            param="prompt",
        )


def _legacy_routes(chain: list[RouteRuntime]) -> list[RouteRuntime]:
    """The routes that serve ``/v1/completions`` (by their provider's capabilities)."""
    primary = chain[0].capabilities
    if not primary.serves("completions"):
        raise InvalidValue(
            f"This model's route is {primary.title} route, which serves /v1/chat/completions "
            "only, not the legacy /v1/completions.",
            param="model",
        )
    return [rt for rt in chain if rt.capabilities.serves("completions")]
