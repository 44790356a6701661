"""Budgets on Redis, shared by every replica: ``quota_scope=global``.

Two-phase, as every budget store (``ncap.domain.budget``): the caller estimates
conservatively, ``reserve`` admits the whole reservation against *every* window in one
call of a versioned Lua script (``lua/budgets_v2.lua``) or changes nothing, and
``settle`` replaces it by actual usage (``keep``: usage pending, amounts stay held;
``release``: never dispatched). The script is loaded once and called by SHA, and
reloaded when the server answers NOSCRIPT (a restart or SCRIPT FLUSH).

Calls are pipelined the way the ledgers group their commits: a call made while none
is in flight goes out at once, by itself; calls made while one is in flight wait for
it and go together as the next pipeline (one round trip; each ``EVALSHA`` is still
atomic on its own, and they run in the order they were made). Under load a call costs
about a quarter of the client CPU of a call per round trip; alone, it waits for
nothing. As only one round trip is in flight at a time, the script calls have one
connection of their own rather than a pool checkout each, packed by hiredis and read
under one deadline per round trip (``_Pipelined``): about half the client CPU of
redis-py's ``Script`` and ``Pipeline`` (which wrap every send in ``asyncio.wait_for``,
a task per send). The pool serves everything else (the workload set, reads, the
Idempotency-Key records).

The script only does bucket arithmetic. On a refusal it returns the counters it
checked and the server's time, and ``admit`` (the same rule the other backends apply)
raises the precise error with its retry hint. Time is Redis's (``TIME``), never the
gateway's clock, so replicas with skewed clocks share the same minute; tests may pass
a clock or an explicit ``now``. Window keys expire on their own; all of a workload's
keys share one hash tag (``ncap:b1:{workload}:…``), so the store is Redis Cluster
ready. Driver errors become ``StoreUnavailable`` in one place (``mapped_redis``).

URL: ``redis://host:6379/0?prefix=ncap`` (``rediss://`` for TLS); ``prefix`` namespaces
the keys (tests use one per test).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from importlib.resources import files
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit
from uuid import uuid4

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError, ResponseError

from ncap.domain.budget import Amounts, Buckets, BudgetWindows, Usage, admit
from ncap.errors import StoreUnavailable
from ncap.stores._common import hold_ref, settle_together
from ncap.stores.ports import BudgetHistory, Hold, Settle
from ncap.stores.redis.rebuild import restore_payloads

_pack_command: Callable[[tuple[Any, ...]], bytes] | None
try:  # redis[hiredis]: the C packer (redis.asyncio itself packs in Python)
    from hiredis import pack_command as _hiredis_pack

    _pack_command = _hiredis_pack
except ImportError:  # pragma: no cover - the dependency is redis[hiredis]
    _pack_command = None

__all__ = ["SCRIPT_VERSION", "RedisBudgetStore", "mapped_redis", "redis_target"]

SCRIPT_VERSION = "budgets_v3"
KEY_SCHEMA = "b1"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_NONE = -1  # "no limit" for the script
_Reserved = tuple[str, str, list[Any]]  # workload, hold id, the script's answer
LOST = "NCAPLOST"  # the script's refusal when a workload's counters were lost
log = logging.getLogger("ncap.stores.redis")


def redis_target(url: str) -> tuple[str, str]:
    """``redis://…?prefix=p`` -> (the URL without ``prefix``, the prefix)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query)
    prefix = next((v for k, v in query if k == "prefix"), "ncap")
    rest = urlencode([(k, v) for k, v in query if k != "prefix"])
    return urlunsplit(parts._replace(query=rest)), prefix


@contextlib.contextmanager
def mapped_redis() -> Iterator[None]:
    """Every redis-py failure (connection refused, timeout, loading, script error)
    becomes the one store error the gateway turns into a 503."""
    try:
        yield
    except (RedisError, OSError) as exc:
        raise StoreUnavailable("budgets", "Redis", type(exc).__name__) from exc


def _script_source() -> str:
    return files("ncap.stores.redis").joinpath(f"lua/{SCRIPT_VERSION}.lua").read_text()


def _us(now: datetime) -> int:
    if now.tzinfo is None:
        raise ValueError("budget clocks must be timezone-aware")
    return (now - EPOCH) // timedelta(microseconds=1)


