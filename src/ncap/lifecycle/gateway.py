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
from typing import Any

import msgspec

from ncap.config import Config
from ncap.errors import ModelNotFound, UnknownParameter
from ncap.lifecycle.admit import Admitter
from ncap.lifecycle.attempts import Attempts, StreamOpen, for_route
from ncap.lifecycle.fanout import FanOut
from ncap.lifecycle.plan import Attempt, Caller, Plan, Reply, RouteRuntime
from ncap.lifecycle.relay import relay
from ncap.lifecycle.reports import answered_report
from ncap.lifecycle.settle import Accounting
from ncap.protocol.chat import ChatCompletionRequest
from ncap.protocol.limits import check_message_count
from ncap.protocol.validate import MULTI_CANDIDATE_FIELDS, parse_chat_request
from ncap.providers.base import UpstreamResult
from ncap.stores.base import Hold

__all__ = ["Gateway"]


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
        self._admitter = Admitter(config, accounting)
        self._attempts = Attempts(accounting, sleep)
        self._fan_out = FanOut(accounting, self._attempts)
        self._extras = {
            alias: frozenset(f for rid in chain for f in routes[rid].route.extra_fields)
            for alias, chain in config.models.items()
        }

    def models_for(self, caller: Caller) -> list[str]:
        workload = self.config.workloads[caller.workload_id]
        return [alias for alias in self.config.models if workload.allows_model(alias)]

    async def chat(self, raw: bytes, caller: Caller, request_id: str) -> Reply:
        body, request = await self._parse(raw, caller, request_id)
        chain = self._chain(request.model, caller)
        plan, holds = await self._admitter.admit(request_id, caller, request, body, chain)
        try:
            if not plan.decision.ceiling_from_request:
                # an explicit output ceiling on every attempt, so the reservation is real
                body["max_completion_tokens"] = plan.decision.per_candidate_ceiling
            return await self._dispatch(plan, holds, body)
        except BaseException:
            await self.accounting.abandon(holds)
            raise

    async def _parse(
        self, raw: bytes, caller: Caller, request_id: str
    ) -> tuple[dict[str, Any], ChatCompletionRequest]:
        """The validated body; a refused multi-candidate field is also a denial row."""
        try:
            body, request = parse_chat_request(raw, extra_fields=self._extra_fields)
        except UnknownParameter as exc:
            if exc.param in MULTI_CANDIDATE_FIELDS:
                body = msgspec.json.decode(raw)  # decoded once already: a JSON object
                chain = self._allowed_chain(body.get("model"), caller)
                await self._admitter.refuse_field(request_id, caller, body, exc.param, chain)
            raise
        check_message_count(request.messages, self.config.limits.max_messages)
        return body, request

    def _allowed_chain(self, model: object, caller: Caller) -> list[RouteRuntime]:
        """The alias's chain when the caller may use it, else none (nothing recorded)."""
        if not isinstance(model, str):
            return []
        try:
            return self._chain(model, caller)
        except ModelNotFound:
            return []

    async def _dispatch(self, plan: Plan, holds: dict[int, Hold], body: dict[str, Any]) -> Reply:
        if plan.emulated:
            rt = plan.usable_routes[0]
            branch = {f: v for f, v in self._routed(plan, body, rt).items() if f != "n"}
            fan_out = self._fan_out.stream if plan.stream else self._fan_out.complete
            return await fan_out(plan, holds, branch, rt)
        if plan.stream:
            return await self._stream(plan, holds, body)
        return await self._complete(plan, holds, body)

    def _routed(self, plan: Plan, body: dict[str, Any], rt: RouteRuntime) -> dict[str, Any]:
        return for_route(body, rt, self._extra_fields(plan.alias), stream=plan.stream)

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

    async def _complete(self, plan: Plan, holds: dict[int, Hold], body: dict[str, Any]) -> Reply:
        async def call(attempt: Attempt) -> UpstreamResult:
            return await self._attempts.call(attempt, self._routed(plan, body, attempt.route))

        attempt, result = await self._attempts.first_answer(plan, holds, call)
        headers = plan.headers(attempt.route.id)
        headers["x-ncap-candidates-returned"] = str(len(result.summary.choices))
        headers["content-type"] = "application/json"
        # settled while the answer is on its way: the attempt's reserved row is already
        # durable, so a crash in between leaves it for recovery (gateway_lost)
        settle = self.accounting.answered(attempt, answered_report(result))
        return Reply(200, headers, result.body, after=settle)

    async def _stream(self, plan: Plan, holds: dict[int, Hold], body: dict[str, Any]) -> Reply:
        async def open_(attempt: Attempt) -> StreamOpen:
            return await self._attempts.open(attempt, self._routed(plan, body, attempt.route))

        attempt, opened = await self._attempts.first_answer(plan, holds, open_)
        headers = plan.headers(attempt.route.id)
        headers.update({"content-type": "text/event-stream", "cache-control": "no-cache"})
        return Reply(200, headers, stream=relay(self.accounting, attempt, opened))
