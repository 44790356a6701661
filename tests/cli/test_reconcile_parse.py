"""Reconciliation files: JSONL or CSV, keyed by provider request id, problems by line."""

from __future__ import annotations

from pathlib import Path

import pytest

from ncap.cli.ledger import parse_reconciliation
from ncap.domain.events import ReconciliationRow
from ncap.errors import ConfigError


def test_csv_with_provider_column_names(tmp_path: Path) -> None:
    path = tmp_path / "usage.csv"
    path.write_text(
        "provider_request_id,prompt_tokens,completion_tokens,cached_tokens,cost_usd\n"
        "req_a,100,250,20,0.0012\n"
        "req_b,7,9,,\n"
    )
    assert parse_reconciliation(path) == [
        ReconciliationRow("req_a", 100, 250, cached_input_tokens=20, cost_micros=1200),
        ReconciliationRow("req_b", 7, 9),
    ]


def test_jsonl_rows(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    path.write_text(
        '{"provider_request_id": "req_a", "input_tokens": 1, "output_tokens": 2}\n\n'
        '{"provider_request_id": "req_b", "input_tokens": 3, "output_tokens": 4, '
        '"reasoning_tokens": 1, "cost_micros": 55}\n'
    )
    rows = parse_reconciliation(path)
    assert [r.provider_request_id for r in rows] == ["req_a", "req_b"]
    assert (rows[1].reasoning_tokens, rows[1].cost_micros) == (1, 55)


def test_every_bad_row_is_reported_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    path.write_text(
        '{"provider_request_id": "ok", "input_tokens": 1, "output_tokens": 2}\n'
        '{"input_tokens": 1, "output_tokens": 2}\n'
        "not json\n"
        '{"provider_request_id": "neg", "input_tokens": -1, "output_tokens": 2}\n'
    )
    with pytest.raises(ConfigError) as info:
        parse_reconciliation(path)
    problems = info.value.problems
    assert len(problems) == 3
    assert [p.split(":")[1] for p in problems] == ["2", "3", "4"]