def _at(us: int | bytes | str) -> datetime:
    return EPOCH + timedelta(microseconds=int(us))


def _limit(value: int | None) -> int:
    return _NONE if value is None else value


class RedisBudgetStore:
    """``BudgetStore`` on one Redis (or a Redis Cluster slot per workload)."""

    quota_scope = "global"
    round_trip = True

    def __init__(
        self,
        url: str,
        *,
        gateway_instance: str = "local",
        clock: Callable[[], datetime] | None = None,
        connect_timeout_s: float = 2.0,
        timeout_s: float = 2.0,
        max_connections: int = 64,
        pool_timeout_s: float = 2.0,
        history: BudgetHistory | None = None,
        rebuild_grace_s: float = 0.5,
        rebuild_wait_s: float = 2.0,
    ) -> None:
        target, self.prefix = redis_target(url)
        self._instance = gateway_instance
        self._clock = clock
        self._history = history
        self._rebuild_grace_s = rebuild_grace_s
        self._wait_s = rebuild_wait_s
        self._rebuilding: asyncio.Task[int] | None = None
        self.rebuilds = 0  # how many workloads this gateway wrote back (tests, metrics)
        # a bounded pool that waits for a free connection rather than failing a burst:
        # a dead Redis fails fast (connect/socket timeouts), a busy pool only queues
        pool = aioredis.BlockingConnectionPool.from_url(
            target,
            max_connections=max_connections,
            timeout=pool_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=timeout_s,
        )
        self._redis = aioredis.Redis(connection_pool=pool)
        self._script = self._redis.register_script(_script_source())
        # the script calls' own connection: one round trip at a time (module doc), under
        # one deadline of its own instead of redis-py's per-send and per-read timers
        own = dict(pool.connection_kwargs, socket_timeout=None)
        connection = pool.connection_class(**own)
        self._calls = _Pipelined(self._redis, self._script, connection, timeout_s)
        self._workloads_key = f"{self.prefix}:{KEY_SCHEMA}:workloads"
        self._known: set[str] = set()
        self._orphans: set[asyncio.Task[Any]] = set()

    @property
    def client(self) -> aioredis.Redis:
        """The connection pool, shared with the Idempotency-Key records."""
        return self._redis

    # -- keys --------------------------------------------------------------------------

    def _base(self, workload_id: str) -> str:
        tag = workload_id
        if "{" in tag or "}" in tag:
            tag = hashlib.sha1(workload_id.encode()).hexdigest()
        return f"{self.prefix}:{KEY_SCHEMA}:{{{tag}}}"

    async def _call(
        self, workload_id: str, *args: Any, first: tuple[Any, ...] | None = None
    ) -> Any:
        """One script call; when the counters were lost, again once rebuilt (after
        ``first``, a call that undoes what the rebuild may have made of this one)."""
        key = self._base(workload_id)
        try:
            return await self._calls(key, args)
        except StoreUnavailable as exc:
            if not _lost(exc):
                raise
            if not await self._wait_for_rebuild(workload_id):
                raise _lost_error(exc) from exc.__cause__
        try:  # rebuilt: once more (the refused call changed nothing)
            if first is not None:
                await self._calls(key, first)
            return await self._calls(key, args)
        except StoreUnavailable as exc:
            if not _lost(exc):
                raise
            raise _lost_error(exc) from exc.__cause__

    # -- lost counters -----------------------------------------------------------------

    async def _wait_for_rebuild(self, workload_id: str) -> bool:
        """The counters were lost: start one rebuild in the background (whichever
        gateway takes the Redis lock rebuilds; the others wait for its marker) and wait
        up to ``rebuild_wait_s`` for this workload's marker; True once it is back."""
        if self._history is None:
            return False  # nothing to rebuild from (a tool without a ledger): refuse
        if self._rebuilding is None or self._rebuilding.done():
            self._rebuilding = asyncio.create_task(self._rebuild_quietly(workload_id))
        # bounded without cancelling anything (redis-py calls have their own timeouts)
        deadline = time.monotonic() + self._wait_s
        done, _ = await asyncio.wait({self._rebuilding}, timeout=self._wait_s)
        while done and time.monotonic() < deadline:
            with mapped_redis():  # a peer holds the lock: its marker comes when it is done
                if await self._redis.exists(f"{self._base(workload_id)}:g"):
                    return True
            await asyncio.sleep(0.05)
        return False

    async def _rebuild_quietly(self, workload_id: str) -> int:
        try:
            return await self.rebuild([workload_id])
        except StoreUnavailable as exc:
            log.warning("rebuilding the budget counters failed: %s", exc.detail)
            return 0
        except Exception as exc:  # logged, never left unretrieved in a task
            log.error("rebuilding the budget counters failed: %s", type(exc).__name__)
            return 0

    async def rebuild(self, workloads: Iterable[str] = ()) -> int:
        """Write back, from the ledger, the counters of every workload whose marker is
        missing; returns how many this call restored (0 when another gateway holds the
        rebuild lock, or every marker is present). Waits ``rebuild_grace_s`` after
        taking the lock, so that settlements whose Redis step ran just before the loss
        have written their ledger row before the ledger is read."""
        if self._history is None:
            raise StoreUnavailable("budgets", "Redis", "counters lost; no ledger to rebuild from")
        lock = self._redis.lock(f"{self.prefix}:{KEY_SCHEMA}:rebuild", timeout=120)
        with mapped_redis():
            if not await lock.acquire(blocking=False):
                return 0
        try:
            log.warning("Redis budget counters were lost; rebuilding them from the ledger")
            await asyncio.sleep(self._rebuild_grace_s)
            return await self._restore_all(workloads)
        finally:
            with contextlib.suppress(RedisError, OSError):
                await lock.release()

    async def _restore_all(self, workloads: Iterable[str]) -> int:
        assert self._history is not None
        with mapped_redis():
            seconds, micros = await self._redis.time()
        now = self._clock() if self._clock is not None else _at(seconds * 1_000_000 + micros)
        payloads = await restore_payloads(self._history, now)
        names = set(workloads) | set(payloads) | set(await self._workloads())
        generation = uuid4().hex
        restored = 0
        for workload_id in sorted(names):
            payload = payloads.get(workload_id)
            body = json.dumps(payload.payload() if payload else {"c": {}, "h": {}})
            restored += int(
                await self._calls(self._base(workload_id), ("restore", generation, body))
            )
            with mapped_redis():
                await self._redis.sadd(self._workloads_key, workload_id)
        self.rebuilds += restored
        if restored:
            log.warning("budget counters of %d workload(s) rebuilt from the ledger", restored)
        return restored

    async def ensure_counters(self, workloads: Iterable[str], timeout_s: float = 60.0) -> None:
        """At start-up: every workload's counters are whole, rebuilt here (or by a peer,
        waited for) when they are not."""
        names = list(workloads)
        deadline = time.monotonic() + timeout_s
        while True:
            missing = await self._missing_markers(names)
            if not missing:
                return
            if time.monotonic() > deadline:
                raise StoreUnavailable("budgets", "Redis", "counters lost and not rebuilt")
            if not await self.rebuild(missing):
                await asyncio.sleep(0.2)  # a peer holds the lock: wait for its markers

    async def _missing_markers(self, workloads: list[str]) -> list[str]:
        with mapped_redis():
            found = [await self._redis.exists(f"{self._base(w)}:g") for w in workloads]
        return [w for w, present in zip(workloads, found, strict=True) if not present]

    async def server_warnings(self) -> list[str]:
        """What in the Redis server's settings can lose counters (module doc): both
        heal by a rebuild from the ledger, at the cost of 503s while it runs. A
        server that refuses CONFIG (some managed offerings) is not second-guessed."""
        settings: dict[str, str] = {}
        with mapped_redis():
            for name in ("appendonly", "save", "maxmemory-policy"):
                try:
                    found = await self._redis.config_get(name)
                except ResponseError:
                    return []
                settings.update({_text(k or ""): _text(v or "") for k, v in found.items()})
        out = []
        if settings.get("appendonly") != "yes" and not settings.get("save", "").strip():
            out.append(
                "Redis has no persistence (appendonly no, no save points): a restart "
                "empties the budget counters, and every gateway refuses (503) while one "
                "rebuilds them from the ledger; set appendonly yes"
            )
        policy = settings.get("maxmemory-policy") or "noeviction"
        if policy != "noeviction":
            out.append(
                f"Redis maxmemory-policy is {policy}: an evicted budget key is a lost "
                "counter; set maxmemory-policy noeviction"
            )
        return out

    def _now_arg(self, now: datetime | None) -> str:
        if now is None and self._clock is not None:
            now = self._clock()
        return "" if now is None else str(_us(now))

    # -- the port ----------------------------------------------------------------------

    async def reserve(
        self,
        workload_id: str,
        windows: BudgetWindows,
        amounts: Amounts,
        *,
        exception_id: str | None = None,
        now: datetime | None = None,
        hold_id: str | None = None,
    ) -> Hold:
        hold_id = hold_id or uuid4().hex
        args = self._reserve_args(workload_id, windows, amounts, exception_id, now, hold_id)
        task = asyncio.ensure_future(self._reserve(workload_id, hold_id, args))
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._release_orphan)
            raise
        return self._admitted(workload_id, windows, amounts, exception_id, hold_id, result)

    def _reserve_args(
        self,
        workload_id: str,
        windows: BudgetWindows,
        amounts: Amounts,
        exception_id: str | None,
        now: datetime | None,
        hold_id: str,
    ) -> list[Any]:
        exception_budget = windows.exception_budget_micros if exception_id else None
        return [
            "reserve",
            self._now_arg(now),
            hold_id,
            exception_id or "",
            self._instance,
            amounts.tokens,
            amounts.cost_micros,
            _limit(windows.tokens_per_minute),
            _limit(windows.requests_per_minute),
            _limit(windows.tokens_per_day),
            _limit(windows.usd_per_day_micros),
            _limit(windows.usd_per_month_micros),
            _limit(windows.max_concurrency),
            _limit(exception_budget),
            workload_id,
        ]

    async def _reserve(self, workload_id: str, hold_id: str, args: list[Any]) -> _Reserved:
        await self._register(workload_id)
        # a reservation sent beside its ledger row: a rebuild may have read that row and
        # made it an (unchecked) active hold; given back before admission runs again
        undo = ("release", hold_id)
        return workload_id, hold_id, list(await self._call(workload_id, *args, first=undo))

    async def _register(self, workload_id: str) -> None:
        """The set of workloads lets sweeps and reconciliation find every hold."""
        if workload_id not in self._known:
            with mapped_redis():
                await self._redis.sadd(self._workloads_key, workload_id)
            self._known.add(workload_id)

    def _admitted(
        self,
        workload_id: str,
        windows: BudgetWindows,
        amounts: Amounts,
        exception_id: str | None,
        hold_id: str,
        reserved: _Reserved,
    ) -> Hold:
        result = reserved[2]
        status, at = int(result[0]), _at(result[1])
        buckets = Buckets.at(at)
        if status == -1:
            raise ValueError(f"hold {hold_id!r} already exists")
        if status == 0:
            admit(workload_id, exception_id, _usage(result[2:]), windows, amounts, buckets)
            raise RuntimeError("budget script refused a reservation the admission rule allows")
        return Hold(
            hold_id=hold_id,
            workload_id=workload_id,
            exception_id=exception_id,
            tokens=amounts.tokens,
            cost_micros=amounts.cost_micros,
            minute=buckets.minute,
            day=buckets.day,
            month=buckets.month,
            gateway_instance=self._instance,
            created_at=at,
        )

    async def settle(self, hold: Hold | str, actual_tokens: int, actual_cost_micros: int) -> bool:
        if actual_tokens < 0 or actual_cost_micros < 0:
            raise ValueError("actual usage cannot be negative")
        return await self._on_hold(hold, "settle", actual_tokens, actual_cost_micros)

    async def settle_many(self, settles: Sequence[Settle]) -> None:
        """Each settled by its own script call, sent together (the round trips overlap)."""
        await settle_together(self.settle, settles)

    async def keep(self, hold: Hold | str) -> bool:
        return await self._on_hold(hold, "keep")

    async def release(self, hold: Hold | str) -> bool:
        return await self._on_hold(hold, "release")

    async def _on_hold(self, hold: Hold | str, op: str, *args: Any) -> bool:
        """By object: its workload's keys; by id alone (reconciliation): every workload."""
        ref = hold_ref(hold)
        workloads = [hold.workload_id] if isinstance(hold, Hold) else await self._workloads()
        for workload_id in workloads:
            if int(await self._call(workload_id, op, ref, *args)) == 1:
                return True
        return False

    async def _workloads(self) -> list[str]:
        with mapped_redis():
            members = await self._redis.smembers(self._workloads_key)
        return sorted(_text(m) for m in members)

    async def outstanding(self, workload_id: str | None = None) -> list[Hold]:
        workloads = [workload_id] if workload_id is not None else await self._workloads()
        holds: list[Hold] = []
        for w in workloads:
            with mapped_redis():
                raw = await self._redis.hgetall(f"{self._base(w)}:h")
            holds += [_hold(_text(k), json.loads(v)) for k, v in raw.items()]
        return sorted(holds, key=lambda h: (h.created_at, h.hold_id))

    async def usage(
        self, workload_id: str, *, exception_id: str | None = None, now: datetime | None = None
    ) -> Usage:
        result = await self._call(workload_id, "usage", self._now_arg(now), exception_id or "")
        return _usage(result[1:])

    async def recover_lost(self, gateway_instance: str | None = None) -> int:
        total = 0
        for workload_id in await self._workloads():
            total += int(await self._call(workload_id, "recover", gateway_instance or ""))
        return total

    async def ping(self) -> None:
        with mapped_redis():
            await self._redis.ping()

    async def close(self) -> None:
        if self._rebuilding is not None:
            await asyncio.gather(self._rebuilding, return_exceptions=True)
        if self._orphans:
            await asyncio.gather(*self._orphans, return_exceptions=True)
        await self._calls.close()
        with contextlib.suppress(RedisError, OSError):
            await self._redis.aclose()

    def _release_orphan(self, task: asyncio.Task[_Reserved]) -> None:
        """A caller cancelled while its reservation ran: give an admitted hold back."""
        if task.cancelled() or task.exception() is not None:
            return
        workload_id, hold_id, result = task.result()
        if int(result[0]) != 1:
            return
        orphan = asyncio.ensure_future(self._call(workload_id, "release", hold_id))
        self._orphans.add(orphan)
        orphan.add_done_callback(self._orphans.discard)


