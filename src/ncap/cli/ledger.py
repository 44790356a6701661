"""``ncap ledger export`` and ``ncap reconcile list|import``: the FinOps side of the ledger.

They open the configured stores directly (no running gateway needed). A reconciliation
file is JSONL or CSV keyed by the provider's request id; a reconciled event's budget
hold is settled with the imported usage, so its reservation stops being held.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import track
from rich.table import Table

from ncap.config import Config, parse_duration, utcnow
from ncap.domain.events import LEDGER_COLUMNS, LedgerEvent, ReconciliationRow
from ncap.domain.money import micros_from_usd
from ncap.errors import ConfigError
from ncap.stores import budgets_from_url, hold_id_for, ledger_from_url

__all__ = ["ledger_app", "parse_reconciliation", "reconcile_app"]

ledger_app = typer.Typer(no_args_is_help=True, help="The sanitized per-attempt ledger.")
reconcile_app = typer.Typer(no_args_is_help=True, help="Usage reconciliation.")
err = Console(stderr=True)

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config")]


def _load(path: Path | None) -> Config:
    from ncap.cli.main import load_or_exit

    return load_or_exit(path)


@ledger_app.command("export")
def export(
    since: Annotated[str | None, typer.Option(help="Only events newer than this, e.g. 7d")] = None,
    format: Annotated[str, typer.Option("--format", help="jsonl or csv")] = "jsonl",
    config: ConfigOpt = None,
) -> None:
    """Write ledger events (oldest first) to standard output."""
    if format not in ("jsonl", "csv"):
        raise typer.BadParameter("use jsonl or csv", param_hint="--format")
    start = utcnow() - parse_duration(since) if since else None
    cfg = _load(config)
    asyncio.run(_export(cfg, start, format, sys.stdout))


async def _export(cfg: Config, since: datetime | None, fmt: str, out: Any) -> None:
    ledger = ledger_from_url(cfg.stores.ledger)
    try:
        writer = csv.DictWriter(out, fieldnames=list(LEDGER_COLUMNS)) if fmt == "csv" else None
        if writer:
            writer.writeheader()
        async for event in ledger.export(since):
            row = _plain(event)
            if writer:
                writer.writerow({k: _csv_cell(v) for k, v in row.items()})
            else:
                out.write(json.dumps(row) + "\n")
    finally:
        await ledger.close()


def _plain(event: LedgerEvent) -> dict[str, Any]:
    row = asdict(event)
    row["timestamp"] = event.timestamp.isoformat()
    return row


def _csv_cell(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, dict) else value


@reconcile_app.command("list")
def list_pending(
    format: Annotated[str, typer.Option("--format", help="table or json")] = "table",
    config: ConfigOpt = None,
) -> None:
    """Events awaiting reconciliation (pending or usage_reconciliation_required)."""
    events = asyncio.run(_pending(_load(config)))
    if format == "json":
        typer.echo(json.dumps([_plain(e) for e in events], indent=2))
        return
    table = Table(
        "timestamp",
        "request_id",
        "attempt",
        "route",
        "provider_request_id",
        "state",
        "reason",
        "reserved_cost_micros",
    )
    for e in events:
        table.add_row(
            e.timestamp.isoformat(timespec="seconds"),
            e.request_id,
            str(e.attempt),
            e.route_id or "",
            e.provider_request_id or "",
            e.state,
            e.reconciliation_reason or "",
            str(e.reserved_cost_micros),
        )
    Console().print(table)
    err.print(f"{len(events)} event(s) awaiting reconciliation")


async def _pending(cfg: Config) -> list[LedgerEvent]:
    ledger = ledger_from_url(cfg.stores.ledger)
    try:
        return await ledger.pending()
    finally:
        await ledger.close()


@reconcile_app.command("import")
def import_file(
    file: Annotated[Path, typer.Argument(help="JSONL or CSV keyed by provider_request_id")],
    config: ConfigOpt = None,
) -> None:
    """Move pending events to ``reconciled`` with the provider's usage; idempotent."""
    cfg = _load(config)
    try:
        rows = parse_reconciliation(file)
    except ConfigError as exc:
        for problem in exc.problems:
            err.print(f"[red]error[/red] {problem}", highlight=False)
        raise typer.Exit(2) from None
    summary = asyncio.run(_import(cfg, rows))
    typer.echo(json.dumps(summary, indent=2))


