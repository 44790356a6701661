"""``GrantsSync`` (``http/admin.py``): the snapshot the policy reads follows the admin
store — at start, after a local change, and every ``admin_refresh_s`` when other
gateways share the store; a failed re-read keeps the snapshot in force, and a read
that began before a change can never be applied after the read that follows it."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime

import pytest

from ncap.config import Config, ExceptionGrant
from ncap.domain.grants import GrantChanges, Grants
from ncap.errors import StoreUnavailable
from ncap.http.admin import GrantsSync
from ncap.stores.memory.admin import MemoryAdminStore
from ncap.stores.ports import AdminChange

GRANT = ExceptionGrant(
    id="eval", workload="default", owner="o", max_candidates=4, expires="2099-01-01T00:00:00Z"
)
NOW = datetime.fromisoformat("2026-12-01T00:00:00+00:00")


class FlakyStore(MemoryAdminStore):
    """A store another gateway writes to, whose reads fail while ``down``."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.reads = 0

    async def changes(self) -> GrantChanges:
        self.reads += 1
        if self.down:
            raise StoreUnavailable("admin", "PostgreSQL", "ConnectionRefusedError")
        return await super().changes()


def _grants() -> Grants:
    return Grants(Config.model_validate({}))


async def _until(predicate: object, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.01)


async def test_changes_of_another_gateway_arrive_and_an_outage_keeps_the_snapshot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, grants = FlakyStore(), _grants()
    sync = GrantsSync(store, grants, every_s=0.02)
    await sync.start()
    try:
        assert grants.exceptions == ()
        await store.record(AdminChange("elsewhere", "create", "exception", "eval", GRANT), NOW)
        await _until(lambda: grants.exceptions == (GRANT,))
        with caplog.at_level(logging.INFO, "ncap.admin"):
            store.down, reads = True, store.reads
            await _until(lambda: store.reads >= reads + 3)  # it keeps trying
            assert grants.exceptions == (GRANT,)  # what was in force stays in force
            await store.record(AdminChange("elsewhere", "revoke", "exception", "eval"), NOW)
            store.down = False
            await _until(lambda: grants.exceptions == ())
        assert caplog.messages == [  # once per outage, not once per try
            "admin changes cannot be re-read (StoreUnavailable); keeping the ones in force",
            "admin changes are re-read again",
        ]
    finally:
        await sync.stop()
    reads = store.reads
    await asyncio.sleep(0.1)
    assert store.reads == reads  # stopped
    await sync.stop()  # twice is harmless


async def test_without_an_interval_it_reads_at_start_and_on_reload_only() -> None:
    store, grants = FlakyStore(), _grants()
    sync = GrantsSync(store, grants)
    await sync.start()
    await store.record(AdminChange("a", "create", "exception", "eval", GRANT), NOW)
    await asyncio.sleep(0.05)
    assert (store.reads, grants.exceptions) == (1, ())
    await sync.reload()
    assert grants.exceptions == (GRANT,)
    await sync.stop()


async def test_a_failed_first_read_fails_the_start() -> None:
    store = FlakyStore()
    store.down = True
    with pytest.raises(StoreUnavailable):
        await GrantsSync(store, _grants(), every_s=0.02).start()


class SlowFirstRead(MemoryAdminStore):
    """The first read sees the state before a change and answers only after it."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.first = True

    async def changes(self) -> GrantChanges:
        if self.first:
            self.first = False
            before = await super().changes()
            await self.release.wait()
            return before
        return await super().changes()


async def test_a_read_begun_before_a_change_is_never_applied_after_it() -> None:
    store, grants = SlowFirstRead(), _grants()
    sync = GrantsSync(store, grants)
    periodic = asyncio.create_task(sync.reload())  # began before the change
    await asyncio.sleep(0)
    await store.record(AdminChange("a", "create", "exception", "eval", GRANT), NOW)
    after_change = asyncio.create_task(sync.reload())  # what the admin handler runs
    await asyncio.sleep(0.01)
    store.release.set()
    await asyncio.gather(periodic, after_change)
    assert grants.exceptions == (GRANT,)
