"""``ncap ledger export`` on a SQLite ledger streams rows from one statement (no event
object per row; SQLite builds the CSV cells); its CSV and JSONL must be byte for byte
what the event path writes, on a generated ledger plus rows with every unusual cell
(per-choice tokens, an unknown finish reason, a stream, nulls, sub-second and
whole-second timestamps), with and without a window."""

from __future__ import annotations

import asyncio
import csv
import io
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ncap.cli.ledger import CSV_COLUMNS, CSV_SELECT, _plain, csv_row, write_csv, write_jsonl
from ncap.domain.events import LedgerEvent
from ncap.stores import SQLiteLedgerStore
from ncap.stores.sqlite.ledger import export_rows
from ncap.testing.ledger_gen import LedgerSpec, generate_ledger

AT = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
ODD = [
    LedgerEvent(
        timestamp=AT,  # a whole second: isoformat writes no fraction
        request_id="odd-1",
        attempt=1,
        workload_id="w",
        environment="production",
        route_id="local",
        requested_candidate_count=3,
        effective_candidate_count=3,
        returned_candidate_count=3,
        output_tokens_total=30,
        output_tokens_per_choice=(12, 8, 10),
        finish_reasons={"stop": 2, "eos_token": 1},
        stream_mode=True,
        cost_micros=0,
        state="settled",
        latency_ms=12.5,
    ),
    LedgerEvent(
        timestamp=AT + timedelta(microseconds=7),
        request_id="odd-2",
        attempt=0,
        workload_id='quote"and,comma',
        environment="staging",
        policy_result="deny",
        policy_reason="budget_exhausted",
        state="denied",
        denied_by="usd_micros_day",
        denied_limit=100,
        denied_amount=250,
    ),
]


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("export") / "l.db"
    generate_ledger(path, LedgerSpec(rows=3000, days=3, end=AT, seed=2))

    async def add() -> None:
        store = SQLiteLedgerStore(path)
        for event in ODD:
            await store.append(event)
        await store.close()

    asyncio.run(add())
    return path


def _slow(path: Path, fmt: str, since: datetime | None, until: datetime | None) -> str:
    async def events() -> list[LedgerEvent]:
        store = SQLiteLedgerStore(path)
        try:
            return [e async for e in store.export(since, until)]
        finally:
            await store.close()

    out = io.StringIO()
    if fmt == "csv":
        writer = csv.DictWriter(out, fieldnames=list(CSV_COLUMNS))
        writer.writeheader()
        for event in asyncio.run(events()):
            writer.writerow(csv_row(event))
    else:
        for event in asyncio.run(events()):
            out.write(json.dumps(_plain(event)) + "\n")
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
@pytest.mark.parametrize(
    "window", [(None, None), (AT - timedelta(days=1), AT + timedelta(microseconds=7))]
)
def test_the_streamed_export_is_the_event_export_byte_for_byte(
    ledger: Path, fmt: str, window: tuple[datetime | None, datetime | None]
) -> None:
    fast = io.StringIO()
    if fmt == "csv":
        write_csv(export_rows(ledger, *window, select=CSV_SELECT), fast)
    else:
        write_jsonl(export_rows(ledger, *window), fast)
    slow = _slow(ledger, fmt, *window)
    assert fast.getvalue() == slow
    assert slow.count("\n") > 500
    if window == (None, None):
        assert "odd-1" in slow and "odd-2" in slow
        assert ("12 8 10" if fmt == "csv" else "[12, 8, 10]") in slow
