"""Peer recovery on the embedded stores: a second gateway started on the same
SQLite files used to mark the first's in-flight row lost, free its hold, and then
serve past ``max_concurrency: 1``."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ncap.testing.fake_upstream import FakeState
from tests.scale.support import chat, client, holds, rows, shared_config, start, stop, wait_for
from tests.scale.support import wait_ready as ready


async def test_a_second_gateway_on_the_same_sqlite_files_leaves_the_first_alone(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    ledger, budgets = f"sqlite:///{tmp_path}/ledger.db", f"sqlite:///{tmp_path}/budgets.db"
    config = shared_config(
        fake[0],
        tmp_path,
        ledger,
        budgets,
        workloads={"default": {"max_concurrency": 1}},
        routes={"fake": {"headers": {"x-fake-fault": "latency=10000"}, "timeout_s": 30}},
    )
    fake[1].reset()
    log = tmp_path / "gw.log"
    first = start(config, log)
    second = None
    try:
        await asyncio.to_thread(ready, first)
        async with client() as http:
            in_flight = asyncio.create_task(
                http.post(first.url + "/v1/chat/completions", json=chat())
            )
            assert await wait_for(lambda: _upstream(fake[1]), timeout=20)
            second = start(config, log)
            await asyncio.to_thread(ready, second)
            [row] = await rows(ledger)
            assert (row.state, row.reconciliation_reason) == ("reserved", None)
            assert [h.state for h in await holds(budgets)] == ["active"]
            refused = await http.post(second.url + "/v1/chat/completions", json=chat())
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
            assert fake[1].requests == 1
            assert (await in_flight).status_code == 200
    finally:
        for gw in (first, second):
            if gw is not None:
                stop(gw)


async def _upstream(fake: FakeState) -> bool:
    return int(fake.stats()["in_flight"]) >= 1
