"""The Idempotency-Key hook over the scripted provider: a store that fails after the
answer does not cost the client its answer nor the attempt its settlement; an
unfinished record is claimed with the in-flight bound, not the whole TTL."""

from __future__ import annotations

from pathlib import Path

import msgspec

from ncap.errors import StoreUnavailable
from ncap.lifecycle import Gateway
from ncap.lifecycle.idempotency import IN_FLIGHT_S
from ncap.stores.memory.idempotency import MemoryIdempotency
from ncap.testing.scripted import Answer, ScriptedProvider, chat_body
from tests.lifecycle.harness import CALLER, harness, route, settled

RAW = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


class SwapFails(MemoryIdempotency):
    def __init__(self) -> None:
        super().__init__()
        self.claim_ttls: list[float] = []

    async def claim(self, key: str, record: bytes, ttl_s: float) -> bytes | None:
        self.claim_ttls.append(ttl_s)
        return await super().claim(key, record, ttl_s)

    async def swap(self, key: str, expected: bytes, record: bytes | None, ttl_s: float) -> bool:
        raise StoreUnavailable("budgets", "Redis", "ConnectionError")


async def test_a_store_error_after_the_answer_keeps_the_answer_and_its_settlement(
    tmp_path: Path,
) -> None:
    provider = ScriptedProvider([Answer(chat_body("hello"))])
    h = harness(tmp_path, {"a": (route(), provider)})
    store = SwapFails()
    gw = Gateway(h.gateway.config, h.gateway.routes, h.gateway.accounting, idempotency=store)
    reply = await gw.chat(RAW, CALLER, "req-1", idempotency_key="k")
    assert reply.status == 200 and reply.settling
    await settled(gw)
    (row,) = await h.rows()
    assert row.state == "settled" and await h.outstanding() == []
    assert store.claim_ttls == [min(IN_FLIGHT_S, gw.config.server.idempotency_ttl_s)]
