"""Crash recovery, privacy and reconciliation, with the gateway as a real process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import yaml
from typer.testing import CliRunner

from ncap.cli.main import app as cli
from ncap.config import Config
from ncap.testing.fake_upstream import FakeState
from tests.http.test_accounting import holds, rows
from tests.support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, gateway, gateway_config

NCAP = [sys.executable, "-m", "ncap.cli.main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _write(config: Config, tmp: Path) -> Path:
    path = tmp / "ncap.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    return path


@contextmanager
def serving(config_path: Path, log: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = _free_port()
    env = {**os.environ, UPSTREAM_KEY_ENV: UPSTREAM_KEY}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [*NCAP, "serve", "--config", str(config_path), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
            with suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()


def _wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the gateway exited during start-up"
        with suppress(httpx.HTTPError):
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError("the gateway did not become ready")


async def _fire(url: str, count: int) -> list[asyncio.Task[Any]]:
    client = httpx.AsyncClient(base_url=url, timeout=60)
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "wait"}]}
    return [
        asyncio.create_task(client.post("/v1/chat/completions", json=body)) for _ in range(count)
    ]


async def test_kill_9_with_20_in_flight_recovers_as_gateway_lost(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    config = gateway_config(
        fake[0],
        tmp_path,
        routes={"fake": {"headers": {"x-fake-fault": "latency=20000"}, "timeout_s": 60}},
    )
    path, log = _write(config, tmp_path), tmp_path / "gateway.log"
    fake[1].reset()
    with serving(path, log) as (proc, url):
        tasks = await _fire(url, 20)
        deadline = time.monotonic() + 20
        while fake[1].stats()["in_flight"] < 20:
            assert time.monotonic() < deadline, fake[1].stats()
            await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    in_flight = await rows(tmp_path)
    assert len(in_flight) == 20 and {e.state for e in in_flight} == {"reserved"}
    with serving(path, log):
        events = await rows(tmp_path)
        kept = await holds(tmp_path)
    assert len(events) == 20
    assert {(e.state, e.reconciliation_reason) for e in events} == {
        ("usage_reconciliation_required", "gateway_lost")
    }
    assert len(kept) == 20 and {h.state for h in kept} == {"kept"}
    assert {h.hold_id for h in kept} == {f"{e.request_id}#{e.attempt}" for e in events}


async def test_canary_never_reaches_ledger_logs_or_metrics(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    canary = "CANARY" + uuid.uuid4().hex
    config = gateway_config(fake[0], tmp_path)
    path, log = _write(config, tmp_path), tmp_path / "gateway.log"
    headers = {"X-Canary": canary, "Authorization": f"Bearer {canary}", "User-Agent": canary}
    conversation = [
        {"role": "system", "content": f"system {canary}"},
        {"role": "user", "content": f"user {canary}"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": json.dumps({"q": canary})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": canary},
    ]
    base = {"model": "fake-model", "messages": conversation, "user": canary}
    bodies = [
        base,
        {**base, "n": 2, "stream": True, "stream_options": {"include_usage": True}},
        {**base, "metadata": {"k": canary}, "safety_identifier": canary},
        {**base, canary: 1},  # unknown field: rejected, named to the client only
        {**base, "n": 9},  # denied by policy
        {**base, "model": canary},  # unknown model
    ]
    with serving(path, log) as (_proc, url):
        async with httpx.AsyncClient(base_url=url, timeout=10, headers=headers) as client:
            statuses = [
                (await client.post("/v1/chat/completions", json=b)).status_code for b in bodies
            ]
            metrics = (await client.get("/metrics")).text
        await asyncio.sleep(0.3)  # let the streamed attempt settle
    assert statuses == [200, 200, 200, 400, 400, 404]
    assert len(await rows(tmp_path)) == 4  # three answered, one denied (400s before policy)
    for file in tmp_path.iterdir():
        if file.is_file() and file.name != "ncap.yaml":
            assert canary.encode() not in file.read_bytes(), file.name
    assert "ncap_requests" in metrics and canary not in metrics


def test_reconcile_import_moves_rows_and_is_idempotent(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    config = gateway_config(
        fake[0], tmp_path, routes={"fake": {"headers": {"x-fake-fault": "missing_usage"}}}
    )
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "n": 2}
    with gateway(config) as gw:
        ids = [
            httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10).headers[
                "x-request-id"
            ]
            for _ in range(2)
        ]
    before = asyncio.run(rows(tmp_path))
    assert {e.state for e in before} == {"usage_reconciliation_required"}
    assert len(asyncio.run(holds(tmp_path))) == 2
    export = tmp_path / "provider-usage.jsonl"
    export.write_text(
        "".join(
            json.dumps(
                {
                    "provider_request_id": e.provider_request_id,
                    "input_tokens": 40 + i,
                    "output_tokens": 100 + i,
                }
            )
            + "\n"
            for i, e in enumerate(before)
        )
    )
    path = _write(config, tmp_path)
    first = CliRunner().invoke(cli, ["reconcile", "import", str(export), "--config", str(path)])
    assert first.exit_code == 0, first.output
    after = asyncio.run(rows(tmp_path))
    assert {e.request_id for e in after} == set(ids)
    for i, event in enumerate(after):
        assert event.state == "reconciled"
        assert event.usage_source == "reconciliation_import"
        assert (event.input_tokens, event.output_tokens_total) == (40 + i, 100 + i)
        assert event.cost_micros is not None and event.cost_micros > 0
    assert asyncio.run(holds(tmp_path)) == []
    second = CliRunner().invoke(cli, ["reconcile", "import", str(export), "--config", str(path)])
    assert second.exit_code == 0, second.output
    summary = json.loads(second.stdout)
    assert summary["reconciled"] == [] and len(summary["unchanged"]) == 2
    assert asyncio.run(rows(tmp_path)) == after


def test_ledger_export_and_reconcile_list(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    config = gateway_config(fake[0], tmp_path)
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    with gateway(config) as gw:
        ok = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10)
        denied = httpx.post(gw.url + "/v1/chat/completions", json={**body, "n": 9}, timeout=10)
    assert (ok.status_code, denied.status_code) == (200, 400)
    path = _write(config, tmp_path)
    runner = CliRunner()
    jsonl = runner.invoke(cli, ["ledger", "export", "--since", "1d", "--config", str(path)])
    assert jsonl.exit_code == 0, jsonl.output
    events = [json.loads(line) for line in jsonl.stdout.splitlines()]
    assert [e["state"] for e in events] == ["settled", "denied"]
    assert events[0]["request_id"] == ok.headers["x-request-id"]
    assert events[1]["policy_reason"] == "candidate_count_exceeds_policy"
    csv_out = runner.invoke(cli, ["ledger", "export", "--format", "csv", "--config", str(path)])
    header, *lines = csv_out.stdout.strip().splitlines()
    assert header.startswith("timestamp,request_id,attempt,workload_id") and len(lines) == 2
    pending = runner.invoke(cli, ["reconcile", "list", "--format", "json", "--config", str(path)])
    assert pending.exit_code == 0 and json.loads(pending.stdout) == []


def _default_stores(config: Config, tmp: Path, **workload: Any) -> Config:
    """The shipped default stores (SQLite ledger, in-process budgets, durability
    normal), the ledger in ``tmp`` so the test can read it."""
    raw = config.model_dump(mode="json", exclude_none=True)
    raw["stores"] = {"ledger": f"sqlite:///{tmp}/ledger.db"}
    raw["workloads"]["default"].update(workload)
    return Config.model_validate(raw)


async def test_kill_9_on_the_default_stores_keeps_every_hold_counted(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    """In-process budgets are rebuilt from the ledger: after kill -9 with 20 requests in
    flight, the restarted gateway still holds all 20 reservations against the budget."""
    config = _default_stores(
        gateway_config(
            fake[0],
            tmp_path,
            routes={"fake": {"headers": {"x-fake-fault": "latency=20000"}, "timeout_s": 60}},
        ),
        tmp_path,
    )
    assert (config.stores.budgets, config.stores.ledger_durability) == ("memory://", "normal")
    path, log = _write(config, tmp_path), tmp_path / "gateway.log"
    fake[1].reset()
    with serving(path, log) as (proc, url):
        tasks = await _fire(url, 20)
        deadline = time.monotonic() + 20
        while fake[1].stats()["in_flight"] < 20:
            assert time.monotonic() < deadline, fake[1].stats()
            await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    in_flight = await rows(tmp_path)
    assert len(in_flight) == 20 and {e.state for e in in_flight} == {"reserved"}
    held = sum(e.reserved_cost_micros for e in in_flight)
    one = in_flight[0].reserved_cost_micros
    assert one > 0
    # room for the 20 lost holds and half of one more: only rebuilt counters refuse
    budget_usd = (held + one // 2) / 1_000_000
    path = _write(_default_stores(config, tmp_path, usd_per_day=budget_usd), tmp_path)
    fake[1].reset()
    with serving(path, log) as (_proc, url):
        events = await rows(tmp_path)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            body = {"model": "fake-model", "messages": [{"role": "user", "content": "wait"}]}
            refused = await client.post("/v1/chat/completions", json=body)
            metrics = (await client.get("/metrics")).text
    assert len(events) == 20
    assert {(e.state, e.reconciliation_reason) for e in events} == {
        ("usage_reconciliation_required", "gateway_lost")
    }
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "budget_exhausted"
    assert "ncap_reservations_outstanding 20.0" in metrics
    assert fake[1].stats()["requests"] == 0  # refused before dispatch
    # a fresh budget of the same size admits it: the refusal came from the 20 holds
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    path = _write(_default_stores(config, fresh, usd_per_day=budget_usd), fresh)
    fake[1].reset()
    with serving(path, log) as (_proc, url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            task = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            deadline = time.monotonic() + 20
            while fake[1].stats()["requests"] < 1:
                assert time.monotonic() < deadline and not task.done(), fake[1].stats()
                await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
