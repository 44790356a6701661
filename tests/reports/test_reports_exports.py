from __future__ import annotations

import ncap.reports
import ncap.testing

EXPORTED = {
    "STEPS",
    "Alert",
    "DenialRow",
    "DistributionRow",
    "ChoiceCost",
    "ExceptionUsage",
    "LedgerSource",
    "MismatchRow",
    "OutputStats",
    "PendingRow",
    "PostgresSource",
    "Report",
    "RouteMismatch",
    "SQLiteSource",
    "ShiftResult",
    "SpendRow",
    "Totals",
    "Window",
    "build_report",
    "day_window",
    "ensure_report_indexes",
    "nearest_rank",
    "population_stability_index",
    "render_html",
    "render_json",
    "render_tables",
    "render_tsv",
    "report_dict",
    "since_window",
    "source_from_url",
}


def test_public_names_are_pinned() -> None:
    assert set(ncap.reports.__all__) == EXPORTED
    assert all(hasattr(ncap.reports, name) for name in EXPORTED)
    assert set(ncap.testing.__all__) == {"LedgerSpec", "generate_ledger", "synthetic_config"}