class _Pipelined:
    """Calls of one script, pipelined while a round trip is in flight (module doc).

    Only one round trip is in flight at a time, so the calls have a connection of their
    own and skip the pool: each round trip is the packed ``EVALSHA``s written at once,
    then their replies read, under one ``timeout_s`` deadline. Any failure or
    cancellation in between disconnects it (a reply must never be left for the next
    round trip to read); the next round trip connects again. A call is never sent
    twice: a connection lost mid-round-trip fails its calls with ``StoreUnavailable``
    (a reservation sent again after it ran would meet its own hold).
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        script: AsyncScript,
        connection: AbstractConnection,
        timeout_s: float,
        max_batch: int = 256,
    ) -> None:
        self._redis = redis
        self._script = script
        self._connection = connection
        self._timeout_s = timeout_s
        self._max_batch = max_batch
        self._queue: list[tuple[str, tuple[Any, ...], asyncio.Future[Any]]] = []
        self._in_flight = False
        self._sender: asyncio.Task[None] | None = None

    async def __call__(self, key: str, args: tuple[Any, ...]) -> Any:
        if not self._in_flight:  # nothing to wait for: this call goes now, by itself
            self._in_flight = True
            try:
                with mapped_redis():
                    result = await self._alone(key, args)
            finally:
                self._in_flight = False
                self._send_later()
            if isinstance(result, RedisError):
                raise _unavailable(result)
            return result
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((key, args, future))
        return await future  # a caller cancelled before its pipeline is sent sends nothing

    async def _alone(self, key: str, args: tuple[Any, ...]) -> Any:
        """One call in its own round trip (again once loaded, if it met NOSCRIPT)."""
        result = (await self._round_trip([(key, args)]))[0]
        if isinstance(result, NoScriptError):
            await self._load()
            result = (await self._round_trip([(key, args)]))[0]
        return result

    def _send_later(self) -> None:
        if self._queue and not self._in_flight:
            self._in_flight = True
            self._sender = asyncio.create_task(self._send_queued())
            self._sender.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        """The sender ended (drained, or cancelled even before it ran): the next call may
        go at once, and calls still queued get a sender of their own."""
        if not task.cancelled():
            task.exception()  # retrieved: _resolve already gave it to the callers
        self._in_flight = False
        self._send_later()

    async def drain(self) -> None:
        while self._sender is not None and not self._sender.done():
            await asyncio.gather(self._sender, return_exceptions=True)

    async def close(self) -> None:
        await self.drain()
        with contextlib.suppress(RedisError, OSError):
            await self._connection.disconnect()

    async def _send_queued(self) -> None:
        while self._queue:
            batch = [c for c in self._queue[: self._max_batch] if not c[2].done()]
            del self._queue[: self._max_batch]
            if batch:
                await self._resolve(batch)

    async def _resolve(self, batch: list[tuple[str, tuple[Any, ...], asyncio.Future[Any]]]) -> None:
        try:
            results = await self._send(batch)
        except (RedisError, OSError) as exc:
            results = [exc] * len(batch)
        except BaseException as exc:  # cancelled: never leave a caller waiting
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(_unavailable(exc))
            raise
        for (_, _, future), result in zip(batch, results, strict=True):
            if future.done():
                continue
            if isinstance(result, RedisError | OSError):
                future.set_exception(_unavailable(result))
            elif isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _send(
        self, batch: list[tuple[str, tuple[Any, ...], asyncio.Future[Any]]]
    ) -> list[Any]:
        """One pipeline; the calls that met NOSCRIPT (nothing ran) again once it is loaded."""
        results = await self._pipeline([(key, args) for key, args, _ in batch])
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:
            await self._load()
            again = await self._pipeline([(batch[i][0], batch[i][1]) for i in missing])
            for i, result in zip(missing, again, strict=True):
                results[i] = result
        return results

    async def _pipeline(self, calls: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        return await self._round_trip(calls)

    async def _round_trip(self, calls: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        sha = self._script.sha
        return await self._exchange([("EVALSHA", sha, 1, key, *args) for key, args in calls])

    async def _load(self) -> None:
        """``SCRIPT LOAD`` on the calls' own connection (the one that met NOSCRIPT)."""
        (reply,) = await self._exchange([("SCRIPT", "LOAD", self._script.script)])
        if isinstance(reply, BaseException):
            raise reply

    async def _exchange(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Each command's reply, or the error it was answered with (the others ran); a
        connection failure, timeout or cancellation raises, disconnected."""
        connection = self._connection
        if _pack_command is not None:
            packed: Any = b"".join([_pack_command(c) for c in commands])
        else:  # pragma: no cover
            packed = connection.pack_commands(commands)
        results: list[Any] = []
        try:
            async with asyncio.timeout(self._timeout_s):
                await connection.send_packed_command(packed, check_health=False)
                for _ in commands:
                    try:
                        results.append(await connection.read_response())
                    except ResponseError as exc:  # this call's error reply, the others ran
                        results.append(exc)
        except BaseException:
            await connection.disconnect(nowait=True)
            raise
        return results


def _lost_error(exc: StoreUnavailable) -> StoreUnavailable:
    return StoreUnavailable("budgets", "Redis", "counters lost; rebuilding from the ledger")


def _lost(exc: StoreUnavailable) -> bool:
    cause = exc.__cause__
    return isinstance(cause, ResponseError) and str(cause).startswith(LOST)


def _unavailable(exc: BaseException) -> StoreUnavailable:
    error = StoreUnavailable("budgets", "Redis", type(exc).__name__)
    error.__cause__ = exc
    return error


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _usage(values: list[Any]) -> Usage:
    tm, rm, td, cd, cm, cx, in_flight = (int(v) for v in values)
    return Usage(
        tokens_minute=tm,
        requests_minute=rm,
        tokens_day=td,
        cost_day=cd,
        cost_month=cm,
        cost_exception=cx,
        in_flight=in_flight,
    )


def _hold(hold_id: str, rec: dict[str, Any]) -> Hold:
    buckets = Buckets.at(_at(rec["at"]))
    return Hold(
        hold_id=hold_id,
        workload_id=rec["w"],
        exception_id=rec["x"] or None,
        tokens=int(rec["t"]),
        cost_micros=int(rec["c"]),
        minute=buckets.minute,
        day=buckets.day,
        month=buckets.month,
        gateway_instance=rec["g"],
        created_at=buckets.now,
        state=rec["s"],
    )
