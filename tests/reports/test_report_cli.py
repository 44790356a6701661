"""``ncap audit``, ``ncap report daily`` and ``ncap ledger generate`` end to end (CliRunner)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ncap.cli.main import app
from ncap.config import parse_config
from ncap.reports import SQLiteSource, build_report, day_window
from ncap.stores import SQLiteLedgerStore
from ncap.testing.ledger_gen import LedgerSpec, generate_ledger, synthetic_config

from .test_report_fixed import EVENTS

runner = CliRunner()


@pytest.fixture
def fixed_ledger(tmp_path: Path) -> Path:
    path = tmp_path / "fixed.db"

    async def write() -> None:
        store = SQLiteLedgerStore(path)
        for event in EVENTS:
            await store.append(event)
        await store.close()

    asyncio.run(write())
    return path


def test_report_daily_json_on_the_fixed_ledger(fixed_ledger: Path) -> None:
    result = runner.invoke(
        app,
        [
            "report",
            "daily",
            "--date",
            "2026-11-10",
            "--format",
            "json",
            "--ledger",
            f"sqlite:///{fixed_ledger}",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["kind"] == "daily"
    assert data["totals"]["requests"] == 10 and data["totals"]["denied_requests"] == 3
    assert data["pending_total"]["reserved_cost_micros"] == 6700
    assert data["output"][0]["p95"] == 800
    assert "\x1b[" not in result.stdout  # no progress bar or colour when not a terminal


def test_report_daily_table_and_html(fixed_ledger: Path) -> None:
    url = f"sqlite:///{fixed_ledger}"
    table = runner.invoke(app, ["report", "daily", "--date", "2026-11-10", "--ledger", url])
    assert table.exit_code == 0, table.output
    assert "requested-candidate distribution" in table.stdout
    assert "candidate_count_exceeds_policy" in table.stdout
    html = runner.invoke(
        app, ["report", "daily", "--date", "2026-11-10", "--format", "html", "--ledger", url]
    )
    assert html.exit_code == 0
    assert html.stdout.lstrip().startswith("<!doctype html>")
    assert "http://" not in html.stdout.replace("http://www.w3.org/2000/svg", "")
    assert "<script" not in html.stdout


def test_bad_arguments_are_reported_not_raised(fixed_ledger: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{fixed_ledger}"
    assert runner.invoke(app, ["audit", "--format", "pdf", "--ledger", url]).exit_code == 2
    assert runner.invoke(app, ["audit", "--since", "soon", "--ledger", url]).exit_code == 2
    assert (
        runner.invoke(app, ["report", "daily", "--date", "11/10", "--ledger", url]).exit_code == 2
    )
    missing = runner.invoke(app, ["audit", "--ledger", f"sqlite:///{tmp_path}/none.db"])
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_generate_then_audit_with_the_written_config(tmp_path: Path) -> None:
    out, cfg = tmp_path / "gen.db", tmp_path / "gen.yaml"
    result = runner.invoke(
        app, ["ledger", "generate", "--rows", "3000", "--out", str(out), "--write-config", str(cfg)]
    )
    assert result.exit_code == 0, result.output
    assert sqlite3.connect(out).execute("SELECT COUNT(*) FROM ledger_events").fetchone() == (3000,)
    again = runner.invoke(app, ["ledger", "generate", "--rows", "10", "--out", str(out)])
    assert again.exit_code == 2  # never overwrites a ledger
    audit = runner.invoke(app, ["audit", "--since", "7d", "--format", "json", "-c", str(cfg)])
    assert audit.exit_code == 0, audit.output
    data = json.loads(audit.stdout)
    assert {e["id"] for e in data["exceptions"]} == {"eval-q4", "brainstorm-3", "ranker-3"}


def test_generated_ledger_has_what_the_report_looks_for(tmp_path: Path) -> None:
    end = datetime(2026, 11, 20, tzinfo=UTC)
    spec = LedgerSpec(rows=15_000, days=14, end=end, seed=3, shift_day=date(2026, 11, 17))
    path = tmp_path / "g.db"
    assert generate_ledger(path, spec) == 15_000
    config = parse_config(yaml.safe_dump(synthetic_config(spec, path)))
    source = SQLiteSource(path)
    try:
        shifted = build_report(
            source,
            day_window(date(2026, 11, 17)),  # the shift day against the day before
            kind="daily",
            exceptions=config.exceptions,
            thresholds=config.reports.thresholds,
            now=end,
        )
        steady = build_report(
            source,
            day_window(date(2026, 11, 18)),  # the day after: the new mix is the norm
            kind="daily",
            exceptions=config.exceptions,
            thresholds=config.reports.thresholds,
            now=end,
        )
    finally:
        source.close()
    by = {s.workload_id: s for s in shifted.shift}
    assert by["support-draft"].status == "shift"  # the n=2 client change
    assert {s.workload_id: s.status for s in steady.shift}["support-draft"] == "stable"
    reasons = {d.reason for d in shifted.denials}
    assert {"candidate_count_exceeds_policy", "output_ceiling_exceeds_policy"} <= reasons
    assert {p.state for p in shifted.pending} == {"pending", "usage_reconciliation_required"}
    assert {m.kind for m in shifted.mismatches} >= {"omitted_normalized", "fewer_returned"}
    grants = {e.id: e for e in shifted.exceptions}
    assert grants["brainstorm-3"].status == "expired"
    assert grants["brainstorm-3"].requests_after_expiry > 0
    assert shifted.totals.attempts > shifted.totals.requests - shifted.totals.denied_requests
    assert shifted.window.end - shifted.window.start == timedelta(days=1)


def test_a_file_that_is_not_a_ledger_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.db"
    bogus.write_bytes(b"not a database at all" * 100)
    result = runner.invoke(app, ["audit", "--ledger", f"sqlite:///{bogus}"])
    assert result.exit_code == 2 and "cannot be read" in result.output
    assert "Traceback" not in result.output
