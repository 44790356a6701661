"""An exception revoked through the admin API reads ``revoked`` in every report view:
``ncap audit`` (JSON and table), ``/dashboard/report.json`` and the dashboard page."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

import yaml
from typer.testing import CliRunner

from ncap.cli.main import app
from ncap.config import ExceptionGrant, parse_config
from ncap.http.dashboard import _build
from ncap.stores import open_report_source
from ncap.stores.ports import AdminChange
from ncap.stores.sqlite.admin import SQLiteAdminStore
from ncap.testing.ledger_gen import LedgerSpec, generate_ledger, synthetic_config

runner = CliRunner()


def _ledger_with_revocations(tmp_path: Path) -> tuple[datetime, Path]:
    spec = LedgerSpec(rows=2000, days=7, seed=4)
    ledger, cfg = tmp_path / "l.db", tmp_path / "ncap.yaml"
    generate_ledger(ledger, spec)
    cfg.write_text(yaml.safe_dump(synthetic_config(spec, ledger)))
    made = ExceptionGrant.model_validate(
        {
            "id": "admin-made",
            "workload": "ranker",
            "owner": "ops@example.com",
            "max_candidates": 2,
            "expires": (datetime.now(UTC) + timedelta(days=9)).isoformat(),
        }
    )

    at = datetime.now(UTC) - timedelta(minutes=5)

    async def revoke() -> None:
        store = SQLiteAdminStore(ledger)
        await store.record(AdminChange("ops", "create", "exception", "admin-made", made), at)
        await store.record(AdminChange("ops", "revoke", "exception", "admin-made"), at)
        await store.record(AdminChange("ops", "revoke", "exception", "eval-q4"), at)
        await store.close()

    asyncio.run(revoke())
    return at, cfg


def test_revoked_exceptions_are_revoked_in_audit_json_table_and_dashboard(
    tmp_path: Path,
) -> None:
    _, cfg = _ledger_with_revocations(tmp_path)
    result = runner.invoke(app, ["audit", "--since", "7d", "--format", "json", "-c", str(cfg)])
    assert result.exit_code == 0, result.output
    status = {e["id"]: e["status"] for e in json.loads(result.stdout)["exceptions"]}
    assert status == {
        "eval-q4": "revoked",
        "admin-made": "revoked",
        "brainstorm-3": "expired",
        "ranker-3": "active",
    }
    revoked = next(e for e in json.loads(result.stdout)["exceptions"] if e["id"] == "eval-q4")
    assert revoked["revoked_at"] is not None
    table = runner.invoke(app, ["audit", "--since", "7d", "-c", str(cfg)])
    assert table.exit_code == 0
    eval_line = next(line for line in table.stdout.splitlines() if "eval-q4" in line)
    assert "revoked" in eval_line and "active" not in eval_line
    # the dashboard (page and report.json) builds the same report
    config = parse_config(cfg.read_text())
    report = _build(
        config, timedelta(days=7), partial(open_report_source, config.stores.ledger)
    ).report
    assert {e.id: e.status for e in report.exceptions}["eval-q4"] == "revoked"


def test_a_revocation_after_the_window_does_not_apply_to_it(tmp_path: Path) -> None:
    revoked_at, cfg = _ledger_with_revocations(tmp_path)
    until = (revoked_at - timedelta(days=1)).date().isoformat()  # the day before
    result = runner.invoke(
        app, ["report", "daily", "--date", until, "--format", "json", "-c", str(cfg)]
    )
    assert result.exit_code == 0, result.output
    status = {e["id"]: e["status"] for e in json.loads(result.stdout)["exceptions"]}
    assert status["eval-q4"] == "active"
