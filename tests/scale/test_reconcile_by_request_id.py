"""Rows the provider never named (a lost gateway): ncap sends its own id upstream on
every attempt (``X-Client-Request-Id``), an import matches the provider's records by
it, and an operator settles or releases a row by ncap's request id, with a reason the
ledger keeps."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ncap.cli.main import app as cli
from ncap.testing.fake_upstream import FakeState
from tests.scale.support import (
    chat,
    client,
    holds,
    rows,
    shared_config,
    start,
    stop,
    wait_for,
    wait_ready,
)
from tests.services import pg_schema, redis_prefix

pytestmark = [pytest.mark.postgresql, pytest.mark.redis]


async def _in_flight(fake: FakeState, count: int) -> bool:
    return fake.in_flight >= count


async def _invoke(*args: str) -> tuple[int, str, str]:
    result = await asyncio.to_thread(CliRunner().invoke, cli, list(args))
    return result.exit_code, result.stdout, result.output


async def test_lost_rows_are_settled_released_and_imported_by_ncap_ids(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    async with pg_schema() as ledger_url, redis_prefix() as budgets_url:
        config = shared_config(
            fake[0],
            tmp_path,
            ledger_url,
            budgets_url,
            routes={"fake": {"headers": {"x-fake-fault": "latency=20000"}, "timeout_s": 60}},
        )
        fake[1].reset()
        log = tmp_path / "gw.log"
        doomed = start(config, log)
        try:
            await asyncio.to_thread(wait_ready, doomed)
            async with client() as http:
                sent = [
                    asyncio.create_task(http.post(doomed.url + "/v1/chat/completions", json=chat()))
                    for _ in range(3)
                ]
                assert await wait_for(lambda: _in_flight(fake[1], 3), timeout=20, every=0.05)
                doomed.proc.send_signal(signal.SIGKILL)
                await asyncio.gather(*sent, return_exceptions=True)
        finally:
            stop(doomed)
        successor = start(config, log)  # recovers the dead one's rows at start-up
        try:
            await asyncio.to_thread(wait_ready, successor)
        finally:
            stop(successor)
        lost = await rows(ledger_url)
        assert [(e.reconciliation_reason, e.provider_request_id) for e in lost] == [
            ("gateway_lost", None)
        ] * 3
        # each attempt went upstream with ncap's id of it, as a provider keeps it
        sent_ids = {f"{e.request_id}#{e.attempt}" for e in lost}
        assert sent_ids <= set(fake[1].client_request_ids)
        first, second, third = lost
        cfg = ["--config", str(config)]

        why = "provider dashboard: 40 in, 100 out"
        code, out, text = await _invoke(
            "reconcile", "settle", first.request_id, "--input-tokens", "40",
            "--output-tokens", "100", "--reason", why, "--actor", "alice", *cfg,
        )  # fmt: skip
        assert code == 0, text
        assert json.loads(out)["hold_settled"] is True

        code, out, text = await _invoke(
            "reconcile", "release", second.request_id,
            "--reason", "never reached the provider (its logs)", "--actor", "bob", *cfg,
        )  # fmt: skip
        assert code == 0, text

        export = tmp_path / "provider-usage.csv"
        export.write_text(
            "client_request_id,prompt_tokens,completion_tokens\n"
            f"{third.request_id}#{third.attempt},30,70\n"
        )
        code, out, text = await _invoke("reconcile", "import", str(export), *cfg)
        assert code == 0, text
        assert json.loads(out)["reconciled"] == [f"{third.request_id}#1"]
        code, out, text = await _invoke("reconcile", "import", str(export), *cfg)
        assert code == 0 and json.loads(out)["unchanged"] == [f"{third.request_id}#1"], text

        # a second settle of the same row is refused: nothing is pending any more
        code, _, text = await _invoke(
            "reconcile", "settle", first.request_id, "--input-tokens", "1",
            "--output-tokens", "1", "--reason", "again", *cfg,
        )  # fmt: skip
        assert code == 2 and "nothing to settle" in " ".join(text.split())

        after = {e.request_id: e for e in await rows(ledger_url)}
        remaining = await holds(budgets_url)
        code, out, _ = await _invoke("reconcile", "list", "--format", "json", *cfg)

    one, two, three = after[first.request_id], after[second.request_id], after[third.request_id]
    assert (one.state, one.total_tokens, one.input_tokens) == ("reconciled", 140, 40)
    assert one.reconciliation_reason == f"gateway_lost; settled by alice: {why}"
    assert (two.state, two.total_tokens, two.cost_micros) == ("reconciled", 0, 0)
    assert two.reconciliation_reason == (
        "gateway_lost; released by bob: never reached the provider (its logs)"
    )
    assert (three.state, three.total_tokens, three.usage_source) == (
        "reconciled",
        100,
        "reconciliation_import",
    )
    assert remaining == []  # every kept hold settled with the reconciled usage
    assert code == 0 and json.loads(out) == []