async def _import(cfg: Config, rows: list[ReconciliationRow]) -> dict[str, Any]:
    ledger = ledger_from_url(cfg.stores.ledger)
    budgets = budgets_from_url(cfg.stores.budgets)
    try:
        pricing = {rid: route.pricing for rid, route in cfg.routes.items()}
        result = await ledger.import_reconciliation(rows, pricing=pricing)
        for event in track(result.reconciled, description="settling holds", console=err):
            await budgets.settle(
                hold_id_for(event.request_id, event.attempt),
                event.total_tokens or 0,
                event.cost_micros or 0,
            )
        return {
            "reconciled": [e.provider_request_id for e in result.reconciled],
            "unchanged": result.unchanged,
            "conflicts": result.conflicts,
            "unmatched": result.unmatched,
            "not_pending": result.not_pending,
            "unpriced": result.unpriced,
            "ambiguous": result.ambiguous,
        }
    finally:
        await ledger.close()
        await budgets.close()


_ALIASES = {
    "prompt_tokens": "input_tokens",
    "completion_tokens": "output_tokens",
    "output_tokens_total": "output_tokens",
    "cached_tokens": "cached_input_tokens",
}


def parse_reconciliation(path: Path) -> list[ReconciliationRow]:
    """Rows of a JSONL or CSV export; every problem is reported with its line."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    records = _csv_records(text) if _is_csv(path, text) else _jsonl_records(text)
    rows, problems = [], []
    for line, record in records:
        try:
            rows.append(_row(record))
        except (KeyError, TypeError, ValueError) as exc:
            problems.append(f"{path}:{line}: {exc}")
    if problems:
        raise ConfigError(f"{path}: {len(problems)} bad row(s)", problems)
    return rows


def _is_csv(path: Path, text: str) -> bool:
    return path.suffix.lower() == ".csv" or not text.lstrip().startswith("{")


def _jsonl_records(text: str) -> Iterator[tuple[int, Any]]:
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                yield number, ValueError(f"not JSON: {exc.msg}")


def _csv_records(text: str) -> Iterable[tuple[int, Any]]:
    reader = csv.DictReader(io.StringIO(text))
    return ((number, record) for number, record in enumerate(reader, 2))


def _row(record: Any) -> ReconciliationRow:
    if isinstance(record, Exception):
        raise record
    if not isinstance(record, dict):
        raise TypeError("each row must be an object")
    data: dict[str, Any] = {
        _ALIASES.get(str(k), str(k)): v for k, v in record.items() if v not in (None, "")
    }
    if "provider_request_id" not in data:
        raise KeyError("provider_request_id is required")
    cost = data.get("cost_micros")
    if cost is None and "cost_usd" in data:
        cost = micros_from_usd(str(data["cost_usd"]))
    return ReconciliationRow(
        provider_request_id=str(data["provider_request_id"]),
        input_tokens=_count(data, "input_tokens"),
        output_tokens=_count(data, "output_tokens"),
        cached_input_tokens=_count(data, "cached_input_tokens", 0),
        reasoning_tokens=_count(data, "reasoning_tokens", None),
        cost_micros=int(cost) if cost is not None else None,
    )


def _count(data: dict[str, Any], name: str, default: Any = ...) -> Any:
    if name not in data:
        if default is ...:
            raise KeyError(f"{name} is required")
        return default
    value = int(data[name])
    if value < 0:
        raise ValueError(f"{name} cannot be negative")
    return value
