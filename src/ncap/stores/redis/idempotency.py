"""``Idempotency-Key`` records in Redis, beside the budgets: a claim is one Lua
``GET``/``SET … PX`` with an expiry, a swap a compare-and-set."""

from __future__ import annotations

from importlib.resources import files

from ncap.stores.redis.budgets import RedisBudgetStore, mapped_redis


def _lua(name: str) -> str:
    return files("ncap.stores.redis").joinpath(f"lua/{name}.lua").read_text()


class RedisIdempotency:
    """Records on the budgets' Redis, ``<prefix>:i1:<key>``, expiring by themselves."""

    def __init__(self, budgets: RedisBudgetStore) -> None:
        self._redis = budgets.client
        self._prefix = f"{budgets.prefix}:i1:"
        self._claim = self._redis.register_script(_lua("idempotency_claim_v1"))
        self._swap = self._redis.register_script(_lua("idempotency_swap_v1"))

    async def claim(self, key: str, record: bytes, ttl_s: float) -> bytes | None:
        with mapped_redis():
            found = await self._claim(keys=[self._prefix + key], args=[record, _ms(ttl_s)])
        return bytes(found) if found else None

    async def get(self, key: str) -> bytes | None:
        with mapped_redis():
            found = await self._redis.get(self._prefix + key)
        return found.encode() if isinstance(found, str) else found

    async def swap(self, key: str, expected: bytes, record: bytes | None, ttl_s: float) -> bool:
        args: list[bytes | int] = [expected, record or b"", _ms(ttl_s)]
        with mapped_redis():
            return bool(await self._swap(keys=[self._prefix + key], args=args))


def _ms(ttl_s: float) -> int:
    return max(1, round(ttl_s * 1000))
