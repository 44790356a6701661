"""Alerting and health: store-derived gauges that stay true after another
process changed the ledger and after a restart; budget gauges; the cost counter; route
health; validation refusals by code; the no-key message."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from ncap.config import Config
from ncap.testing.fake_upstream import FakeState
from tests.http.test_accounting import holds, rows
from tests.support import gateway, gateway_config

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
NCAP = [sys.executable, "-m", "ncap.cli.main"]


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in a Prometheus text exposition (None: absent)."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if found == labels:
            return float(m.group(3))
    return None


def scrape(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def _write(config: Config, tmp: Path) -> Path:
    path = tmp / "ncap.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    return path


def test_pending_reconciliation_follows_the_ledger_across_import_and_restart(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    config = gateway_config(
        fake[0],
        tmp_path,
        server={"metrics_cache_s": 0},
        routes={"fake": {"headers": {"x-fake-fault": "missing_usage"}}},
    )
    with gateway(config) as gw:
        for _ in range(4):
            r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
            assert r.status_code == 200
        text = scrape(gw.url)
        assert sample(text, "ncap_pending_reconciliation") == 4
        assert sample(text, "ncap_reservations_outstanding") == 4
        # another process reconciles one of them while this gateway keeps running
        event = next(e for e in asyncio.run(rows(tmp_path)) if e.provider_request_id)
        usage = tmp_path / "usage.jsonl"
        usage.write_text(
            json.dumps(
                {
                    "provider_request_id": event.provider_request_id,
                    "prompt_tokens": 9,
                    "completion_tokens": 3,
                }
            )
            + "\n"
        )
        cfg_path = _write(config, tmp_path)
        done = subprocess.run(
            [*NCAP, "reconcile", "import", str(usage), "--config", str(cfg_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        text = scrape(gw.url)
        assert sample(text, "ncap_pending_reconciliation") == 3
        assert sample(text, "ncap_reservations_outstanding") == 3
    assert len(asyncio.run(holds(tmp_path))) == 3
    with gateway(config) as restarted:  # a new process: nothing counted in memory yet
        text = scrape(restarted.url)
        assert sample(text, "ncap_pending_reconciliation") == 3
        assert sample(text, "ncap_reservations_outstanding") == 3


def test_budget_gauges_and_the_cost_counter(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    fake[1].reset()
    config = gateway_config(
        fake[0],
        tmp_path,
        server={"metrics_cache_s": 0},
        workloads={"default": {"tokens_per_day": 100000, "usd_per_day": 2.5}},
        exceptions=[
            {
                "id": "eval-8",
                "workload": "default",
                "owner": "finops@example.com",
                "max_candidates": 8,
                "budget_usd": 1.0,
                "expires": "2099-01-01T00:00:00Z",
            }
        ],
    )
    with gateway(config) as gw:
        url = gw.url + "/v1/chat/completions"
        assert httpx.post(url, json={**BODY, "n": 2}, timeout=10).status_code == 200
        assert httpx.post(url, json={**BODY, "n": 6}, timeout=10).status_code == 200
        text = scrape(gw.url)
    settled = [e for e in asyncio.run(rows(tmp_path)) if e.state == "settled"]
    cost = sum(e.cost_micros or 0 for e in settled)
    tokens = sum(e.total_tokens or 0 for e in settled)
    assert cost > 0
    assert sample(text, "ncap_cost_micros_total", workload="default", route="fake") == cost
    w = {"workload": "default"}
    assert sample(text, "ncap_budget_limit", **w, window="tokens_day") == 100000
    assert sample(text, "ncap_budget_limit", **w, window="usd_micros_day") == 2_500_000
    assert sample(text, "ncap_budget_limit", **w, window="concurrency") == 32
    assert sample(text, "ncap_budget_limit", **w, window="tokens_minute") is None  # unlimited
    assert sample(text, "ncap_budget_spent", **w, window="tokens_day") == tokens
    assert sample(text, "ncap_budget_spent", **w, window="usd_micros_day") == cost
    assert sample(text, "ncap_budget_reserved", **w, window="usd_micros_day") == 0
    ex = {"exception": "eval-8", "workload": "default"}
    n6 = next(e for e in settled if e.exception_id == "eval-8")
    assert sample(text, "ncap_exception_budget_limit_micros", **ex) == 1_000_000
    assert sample(text, "ncap_exception_budget_spent_micros", **ex) == n6.cost_micros
    assert sample(text, "ncap_exception_active", **ex) == 1


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: connections are refused


def test_route_health_and_its_log_line(
    fake: tuple[str, FakeState], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake[1].reset()
    dead = f"http://127.0.0.1:{_dead_port()}/v1"
    config = gateway_config(
        fake[0],
        tmp_path,
        models={"fake-model": ["dead", "fake"]},
        routes={
            "dead": {
                "provider": "openai",
                "base_url": dead,
                "retries": 1,
                "backoff_s": 0.01,
                "timeout_s": 2,
            }
        },
    )
    caplog.set_level(logging.WARNING, logger="ncap")
    with gateway(config) as gw:
        for _ in range(2):
            r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
            assert r.status_code == 200 and r.headers["x-ncap-route"] == "fake"
        text = scrape(gw.url)
    assert sample(text, "ncap_route_up", route="dead") == 0
    assert sample(text, "ncap_route_up", route="fake") == 1
    assert sample(text, "ncap_route_failures_total", route="dead", reason="connection") == 4
    assert sample(
        text, "ncap_route_last_failure_timestamp_seconds", route="dead", reason="connection"
    )
    # each failed attempt is one line, from the lifecycle (it knows the request id and
    # workload); the health wrapper does not log it a second time
    lines = [(r.name, r.getMessage()) for r in caplog.records]
    assert len(lines) == 4 and {name for name, _ in lines} == {"ncap.lifecycle"}
    assert all(
        "workload=default route=dead" in m and "reason=refused outcome=rejected" in m  # never left
        for _, m in lines
    )


def test_route_health_follows_whole_answers_and_streams(
    fake: tuple[str, FakeState], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A route's health moves with each attempt, whole or streamed: a 5xx counts and
    the retry that answers brings the route back (logged once); a stream the upstream
    cuts mid-way, or whose events cannot be read, counts as the route's failure; a 400
    about the request is an answer."""
    fake[1].reset()
    plain = (
        gateway_config(fake[0], tmp_path).routes["fake"].model_dump(mode="json", exclude_none=True)
    )
    faults = {
        "flaky": {
            "x-fake-fault": "error_500",
            "x-fake-fail-times": "1",
            "x-fake-fail-key": uuid.uuid4().hex,
        },
        "cut": {"x-fake-fault": "reset_mid_stream=3"},
        "garbled": {"x-fake-fault": "malformed_json"},
        "refuses": {"x-fake-fault": "server_error_400"},
    }
    routes = {name: {**plain, "retries": 1, "headers": h} for name, h in faults.items()}
    config = gateway_config(
        fake[0], tmp_path, models={name: [name] for name in faults}, routes=routes
    )
    caplog.set_level(logging.WARNING, logger="ncap.health")
    with gateway(config) as gw:
        url = gw.url + "/v1/chat/completions"

        def post(model: str, **extra: object) -> httpx.Response:
            return httpx.post(url, json={**BODY, "model": model, **extra}, timeout=10)

        assert post("flaky").status_code == 200
        cut = post("cut", stream=True)
        assert cut.status_code == 200 and '"error"' in cut.text
        post("garbled", stream=True)
        assert post("refuses").status_code == 400
        text = scrape(gw.url)

    def failures(route: str) -> dict[str, float]:
        found = {}
        for reason in ("timeout", "connection", "status_429", "status_5xx", "protocol"):
            value = sample(text, "ncap_route_failures_total", route=route, reason=reason)
            if value:
                found[reason] = value
        return found

    assert sample(text, "ncap_route_up", route="flaky") == 1
    assert failures("flaky") == {"status_5xx": 1}
    assert [r.getMessage() for r in caplog.records if r.name == "ncap.health"] == [
        "route flaky answers again"
    ]
    assert sample(text, "ncap_route_up", route="cut") == 0
    assert failures("cut") == {"connection": 1}
    assert sample(text, "ncap_route_up", route="garbled") == 0
    assert failures("garbled") == {"protocol": 1}
    assert sample(text, "ncap_route_up", route="refuses") == 1
    assert failures("refuses") == {}


