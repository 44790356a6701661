"""The FinOps side of the CLI: reconcile import names the field (with every accepted
name) and exits non-zero on conflicts or a file that matches nothing; the CSV export is
flat; reconcile list never cuts ids."""

from __future__ import annotations

import asyncio
import csv
import io
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ncap.cli.ledger import CSV_COLUMNS, parse_reconciliation
from ncap.cli.main import app
from ncap.domain.events import LedgerEvent
from ncap.errors import ConfigError
from ncap.stores import SQLiteLedgerStore

LONG_ID = "req-" + "7" * 60  # longer than any 80-column table cell


def _config(tmp: Path) -> Path:
    path = tmp / "ncap.yaml"
    path.write_text(
        f"stores: {{ledger: 'sqlite:///{tmp}/ledger.db', budgets: 'sqlite:///{tmp}/b.db'}}\n"
        "workloads: {default: {}}\nmodels: {m: [r]}\n"
        "routes: {r: {provider: openai, base_url: 'http://x', "
        "pricing: {input_per_mtok: 1, output_per_mtok: 2}}}\n"
    )
    return path


def _seed(tmp: Path) -> None:
    async def go() -> None:
        store = SQLiteLedgerStore(tmp / "ledger.db")
        base = {
            "timestamp": datetime(2026, 12, 1, 9, tzinfo=UTC),
            "workload_id": "default",
            "environment": "production",
            "route_id": "r",
        }
        await store.append(
            LedgerEvent(
                **base,
                request_id=LONG_ID,
                attempt=1,
                provider_request_id="prov-a",
                state="usage_reconciliation_required",
                reconciliation_reason="returned_mismatch",
                reserved_cost_micros=1234,
            )
        )
        await store.append(
            LedgerEvent(
                **base,
                request_id="req-b",
                attempt=1,
                provider_request_id="prov-b",
                input_tokens=10,
                output_tokens_total=30,
                total_tokens=40,
                cost_micros=70,
                finish_reasons={"stop": 2, "length": 1, "weird": 1},
                stream_mode=True,
                state="settled",
                usage_source="provider_stream",
            )
        )
        await store.close()

    asyncio.run(go())


def _import(cfg: Path, file: Path) -> tuple[int, dict[str, object], str]:
    result = CliRunner().invoke(app, ["reconcile", "import", str(file), "--config", str(cfg)])
    summary = json.loads(result.stdout) if result.stdout.strip().startswith("{") else {}
    return result.exit_code, summary, " ".join(result.stderr.split())


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            "provider_request_id,prompt_tokens,completion_tokens\np,seven,1\n",
            "input_tokens (or prompt_tokens): 'seven' is not a whole number of tokens",
        ),
        ("provider_request_id,output_tokens\np,1\n", "input_tokens (or prompt_tokens) is required"),
        (
            "provider_request_id,input_token,output_tokens\np,1,2\n",
            "input_tokens (or prompt_tokens) is required; the row has 'input_token': a "
            "misspelling?",
        ),
        (
            "provider_request_id,input_tokens\np,1\n",
            "output_tokens (or completion_tokens / output_tokens_total) is required",
        ),
        (
            "provider_request_id,input_tokens,prompt_tokens,output_tokens\np,1,2,3\n",
            "input_tokens and prompt_tokens name the same field but disagree",
        ),
        (
            "provider_request_id,input_tokens,output_tokens,cost_usd\np,1,2,lots\n",
            "cost_usd: 'lots' is not an amount of USD",
        ),
        ("input_tokens,output_tokens\n1,2\n", "provider_request_id is required"),
    ],
)
def test_problems_name_the_field_by_every_accepted_name(
    tmp_path: Path, rows: str, message: str
) -> None:
    path = tmp_path / "usage.csv"
    path.write_text(rows)
    with pytest.raises(ConfigError) as info:
        parse_reconciliation(path)
    (problem,) = info.value.problems
    assert problem.startswith(f"{path}:2: {message}"), problem
    code, _, stderr = _import(_config(tmp_path), path)
    assert code == 2 and message in stderr


