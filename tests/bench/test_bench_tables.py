"""Each benchmark turns what it measured into the tables its result envelope carries.

The benchmarks themselves take minutes to hours and are not run here; their table
builders are, on small results shaped like the ones they record.
"""

from __future__ import annotations

import argparse
import cProfile
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import benchlib as bl  # noqa: E402
import export_bench  # noqa: E402
import fuzz_pass  # noqa: E402
import gateway_bench  # noqa: E402
import instructions  # noqa: E402
import ledger_check  # noqa: E402
import stream_bench  # noqa: E402


def _point(target: str, c: int, rps: float) -> dict[str, Any]:
    keys = ["p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms", "rss_mib", "cpu_ms_per_req"]
    return {
        "target": target,
        "concurrency": c,
        "throughput_rps": rps,
        "errors": 0,
        "foreign_cpu_share": 0.02,
        **dict.fromkeys(keys, 1.5),
    }


def test_gateway_tables_give_each_target_against_bare() -> None:
    rows = [_point(t, c, rps) for t, rps in (("bare", 4000.0), ("ncap", 1600.0)) for c in (1, 16)]
    tables = gateway_bench.tables(rows, {"16": {"ncap_over_litellm": 19.0}}, {"litellm": "absent"})
    summary, every, ratios = tables
    assert [r[0] for r in summary.rows] == ["bare", "ncap"]
    assert summary.rows[1][2] == "1600.0 (0.40×)"
    assert len(every.rows) == 4 and len(every.columns) == len(every.rows[0])
    assert "skipped litellm: absent" in every.notes
    assert ratios.rows == [["16", "ncap_over_litellm=19.0"]]


def test_gateway_rounds_give_each_round_against_bare_and_direct_of_the_same_round() -> None:
    rounds = {
        ("direct", 1): ([3000.0, 2000.0], [0.30, 0.40]),
        ("bare", 1): ([1200.0, 1000.0], [0.70, 0.90]),
        ("ncap", 1): ([900.0, 800.0], [0.95, 1.00]),
        ("bare", 64): ([2000.0, 3000.0], [20.0, 18.0]),
        ("ncap", 64): ([1800.0, 2100.0], [22.0, 24.0]),
    }
    rows = []
    for (target, c), (rps, p50) in rounds.items():
        row = _point(target, c, rps[0])
        row.update(throughput_each_round=rps, p50_each_round=p50)
        rows.append(row)
    table = gateway_bench.rounds_table(rows)
    assert table is not None
    assert table.rows == [
        ["ncap", 1, "0.75, 0.80", "0.78", "0.650, 0.600"],
        ["ncap", 64, "0.90, 0.70", "0.8", "n/a"],
    ]
    assert table in gateway_bench.tables(rows, {}, {})
    # rows measured without rounds (an older result) add no such table
    assert gateway_bench.rounds_table([_point("ncap", 16, 1.0), _point("bare", 16, 2.0)]) is None


def test_stream_tables_summary_evidence_then_rounds_with_what_was_not_measured() -> None:
    row = {"scenario": "n1x500", "target": "ncap", "cpu_us_per_chunk": 7.07, "x_bare": 2.41}
    row |= {"ttfb_p50_ms_c1": 15.0, "added_ttfb_ms_c1": -4.1, "note": "shipped"}
    other = {**row, "x_bare": 1.9, "added_ttfb_ms_c1": 0.5}
    ab = {"pairs": 3, "cpu_us_per_chunk": {"ncap": [5.0, 5.2, 4.8], "off": [4.0]}}
    result = {"rounds": [[row], [other]], "skipped": {"portkey": "did not start"}}
    result["evidence_ab"] = ab | {"overhead": 0.25}
    summary, evidence, first, second = stream_bench.result_tables(result)
    assert summary.rows == [["n1x500", "ncap", "1.90 – 2.41", "-4.10 – 0.50", "–"]]
    assert evidence.rows[0] == ["ncap", 5.0, 4.8, 5.2] and "+25.0%" in evidence.notes
    assert (first.title, second.title) == ("Round 1", "Round 2")
    assert first.rows[0][:4] == ["n1x500", "ncap", 7.07, 2.41]
    assert first.rows[0][4] == "15.0 (-4.1)"
    assert first.rows[0][5] == "None (–)"
    assert "portkey: did not start" in first.notes