def test_validation_refusals_by_code_and_the_missing_key_message(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    config = gateway_config(
        fake[0],
        tmp_path,
        keys=[{"hash": "sha256:" + "0" * 64, "workload": "default"}],
    )
    with gateway(config) as gw:
        url = gw.url + "/v1/chat/completions"
        no_key = httpx.post(url, json=BODY, timeout=10)
        assert no_key.status_code == 401
        assert no_key.json()["error"]["message"].startswith("You didn't provide an API key.")
        assert no_key.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.post(url, json=BODY, headers={"Authorization": "Bearer nope"}, timeout=10)
        assert wrong.json()["error"]["message"] == "Incorrect API key provided."
    config = gateway_config(fake[0], tmp_path / "open")
    with gateway(config) as gw:
        url = gw.url + "/v1/chat/completions"
        for extra in ({"best_of": 3}, {"candidate_count": 2}, {"colour": "red"}, {"n": 0}):
            assert httpx.post(url, json={**BODY, **extra}, timeout=10).status_code == 400
        text = scrape(gw.url)
    refusals = "ncap_validation_refusals_total"
    assert sample(text, refusals, code="unknown_parameter", multi_candidate="true") == 2
    assert sample(text, refusals, code="unknown_parameter", multi_candidate="false") == 1
    assert sample(text, refusals, code="invalid_value", multi_candidate="false") == 1
