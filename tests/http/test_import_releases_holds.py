"""Pending rows by workload and route, with the oldest one's age; and ``ncap reconcile
import`` run beside a gateway whose budget store lives in its own
process (``memory://``): the gateway settles the holds of the rows the import
reconciled, so ``ncap_reservations_outstanding`` and ``ncap_budget_reserved`` drop
without a restart, and the budget counts the imported cost instead of the hold."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import httpx

from ncap.testing.fake_upstream import FakeState
from tests.http.test_accounting import rows
from tests.http.test_operator_metrics import BODY, NCAP, _write, sample, scrape
from tests.support import gateway, gateway_config


def test_import_releases_the_running_gateways_in_memory_holds(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    fake[1].reset()
    config = gateway_config(
        fake[0],
        tmp_path,
        stores={"budgets": "memory://"},
        server={"metrics_cache_s": 0},
        workloads={"default": {"max_candidates": 1, "output_ceiling": 256, "usd_per_day": 5}},
        routes={"fake": {"headers": {"x-fake-fault": "missing_usage"}}},
    )
    with gateway(config) as gw:
        for _ in range(3):
            assert httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10).is_success
        text = scrape(gw.url)
        assert sample(text, "ncap_reservations_outstanding") == 3
        held = sample(text, "ncap_budget_reserved", workload="default", window="usd_micros_day")
        assert held and held > 0
        event = next(e for e in asyncio.run(rows(tmp_path)) if e.provider_request_id)
        usage = tmp_path / "usage.jsonl"
        line = {"provider_request_id": event.provider_request_id, "prompt_tokens": 9}
        usage.write_text(json.dumps(line | {"completion_tokens": 3}) + "\n")
        done = subprocess.run(
            [*NCAP, "reconcile", "import", str(usage), "--config", str(_write(config, tmp_path))],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        text = scrape(gw.url)
        assert sample(text, "ncap_pending_reconciliation") == 2
        assert sample(text, "ncap_reservations_outstanding") == 2
        after = sample(text, "ncap_budget_reserved", workload="default", window="usd_micros_day")
        assert after is not None and after == held * 2 / 3
        spent = sample(text, "ncap_budget_spent", workload="default", window="usd_micros_day")
        assert spent is not None and spent > 0  # the imported cost (9 in, 3 out) counts
        by_route = {"workload": "default", "route": "fake"}
        assert sample(text, "ncap_pending_reconciliation_by_route", **by_route) == 2
        age = sample(text, "ncap_pending_reconciliation_oldest_age_seconds", **by_route)
        assert age is not None and 0 < age < 120