def test_exit_codes_no_match_then_success_then_conflict(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _seed(tmp_path)
    nothing = tmp_path / "other-ledger.jsonl"
    nothing.write_text(
        '{"provider_request_id": "prov-zzz", "input_tokens": 1, "output_tokens": 1}\n'
    )
    code, summary, stderr = _import(cfg, nothing)
    assert code == 1 and summary["unmatched"] == ["prov-zzz"]
    assert "no row matched a ledger event" in stderr

    good = tmp_path / "usage.csv"
    good.write_text(
        "provider_request_id,prompt_tokens,completion_tokens,model\n"
        "prov-a,100,50,gpt-4o-mini\nprov-b,10,30,gpt-4o-mini\n"
    )
    code, summary, _ = _import(cfg, good)
    assert code == 0 and summary["reconciled"] == ["prov-a"]
    assert summary["not_pending"] == ["prov-b"]
    assert _import(cfg, good)[0] == 0  # idempotent: unchanged

    changed = tmp_path / "usage-v2.csv"
    changed.write_text("provider_request_id,input_tokens,output_tokens\nprov-a,100,55\n")
    code, summary, stderr = _import(cfg, changed)
    assert code == 1 and summary["conflicts"] == ["prov-a"]
    assert (
        f"conflict: prov-a: the ledger has input_tokens=100 output_tokens=50 (reconciled, "
        f"request {LONG_ID}), the file has input_tokens=100 output_tokens=55" in stderr
    )


def test_csv_export_is_flat(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _seed(tmp_path)
    out = CliRunner().invoke(app, ["ledger", "export", "--format", "csv", "--config", str(cfg)])
    assert out.exit_code == 0, out.output
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert tuple(rows[0]) == CSV_COLUMNS and "finish_reasons" not in CSV_COLUMNS
    pending, settled = rows
    assert (settled["finish_stop"], settled["finish_length"], settled["finish_other"]) == (
        "2",
        "1",
        "1",
    )
    assert settled["finish_tool_calls"] == "0"
    assert (settled["stream_mode"], pending["stream_mode"]) == ("true", "false")
    assert (settled["cost_micros"], settled["cost_usd"]) == ("70", "0.000070")
    assert (pending["cost_micros"], pending["cost_usd"]) == ("", "")
    assert (pending["reserved_cost_micros"], pending["reserved_cost_usd"]) == ("1234", "0.001234")
    assert pending["requested_candidate_count"] == ""  # null: the client omitted n
    for row in rows:
        assert not any(cell.startswith(("{", "[")) for cell in row.values())


def test_reconcile_list_never_cuts_ids(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _seed(tmp_path)
    piped = CliRunner().invoke(app, ["reconcile", "list", "--config", str(cfg)])
    assert piped.exit_code == 0
    header, line = piped.stdout.splitlines()
    assert header.split("\t")[:2] == ["timestamp", "request_id"]
    assert line.split("\t")[1] == LONG_ID and line.split("\t")[4] == "prov-a"
    table = CliRunner().invoke(
        app,
        ["reconcile", "list", "--format", "table", "--config", str(cfg)],
        env={"COLUMNS": "80"},
    )
    assert table.exit_code == 0 and LONG_ID in table.stdout


@pytest.mark.parametrize("durability", ["normal", "full"])
def test_reconcile_import_writes_at_the_configured_ledger_durability(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durability: str
) -> None:
    import ncap.cli.ledger as cli_ledger

    seen: list[str] = []
    real = cli_ledger.ledger_from_url

    def recording(url: str, **kw: Any) -> Any:
        seen.append(kw.get("durability", "normal"))
        return real(url, **kw)

    monkeypatch.setattr(cli_ledger, "ledger_from_url", recording)
    cfg = _config(tmp_path)
    cfg.write_text(
        cfg.read_text().replace("stores: {", f"stores: {{ledger_durability: {durability}, ")
    )
    _seed(tmp_path)
    rows = tmp_path / "usage.jsonl"
    rows.write_text('{"provider_request_id": "prov-a", "input_tokens": 1, "output_tokens": 1}\n')
    code, summary, _ = _import(cfg, rows)
    assert code == 0 and summary["unmatched"] == []
    assert seen == [durability]
