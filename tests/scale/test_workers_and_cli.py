"""``ncap serve --workers N`` on shared stores, and the FinOps commands on PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from ncap.cli.main import app as cli
from ncap.testing.fake_upstream import FakeState
from tests.scale.support import NCAP, Gateway, holds, rows, shared_config, wait_ready
from tests.servers import free_port
from tests.services import pg_schema, redis_prefix
from tests.support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, gateway


def test_workers_are_refused_on_in_process_budgets(tmp_path: Path) -> None:
    config = tmp_path / "ncap.yaml"
    config.write_text(f"stores:\n  budgets: memory://\n  ledger: sqlite:///{tmp_path}/l.db\n")
    result = CliRunner().invoke(cli, ["serve", "--workers", "2", "--config", str(config)])
    assert result.exit_code == 2
    assert "stores.budgets is memory://" in " ".join(result.output.split())


@pytest.mark.postgresql
@pytest.mark.redis
async def test_two_workers_share_one_port_and_the_stores(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    async with pg_schema() as ledger_url, redis_prefix() as budgets_url:
        config = shared_config(fake[0], tmp_path, ledger_url, budgets_url)
        port = free_port()
        env = {**os.environ, UPSTREAM_KEY_ENV: UPSTREAM_KEY}
        with (tmp_path / "workers.log").open("ab") as log:
            proc = subprocess.Popen(
                [*NCAP, "serve", "--workers", "2", "--port", str(port), "--config", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        try:
            await asyncio.to_thread(wait_ready, Gateway(proc, f"http://127.0.0.1:{port}"))
            body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
            for _ in range(30):  # a new connection each time: the kernel spreads them
                reply = await asyncio.to_thread(
                    httpx.post, f"http://127.0.0.1:{port}/v1/chat/completions", json=body
                )
                assert reply.status_code == 200, reply.text
        finally:
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 30) == 0
        events = await rows(ledger_url)
        assert len(events) == 30 and {e.state for e in events} == {"settled"}
        assert len({e.gateway_instance for e in events}) == 2
        assert {e.quota_scope for e in events} == {"global"}


@pytest.mark.postgresql
@pytest.mark.redis
async def test_export_and_reconcile_on_postgresql(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    async with pg_schema() as ledger_url, redis_prefix() as budgets_url:
        config_path = shared_config(
            fake[0],
            tmp_path,
            ledger_url,
            budgets_url,
            routes={"fake": {"headers": {"x-fake-fault": "missing_usage"}}},
        )
        from ncap.config import load_config

        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "n": 2}
        with gateway(load_config(config_path)) as gw:
            for _ in range(2):
                reply = await asyncio.to_thread(
                    httpx.post, gw.url + "/v1/chat/completions", json=body, timeout=10
                )
                assert reply.status_code == 200
            await asyncio.sleep(0.3)
        before = await rows(ledger_url)
        assert {e.state for e in before} == {"usage_reconciliation_required"}
        assert len(await holds(budgets_url)) == 2
        export = tmp_path / "usage.jsonl"
        export.write_text(
            "".join(
                json.dumps(
                    {
                        "provider_request_id": e.provider_request_id,
                        "input_tokens": 40,
                        "output_tokens": 100,
                    }
                )
                + "\n"
                for e in before
            )
        )
        runner = CliRunner()
        result = await asyncio.to_thread(
            runner.invoke, cli, ["reconcile", "import", str(export), "--config", str(config_path)]
        )
        assert result.exit_code == 0, result.output
        assert len(json.loads(result.stdout)["reconciled"]) == 2
        assert {e.state for e in await rows(ledger_url)} == {"reconciled"}
        assert await holds(budgets_url) == []  # the kept holds were settled in Redis
        exported = await asyncio.to_thread(
            runner.invoke, cli, ["ledger", "export", "--config", str(config_path)]
        )
        assert exported.exit_code == 0, exported.output
        lines = [json.loads(line) for line in exported.stdout.splitlines()]
        assert [e["state"] for e in lines] == ["reconciled", "reconciled"]
        assert {e["quota_scope"] for e in lines} == {"global"}
        pending = await asyncio.to_thread(
            runner.invoke,
            cli,
            ["reconcile", "list", "--format", "json", "--config", str(config_path)],
        )
        assert json.loads(pending.stdout) == []
