"""Client ``Idempotency-Key``: a retried request is not dispatched twice.

The one hook before admission (``Gateway.chat``). The key is scoped to the workload and
the API key that sent it, and hashed (``<workload>:<key id>:<sha256(key)>``, without the
key id in keyless mode, so no
client text reaches the store): another key of the same workload reusing ``order-42``
neither learns of the first request, nor blocks it, nor is replayed its answer. The record
beside it names the first request, a hash of its canonical body (sorted-key JSON) and
whether it was a stream. The record lives in the budget store
(``stores.ports.IdempotencyStore``), so it reaches every replica the budgets reach, and
expires after ``server.idempotency_ttl_s``.

- First use: claimed atomically; the request runs as usual. Its answer marks the
  record done (with the answer itself only if ``server.idempotency_keep_answers``; kept
  in the store alone, for the TTL, never in the ledger or logs). If it fails, the claim
  is withdrawn: the client got an error, so its retry may run.
- Same key, same body, first still running: wait for it (polling the store, which is
  what another replica can see), then as below.
- Same key, same body, first done: its answer (``x-ncap-idempotent-replay`` names the
  first request) when kept, else 409 ``idempotency_key_reused`` naming it.
- Same key, another body: 400 ``idempotency_key_mismatch``.
- Streams: never replayed. A repeat of a stream, running or done, gets 409 at once
  (a stream in progress cannot be joined half way, and keeping a whole stream's bytes
  is not worth it); a stream that failed before its first byte withdraws its claim.
- An unfinished record expires after ``IN_FLIGHT_S`` (10 min) at most, so a gateway
  that died mid-request leaves repeats waiting that long at worst, not the whole TTL.

Each repeat still writes its own ``denied`` ledger row (no spend), ``policy_reason`` =
``idempotent_replay`` or the error's code, ``denied_by = idempotency_key``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from ncap.domain.events import LedgerEvent
from ncap.errors import IdempotencyKeyMismatch, IdempotencyKeyReused, InvalidValue, NcapError
from ncap.lifecycle.plan import Caller, Reply, RouteRuntime
from ncap.lifecycle.settle import Accounting
from ncap.stores.ports import IdempotencyStore

__all__ = ["Idempotency", "IdempotentRequest"]

log = logging.getLogger("ncap.lifecycle")
MAX_KEY_LENGTH = 255
# an unfinished record expires after this (or the TTL, if shorter): a gateway that
# died mid-request must not make repeats wait for the whole TTL, and a repeat waits at
# most this long
IN_FLIGHT_S = 600.0
# answer headers a replay repeats (the route's x-ncap-* and the content type)
_REPLAYED = ("content-type", "x-ncap-")


class _Answer(msgspec.Struct, frozen=True):
    status: int
    headers: dict[str, str]
    body: bytes


class _Record(msgspec.Struct, frozen=True):
    body_hash: str
    request_id: str
    stream: bool
    done: bool = False
    answer: _Answer | None = None


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(_Record).decode
_canonical = msgspec.json.Encoder(order="sorted").encode


@dataclass(frozen=True, slots=True)
class IdempotentRequest:
    """What the hook needs of one request: its key, body and first route."""

    key: str
    raw: bytes
    caller: Caller
    request_id: str
    alias: str
    primary: RouteRuntime
    stream: bool
    requested: int | None


class Idempotency:
    def __init__(
        self,
        store: IdempotencyStore,
        accounting: Accounting,
        *,
        ttl_s: float,
        keep_answers: bool,
        poll_s: float = 0.05,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._store = store
        self._accounting = accounting
        self._ttl_s = ttl_s
        self._keep_answers = keep_answers
        self._poll_s = poll_s
        self._sleep = sleep

    async def run(self, req: IdempotentRequest, dispatch: Callable[[], Awaitable[Reply]]) -> Reply:
        """The first request with its key is dispatched; a repeat gets what it is owed."""
        if not req.key or len(req.key) > MAX_KEY_LENGTH:
            raise InvalidValue(
                f"Idempotency-Key must be 1 to {MAX_KEY_LENGTH} characters.",
                param="Idempotency-Key",
            )
        digest = hashlib.sha256(req.key.encode()).hexdigest()
        by = f"{req.caller.key_id}:" if req.caller.key_id else ""  # keyless: the workload
        scoped = f"{req.caller.workload_id}:{by}{digest}"
        mine = _Record(_body_hash(req.raw), req.request_id, req.stream)
        claim = _encode(mine)
        first = await self._claim_or_wait(scoped, claim, mine)
        if first is not None:
            return await self._repeat(req, mine, first)
        try:
            reply = await dispatch()
        except BaseException:
            await self._withdraw(scoped, claim)
            raise
        await self._finish(scoped, claim, self._done(mine, reply))
        return reply

    async def _finish(self, scoped: str, claim: bytes, done: bytes) -> None:
        """The answer is the client's whatever happens here: a store error only leaves
        the unfinished record to expire (``IN_FLIGHT_S``), and the answer's settlement
        still runs."""
        try:
            await self._store.swap(scoped, claim, done, self._ttl_s)
        except Exception as exc:
            log.warning("idempotency key not marked done: %s", type(exc).__name__)

    async def _claim_or_wait(self, scoped: str, claim: bytes, mine: _Record) -> _Record | None:
        """None once this request holds the key; else the first request's record, done
        (or a stream, or another body: no reason to wait for those)."""
        in_flight_s = min(self._ttl_s, IN_FLIGHT_S)
        deadline = time.monotonic() + in_flight_s
        while True:
            found = await self._store.claim(scoped, claim, in_flight_s)
            if found is None:
                return None
            record = _decode(found)
            while not (record.done or record.stream or record.body_hash != mine.body_hash):
                if time.monotonic() > deadline:
                    return record
                await self._sleep(self._poll_s)
                again = await self._store.get(scoped)
                if again is None:
                    break  # the first failed and withdrew: try to claim it ourselves
                record = _decode(again)
            else:
                return record

    def _done(self, mine: _Record, reply: Reply) -> bytes:
        """A stream is marked done once it opened: never replayed, 409 for the TTL."""
        answer = None
        if self._keep_answers and reply.stream is None:
            headers = {k: v for k, v in reply.headers.items() if k.startswith(_REPLAYED)}
            answer = _Answer(reply.status, headers, reply.body)
        return _encode(msgspec.structs.replace(mine, done=True, answer=answer))

    async def _withdraw(self, scoped: str, claim: bytes) -> None:
        try:
            await asyncio.shield(self._store.swap(scoped, claim, None, self._ttl_s))
        except Exception as exc:  # the request's own error matters more; the TTL ends it
            log.warning("idempotency key not withdrawn: %s", type(exc).__name__)

    async def _repeat(self, req: IdempotentRequest, mine: _Record, first: _Record) -> Reply:
        """A repeat's denial row, then the first answer or the error."""
        error: NcapError | None = None
        if first.body_hash != mine.body_hash:
            error = IdempotencyKeyMismatch(
                f"This Idempotency-Key was used by request {first.request_id} with another "
                "request body; use a new key for a new request.",
                param="Idempotency-Key",
            )
        elif first.answer is None:
            error = IdempotencyKeyReused(
                f"A request with this Idempotency-Key and body was already sent as request "
                f"{first.request_id}"
                + (" (a stream, never replayed)" if first.stream else "")
                + "; it is not dispatched again.",
                param="Idempotency-Key",
            )
        await self._record(req, "idempotent_replay" if error is None else str(error.code))
        if error is not None:
            raise error
        assert first.answer is not None
        headers = dict(first.answer.headers)
        headers["x-ncap-idempotent-replay"] = first.request_id
        return Reply(first.answer.status, headers, first.answer.body)

    async def _record(self, req: IdempotentRequest, reason: str) -> None:
        acc, rt = self._accounting, req.primary
        event = LedgerEvent(
            timestamp=acc.clock(),
            request_id=req.request_id,
            attempt=0,
            workload_id=req.caller.workload_id,
            environment=req.caller.environment,
            route_id=rt.id,
            model_alias=req.alias,
            upstream_model=rt.route.upstream_model or req.alias,
            requested_candidate_count=req.requested,
            effective_candidate_count=req.requested or 1,
            stream_mode=req.stream,
            quota_scope=acc.budgets.quota_scope,
            policy_result="deny",
            policy_reason=reason,
            state="denied",
            gateway_instance=acc.instance,
            denied_by="idempotency_key",
            client_retry_count=req.caller.client_retry_count,
        )
        await acc.record_denial(event)


def _body_hash(raw: bytes) -> str:
    """The body as JSON with sorted keys, hashed: key order and spacing do not matter."""
    body: Any = msgspec.json.decode(raw)
    return hashlib.sha256(_canonical(body)).hexdigest()