def test_instruction_counts_are_given_against_bare() -> None:
    rows = [
        {"setup": "bare", "instructions_per_request": 571_000, "errors": 0},
        {"setup": "ncap", "instructions_per_request": 1_813_000, "errors": 0},
    ]
    args = argparse.Namespace(concurrency=8, requests=2000, warm=400)
    table = instructions.table(rows, args)
    assert table.rows == [["bare", 571_000, 1.0, 0], ["ncap", 1_813_000, 3.18, 0]]
    assert "c=8" in table.title


def test_export_table_has_a_row_per_timed_command() -> None:
    run = {"command": "ncap ledger export --format csv", "wall_s": 20.0, "cpu_s": 18.0}
    audit = {"command": "ncap audit --since 7d", "wall_s": 5.0, "cpu_s": 4.0, "bytes": 10}
    results = {"rows": 1000, "generate_s": 1.0, "csv": run | {"bytes": 99, "lines": 1001}}
    results |= {"audit_7d": audit | {"requests": 358}}
    table = export_bench.table(results)
    assert table.rows == [
        ["ncap ledger export --format csv", 20.0, 18.0, 99, 1001],
        ["ncap audit --since 7d", 5.0, 4.0, 10, 358],
    ]
    assert "1,000-row" in table.title


def test_ledger_table_shows_what_was_sent_and_what_the_books_hold() -> None:
    result = {
        "requests_sent": 5001,
        "answered_200": 5001,
        "ledger_rows": 5001,
        "ledger_rows_by_state": {"settled": 5001},
        "throughput_rps": 879.0,
        "ledger_sums": {"tokens_day": 150030},
        "budget_counters": {"tokens_day": 150030, "held": 0},
        "ok": True,
    }
    args = argparse.Namespace(requests=5000, concurrency=64, stores="default")
    table = ledger_check.table(result, args)
    assert table.rows[0][0] == 5001 and table.rows[0][-1] is True
    assert len(table.rows[0]) == len(table.columns)


def test_fuzz_table_reads_the_case_counts_and_the_verdict() -> None:
    output = (
        "....\nfuzz cases: 111778 {'bodies': 60000, 'headers': 10000, 'schemathesis': 41778}\n"
        ".\n5 passed in 787.12s (0:13:07)\n"
    )
    table = fuzz_pass.result_table(output, 0, 790.0, 10)
    assert table.rows == [["bodies", 60000], ["headers", 10000], ["schemathesis", 41778]]
    assert "5 passed in 787.12s" in table.notes and "111778 cases" in table.notes
    failed = fuzz_pass.result_table("1 failed, 4 passed in 3.0s\n", 1, 3.0, 1)
    assert failed.rows == [] and "1 failed, 4 passed" in failed.notes and "exit 1" in failed.notes


def _busy() -> int:
    return sum(i * i for i in range(20_000))


def test_profile_table_lists_the_top_functions_by_own_time(tmp_path: Path) -> None:
    profile = cProfile.Profile()
    profile.runcall(_busy)
    dump = tmp_path / "run.prof"
    profile.dump_stats(dump)
    table = bl.profile_table(dump, "top", count=3)
    assert 0 < len(table.rows) <= 3
    own = [row[2] for row in table.rows]
    assert own == sorted(own, reverse=True)
    assert any("_busy" in row[0] or "genexpr" in row[0] for row in table.rows)


def test_flat_table_joins_nested_keys() -> None:
    table = bl.flat_table("t", {"a": 1, "b": {"c": 2, "d": [1, 2]}, "e": {}})
    assert table.rows == [["a", 1], ["b.c", 2], ["b.d", "[1, 2]"], ["e", "{}"]]


def test_the_command_line_is_shown_relative_to_the_repository() -> None:
    argv = [str(ROOT / "bench" / "rss_check.py"), "--small", "20000"]
    assert bl.command_line(argv) == "python bench/rss_check.py --small 20000"
