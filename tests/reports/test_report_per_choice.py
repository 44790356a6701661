"""The cost-per-choice section against hand-computed values: only attempts with
``output_tokens_per_choice`` count; rows with only a total are left out."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

from ncap.config import Pricing, utcnow
from ncap.domain.events import LedgerEvent
from ncap.reports import Report, SQLiteSource, build_report, day_window, since_window
from ncap.stores.sqlite.report_indexes import PER_CHOICE_INDEX
from ncap.testing import LedgerSpec, generate_ledger

from .conftest import Backend

T = datetime(2026, 11, 10, 12, tzinfo=UTC)


def _row(rid: str, route: str, per_choice: tuple[int, ...] | None, cost: int) -> LedgerEvent:
    total = sum(per_choice) if per_choice else 30
    return LedgerEvent(
        timestamp=T,
        request_id=rid,
        attempt=1,
        workload_id="w",
        environment="production",
        route_id=route,
        effective_candidate_count=len(per_choice) if per_choice else 3,
        returned_candidate_count=len(per_choice) if per_choice else 3,
        input_tokens=10,
        output_tokens_total=total,
        total_tokens=10 + total,
        cost_micros=cost,
        state="settled",
        usage_source="provider_response",
        output_tokens_per_choice=per_choice,
    )


async def test_cost_per_choice(backend: Backend) -> None:
    await backend.write(
        [
            _row("a", "local", (10, 20, 30), 600),  # 3 choices
            _row("b", "local", (40, 50), 400),  # 2 choices
            _row("c", "remote", None, 999),  # only a total: not in the section
            _row("d", "emulated", (7,), 70),
        ]
    )

    def build() -> Report:
        # a PostgreSQL source runs its own loop: off this test's loop, as the dashboard
        source = backend.open_source()
        try:
            return build_report(
                source,
                day_window(date(2026, 11, 10)),
                pricing={"local": Pricing(output_per_mtok=2.0)},
            )
        finally:
            source.close()

    report = await asyncio.to_thread(build)
    by_route = {c.route_id: c for c in report.per_choice}
    assert set(by_route) == {"local", "emulated"}
    local = by_route["local"]
    # tokens 10,20,30,40,50: mean 30; nearest rank p50 = ceil(2.5)=3rd = 30, p95 = 5th = 50
    assert (local.attempts, local.choices) == (2, 5)
    assert (local.tokens_mean, local.tokens_p50, local.tokens_p95, local.tokens_max) == (
        30,
        30,
        50,
        50,
    )
    assert local.cost_per_choice_micros == 200  # (600 + 400) / 5
    assert local.output_cost_p95_micros == 100  # 50 tokens x 2 USD per Mtok = 100 µ$
    emulated = by_route["emulated"]
    assert (emulated.choices, emulated.tokens_p95, emulated.cost_per_choice_micros) == (1, 7, 70)
    assert emulated.output_cost_p95_micros is None  # no price given for it


def test_generated_ledger_has_the_section_and_its_index(tmp_path: Path) -> None:
    path = tmp_path / "g.db"
    generate_ledger(path, LedgerSpec(rows=3000, days=3, seed=5))
    with sqlite3.connect(path) as conn:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        rows = conn.execute(
            "SELECT output_tokens_per_choice, output_tokens_total, returned_candidate_count"
            " FROM ledger_events WHERE output_tokens_per_choice IS NOT NULL"
        ).fetchall()
    assert PER_CHOICE_INDEX in names
    assert rows
    for text, total, returned in rows:  # one count per returned choice, adding up
        counts = [int(t) for t in text.split(",")]
        assert len(counts) == returned and sum(counts) == total
    source = SQLiteSource(path)
    try:
        report = build_report(source, since_window(timedelta(days=3), utcnow()))
    finally:
        source.close()
    assert {c.route_id for c in report.per_choice} == {"local-smollm2", "emulated-chat"}
    assert all(c.choices >= c.attempts for c in report.per_choice)
