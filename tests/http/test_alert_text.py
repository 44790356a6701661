"""Alert amounts are exact (micro-USD), in the webhook text and in the report; an
undelivered alert's log line names the workload whose budget it is."""

from __future__ import annotations

import logging
import socket
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ncap.domain.grants import Grants
from ncap.http.alerts import BudgetAlerter, alert_text
from ncap.metrics import Metrics
from ncap.reports.admin_tables import _alert
from ncap.stores.memory.admin import MemoryAdminStore
from ncap.stores.memory.budgets import MemoryBudgetStore
from ncap.stores.ports import BudgetAlertRow
from tests.support import gateway_config

AT = datetime(2026, 12, 1, 14, 3, tzinfo=UTC)


def test_alert_text_keeps_the_micro_dollars() -> None:
    row = BudgetAlertRow("eval", "exception", "life", 80, AT, 16_385, 20_000)
    text = alert_text(row)
    assert "$0.016385 of $0.020000" in text
    assert "refuses" not in text  # 81.9 % crossed 80 % by spending
    assert "USD 0.02 of 0.02" not in text


def test_report_alert_message_keeps_the_micro_dollars() -> None:
    alert = _alert("eval", "exception", "life", 80, AT.isoformat(), 16_385, 20_000, 1)
    assert "$0.016385 of $0.020000" in alert.message


async def test_an_undelivered_alert_is_logged_with_its_workload(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # closed again: connections are refused
    config = gateway_config(
        "http://127.0.0.1:9/v1",
        tmp_path,
        alerts={"webhook_url": f"http://127.0.0.1:{dead}/hook", "retries": 0},
    )
    metrics = Metrics()
    alerter = BudgetAlerter(
        config, Grants.from_config(config), MemoryBudgetStore(), MemoryAdminStore(), metrics=metrics
    )
    row = BudgetAlertRow("eval", "exception", "life", 80, AT, 16_385, 20_000, workload="ranker")
    with caplog.at_level(logging.WARNING, logger="ncap.alerts"):
        assert await alerter._post(row) is False
    await alerter.drain()
    line = next(r.getMessage() for r in caplog.records if "not delivered" in r.getMessage())
    assert "workload=ranker" in line and "subject=eval" in line
    failures = metrics.registry.get_sample_value(
        "ncap_budget_alert_webhook_failures_total", {"window": "exception"}
    )
    assert failures == 1
