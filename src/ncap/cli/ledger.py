"""``ncap ledger export`` and ``ncap reconcile list|import``: the FinOps side of the ledger.

They open the configured stores directly (no running gateway needed). A reconciliation
file is JSONL or CSV keyed by the provider's request id; a reconciled event's budget
hold is settled with the imported usage, so its reservation stops being held.
"""

from __future__ import annotations

import asyncio
import csv
import difflib
import io
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import typer
from msgspec.structs import asdict
from rich.console import Console
from rich.progress import track
from rich.table import Table

from ncap.cli.focus import FOCUS_COLUMNS, focus_rows
from ncap.cli.reconcile import import_by_client_id, merge_results, operator_commands
from ncap.cli.when import WHEN_HELP, parse_when
from ncap.config import Config, utcnow
from ncap.domain.events import (
    LEDGER_COLUMNS,
    UNSETTLED_STATES,
    LedgerEvent,
    ReconciliationRow,
)
from ncap.domain.money import micros_from_usd
from ncap.errors import ConfigError
from ncap.stores import RowExport, budgets_from_url, hold_id_for, ledger_from_url

__all__ = ["ledger_app", "parse_reconciliation", "reconcile_app"]

ledger_app = typer.Typer(no_args_is_help=True, help="The sanitized per-attempt ledger.")
reconcile_app = typer.Typer(no_args_is_help=True, help="Usage reconciliation.")
err = Console(stderr=True)

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config")]


def _load(path: Path | None) -> Config:
    from ncap.cli._load import load_or_exit

    return load_or_exit(path)


@ledger_app.command("export")
def export(
    since: Annotated[str | None, typer.Option(help=f"From this instant: {WHEN_HELP}")] = None,
    until: Annotated[str | None, typer.Option(help="Before this instant (same forms)")] = None,
    format: Annotated[str, typer.Option("--format", help="jsonl, csv or focus")] = "jsonl",
    include_pending: Annotated[
        bool,
        typer.Option(
            "--include-pending",
            help="focus: also attempts whose usage is not known yet, with empty costs",
        ),
    ] = False,
    config: ConfigOpt = None,
    by_event: Annotated[bool, typer.Option("--by-event", hidden=True)] = False,
) -> None:
    """Write ledger events (oldest first) to standard output.

    jsonl: one object per event, exactly the ledger's columns. csv: a flat sheet
    for spreadsheets (docs/ledger.md): one column per finish reason, booleans as
    true/false, USD beside micro-USD, empty cells for null. focus: FOCUS 1.2 cost
    and usage rows (CSV), one per attempt and charge (input, cached input, output)."""
    if format not in ("jsonl", "csv", "focus"):
        raise typer.BadParameter("use jsonl, csv or focus", param_hint="--format")
    if include_pending and format != "focus":
        raise typer.BadParameter("only with --format focus", param_hint="--include-pending")
    now = utcnow()
    start = parse_when(since, now, "--since") if since else None
    end = parse_when(until, now, "--until") if until else None
    if start and end and end <= start:
        raise typer.BadParameter("must be later than --since", param_hint="--until")
    cfg = _load(config)
    if format == "focus":
        asyncio.run(_export_focus(cfg, start, end, sys.stdout, include_pending=include_pending))
        return
    asyncio.run(_export(cfg, start, end, format, sys.stdout, by_event=by_event))


async def _export_focus(
    cfg: Config,
    since: datetime | None,
    until: datetime | None,
    out: Any,
    *,
    include_pending: bool,
) -> None:
    """FOCUS rows, and on stderr what was left out because its cost is not known yet."""
    ledger = ledger_from_url(cfg.stores.ledger)
    writer = csv.DictWriter(out, fieldnames=list(FOCUS_COLUMNS), lineterminator="\n")
    writer.writeheader()
    unknown = held = 0
    try:
        async for event in ledger.export(since, until):
            if event.state in UNSETTLED_STATES or event.state == "reserved":
                unknown += 1
                held += event.reserved_cost_micros
            writer.writerows(focus_rows([event], cfg, include_pending=include_pending))
    finally:
        await ledger.close()
    if unknown and not include_pending:
        err.print(
            f"{unknown} attempt(s) with usage not known yet (USD {_usd(held)} held) are not "
            "in this export: reconcile them (ncap reconcile list) or add --include-pending"
        )


async def _export(
    cfg: Config,
    since: datetime | None,
    until: datetime | None,
    fmt: str,
    out: Any,
    *,
    by_event: bool = False,
) -> None:
    """A ledger that can streams its raw rows (``RowExport``: SQLite) does; any other, or
    ``--by-event`` (the benchmark's comparison), goes event by event."""
    ledger = ledger_from_url(cfg.stores.ledger)  # opening it migrates an older file
    if isinstance(ledger, RowExport) and not by_event:
        await ledger.close()
        if fmt == "csv":
            write_csv(ledger.export_rows(since, until, select=CSV_SELECT), out)
        else:
            write_jsonl(ledger.export_rows(since, until), out)
        return
    try:
        writer = csv.DictWriter(out, fieldnames=list(CSV_COLUMNS)) if fmt == "csv" else None
        if writer:
            writer.writeheader()
        async for event in ledger.export(since, until):
            if writer:
                writer.writerow(csv_row(event))
            else:
                out.write(json.dumps(_plain(event)) + "\n")
    finally:
        await ledger.close()


def write_csv(rows: Iterable[tuple[Any, ...]], out: Any) -> None:
    """Rows already in CSV cells (``CSV_SELECT``), written by ``csv.writer`` in C: None is
    an empty cell, a number its digits, as the event path writes them."""
    writer = csv.writer(out)
    writer.writerow(CSV_COLUMNS)
    writer.writerows(rows)


def write_jsonl(rows: Iterable[tuple[Any, ...]], out: Any) -> None:
    """Raw rows as the event path's JSON lines, byte for byte, without an event each."""
    encode = json.JSONEncoder().encode
    for row in rows:
        out.write(encode(_json_values(row)) + "\n")


def _plain(event: LedgerEvent) -> dict[str, Any]:
    row = asdict(event)
    row["timestamp"] = event.timestamp.isoformat()
    return row


# finish reasons a Chat Completions choice can have; others are counted in ``finish_other``
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter", "function_call")
_USD_OF = {"reserved_cost_micros": "reserved_cost_usd", "cost_micros": "cost_usd"}


def _csv_columns() -> tuple[str, ...]:
    out: list[str] = []
    for name in LEDGER_COLUMNS:
        if name == "finish_reasons":
            out += [f"finish_{r}" for r in FINISH_REASONS] + ["finish_other"]
            continue
        out.append(name)
        if name in _USD_OF:
            out.append(_USD_OF[name])
    return tuple(out)


CSV_COLUMNS = _csv_columns()


_AT = {name: i for i, name in enumerate(LEDGER_COLUMNS)}
_TS, _FINISH, _STREAM, _PER_CHOICE = (
    _AT["timestamp"],
    _AT["finish_reasons"],
    _AT["stream_mode"],
    _AT["output_tokens_per_choice"],
)


def _iso(stamp: str) -> str:
    """``2026-11-10T01:00:00.000000Z`` as ``datetime.isoformat()`` writes it."""
    if len(stamp) == 27 and stamp[-1] == "Z":
        micros = stamp[19:26]
        return f"{stamp[:19]}{'' if micros == '.000000' else micros}+00:00"
    return datetime.fromisoformat(stamp).isoformat()


def _csv_select() -> str:
    """``CSV_COLUMNS`` as SQLite expressions over a stored row, so that SQLite hands the
    cursor finished cells: the timestamp as ``isoformat()`` writes it (the store keeps
    fixed-width ``…ffffffZ`` text), USD beside micro-USD, one count per finish reason,
    ``true``/``false``, per-choice tokens space-separated."""
    usd = (
        "CASE WHEN {c} IS NULL THEN NULL WHEN {c} < 0 "
        "THEN printf('-%d.%06d', -{c} / 1000000, -{c} % 1000000) "
        "ELSE printf('%d.%06d', {c} / 1000000, {c} % 1000000) END"
    )
    known = ", ".join(f"'{r}'" for r in FINISH_REASONS)
    out: list[str] = []
    for name in LEDGER_COLUMNS:
        if name == "timestamp":
            out.append(
                "CASE WHEN substr(timestamp, 20, 7) = '.000000' "
                "THEN substr(timestamp, 1, 19) || '+00:00' "
                "ELSE substr(timestamp, 1, 26) || '+00:00' END"
            )
        elif name == "finish_reasons":
            out += [f"COALESCE(json_extract(finish_reasons, '$.{r}'), 0)" for r in FINISH_REASONS]
            out.append(
                "COALESCE((SELECT SUM(value) FROM json_each(finish_reasons)"
                f" WHERE key NOT IN ({known})), 0)"
            )
        elif name == "stream_mode":
            out.append("CASE WHEN stream_mode THEN 'true' ELSE 'false' END")
        elif name == "output_tokens_per_choice":
            out.append("replace(output_tokens_per_choice, ',', ' ')")
        else:
            out.append(name)
        if name in _USD_OF:
            out.append(usd.format(c=name))
    return ", ".join(out)


CSV_SELECT = _csv_select()


def _json_values(raw: tuple[Any, ...]) -> dict[str, Any]:
    row = list(raw)
    row[_TS] = _iso(row[_TS])
    row[_FINISH] = json.loads(row[_FINISH]) if row[_FINISH] else {}
    row[_STREAM] = bool(row[_STREAM])
    choices = row[_PER_CHOICE]
    row[_PER_CHOICE] = [int(t) for t in choices.split(",")] if choices else None
    return dict(zip(LEDGER_COLUMNS, row, strict=True))


def csv_row(event: LedgerEvent) -> dict[str, str]:
    """One event as flat cells: no JSON inside, ``true``/``false``, ``""`` for null."""
    row = _plain(event)
    reasons: dict[str, int] = row.pop("finish_reasons") or {}
    for r in FINISH_REASONS:
        row[f"finish_{r}"] = reasons.get(r, 0)
    row["finish_other"] = sum(v for k, v in reasons.items() if k not in FINISH_REASONS)
    for micros, usd in _USD_OF.items():
        row[usd] = _usd(row[micros])
    return {k: _cell(v) for k, v in row.items()}


def _usd(micros: int | None) -> str | None:
    if micros is None:
        return None
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), 1_000_000)
    return f"{sign}{whole}.{frac:06d}"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):  # output_tokens_per_choice: "12 40 7"
        return " ".join(str(v) for v in value)
    return str(value)


_PENDING_COLUMNS = (
    "timestamp",
    "request_id",
    "attempt",
    "route",
    "provider_request_id",
    "state",
    "reason",
    "reserved_cost_micros",
)


@reconcile_app.command("list")
def list_pending(
    format: Annotated[
        str, typer.Option("--format", help="table (a terminal) | tsv (a pipe) | json")
    ] = "auto",
    config: ConfigOpt = None,
) -> None:
    """Events awaiting reconciliation (pending or usage_reconciliation_required), and
    rows left reserved past their attempt's time limit (state reserved).

    Ids are never shortened: on a terminal the table grows wider than the window
    rather than cut them; into a pipe or a file it is tab-separated plain text."""
    if format not in ("auto", "table", "tsv", "json"):
        raise typer.BadParameter("use table, tsv or json", param_hint="--format")
    events = asyncio.run(_pending(_load(config)))
    if format == "json":
        typer.echo(json.dumps([_plain(e) for e in events], indent=2))
        return
    rows = [
        (
            e.timestamp.isoformat(timespec="seconds"),
            e.request_id,
            str(e.attempt),
            e.route_id or "",
            e.provider_request_id or "",
            e.state,
            e.reconciliation_reason or "",
            str(e.reserved_cost_micros),
        )
        for e in events
    ]
    if format == "tsv" or (format == "auto" and not sys.stdout.isatty()):
        for row in (_PENDING_COLUMNS, *rows):
            typer.echo("\t".join(row))
    else:
        _print_table(rows)
    err.print(f"{len(events)} event(s) awaiting reconciliation")


def _print_table(rows: Sequence[tuple[str, ...]]) -> None:
    table = Table(*_PENDING_COLUMNS)
    for column in table.columns:
        column.no_wrap = True
        column.overflow = "ignore"
    for row in rows:
        table.add_row(*row)
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(_PENDING_COLUMNS)]
    needed = sum(widths) + 3 * len(widths) + 1
    console = Console()
    Console(width=max(console.width, needed)).print(table)


async def _pending(cfg: Config) -> list[LedgerEvent]:
    ledger = ledger_from_url(cfg.stores.ledger)
    try:
        # and rows left reserved past their attempt's time limit, swept or not yet
        return await ledger.pending(utcnow() - timedelta(seconds=cfg.reserved_timeout_s))
    finally:
        await ledger.close()


@reconcile_app.command("import")
def import_file(
    file: Annotated[Path, typer.Argument(help="JSONL or CSV keyed by provider_request_id")],
    config: ConfigOpt = None,
) -> None:
    """Move pending events to ``reconciled`` with the provider's usage; idempotent.

    Columns (docs/ledger.md): provider_request_id, or client_request_id (the
    X-Client-Request-Id ncap sends with every attempt, `<request id>#<attempt>`: it
    matches rows the provider never named, e.g. gateway_lost or timeout ones);
    input_tokens or prompt_tokens;
    output_tokens, completion_tokens or output_tokens_total; optional
    cached_input_tokens or cached_tokens, reasoning_tokens, cost_micros or cost_usd;
    other columns are ignored.
    Prints a JSON summary by category. Exit 0: done; 1: the file needs a look
    (conflicts, ambiguous or unpriced rows, or nothing in it matched the ledger);
    2: the file or a row is unusable (nothing was imported)."""
    cfg = _load(config)
    rows = parse_reconciliation(file)
    summary = asyncio.run(_import(cfg, rows))
    typer.echo(json.dumps(summary, indent=2))
    for line in _attention(summary, len(rows)):
        err.print(line, highlight=False, soft_wrap=True)
    if _needs_attention(summary, len(rows)):
        raise typer.Exit(1)


def _needs_attention(summary: dict[str, Any], total: int) -> bool:
    flagged = summary["conflicts"] or summary["ambiguous"] or summary["unpriced"]
    return bool(flagged) or len(summary["unmatched"]) == total  # an empty file too


def _attention(summary: dict[str, Any], total: int) -> list[str]:
    out = [
        "reconciled {r}, unchanged {u}, not pending {n}, unmatched {m} of {t} row(s)".format(
            r=len(summary["reconciled"]),
            u=len(summary["unchanged"]),
            n=len(summary["not_pending"]),
            m=len(summary["unmatched"]),
            t=total,
        )
    ]
    if total == 0:
        out.append("error: the file has no rows: nothing was imported (is it the right file?)")
    elif len(summary["unmatched"]) == total:
        out.append(
            "error: no row matched a ledger event: is this the right ledger (--config), "
            "and is provider_request_id the provider's id (x-request-id of its answer)?"
        )
    out += [f"conflict: {detail}" for detail in summary.get("conflict_details", [])]
    out += [
        f"ambiguous: {pid}: several unsettled attempts share this provider id"
        for pid in summary["ambiguous"]
    ]
    out += [
        f"unpriced: {pid}: no cost in the row and no route pricing for its event"
        for pid in summary["unpriced"]
    ]
    return out


async def _import(cfg: Config, rows: list[ReconciliationRow]) -> dict[str, Any]:
    # the import writes: at the configured durability (SQLite synchronous, PostgreSQL
    # synchronous_commit), as the gateway's own writes
    ledger = ledger_from_url(cfg.stores.ledger, durability=cfg.stores.ledger_durability)
    budgets = budgets_from_url(cfg.stores.budgets)
    try:
        pricing = {rid: route.pricing for rid, route in cfg.routes.items()}
        by_provider = [r for r in rows if r.provider_request_id]
        result = await ledger.import_reconciliation(by_provider, pricing=pricing)
        by_client = [r for r in rows if not r.provider_request_id]
        merge_results(result, await import_by_client_id(ledger, by_client, pricing))
        for event in track(result.reconciled, description="settling holds", console=err):
            await budgets.settle(
                hold_id_for(event.request_id, event.attempt),
                event.total_tokens or 0,
                event.cost_micros or 0,
            )
        details = await _conflict_details(ledger, rows, result.conflicts)
        return {
            "reconciled": [
                e.provider_request_id or hold_id_for(e.request_id, e.attempt)
                for e in result.reconciled
            ],
            "unchanged": result.unchanged,
            "conflicts": result.conflicts,
            "conflict_details": details,
            "unmatched": result.unmatched,
            "not_pending": result.not_pending,
            "unpriced": result.unpriced,
            "ambiguous": result.ambiguous,
        }
    finally:
        await ledger.close()
        await budgets.close()


async def _conflict_details(
    ledger: Any, rows: list[ReconciliationRow], conflicts: list[str]
) -> list[str]:
    """What differs between the file and an already reconciled event (one ledger scan,
    only when there are conflicts)."""
    if not conflicts:
        return []
    wanted = set(conflicts)
    by_id = {r.provider_request_id: r for r in rows if r.provider_request_id in wanted}
    out = []
    async for event in ledger.export():
        row = by_id.get(event.provider_request_id or "")
        if row is None or event.state != "reconciled":
            continue
        out.append(
            f"{row.provider_request_id}: the ledger has input_tokens={event.input_tokens} "
            f"output_tokens={event.output_tokens_total} (reconciled, request "
            f"{event.request_id}), the file has input_tokens={row.input_tokens} "
            f"output_tokens={row.output_tokens}; the ledger is not changed"
        )
    return out


# accepted column names: the canonical name first, then the other names it goes by
COLUMNS: dict[str, tuple[str, ...]] = {
    "provider_request_id": ("provider_request_id",),
    "client_request_id": ("client_request_id", "x_client_request_id", "X-Client-Request-Id"),
    "input_tokens": ("input_tokens", "prompt_tokens"),
    "output_tokens": ("output_tokens", "completion_tokens", "output_tokens_total"),
    "cached_input_tokens": ("cached_input_tokens", "cached_tokens"),
    "reasoning_tokens": ("reasoning_tokens",),
    "cost_micros": ("cost_micros",),
    "cost_usd": ("cost_usd",),
}
_CANONICAL = {alias: name for name, aliases in COLUMNS.items() for alias in aliases}


def parse_reconciliation(path: Path) -> list[ReconciliationRow]:
    """Rows of a JSONL or CSV export; every problem is reported with its line and the
    field's accepted names. Unknown columns are a problem too (a misspelt
    ``input_token`` must not read as a missing one)."""
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
            message = exc.args[0] if isinstance(exc, KeyError) else str(exc)
            problems.append(f"{path}:{line}: {message}")
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


def _names(field: str) -> str:
    aliases = COLUMNS[field]
    return aliases[0] + (f" (or {' / '.join(aliases[1:])})" if len(aliases) > 1 else "")


def _row(record: Any) -> ReconciliationRow:
    if isinstance(record, Exception):
        raise record
    if not isinstance(record, dict):
        raise TypeError("each row must be an object with named fields")
    data = _canonical(record)
    if "provider_request_id" not in data and "client_request_id" not in data:
        raise KeyError(
            f"{_missing(data, 'provider_request_id').args[0]} (or client_request_id, the "
            "X-Client-Request-Id ncap sent)"
        )
    client = data.get("client_request_id")
    return ReconciliationRow(
        provider_request_id=str(data.get("provider_request_id", "")),
        client_request_id=str(client) if client is not None else None,
        input_tokens=_count(data, "input_tokens"),
        output_tokens=_count(data, "output_tokens"),
        cached_input_tokens=_count(data, "cached_input_tokens", 0),
        reasoning_tokens=_count(data, "reasoning_tokens", None),
        cost_micros=_cost(data),
    )


def _canonical(record: dict[Any, Any]) -> dict[str, Any]:
    """Map accepted names to canonical ones. Other columns are ignored (provider exports
    carry many), but kept under ``_unknown`` to hint at a misspelt required field."""
    data: dict[str, Any] = {"_unknown": []}
    source: dict[str, str] = {}
    for key, value in record.items():
        name = str(key).strip()
        canonical = _CANONICAL.get(name)
        if canonical is None:
            data["_unknown"].append(name)
            continue
        if value in (None, ""):
            continue
        if canonical in data and data[canonical] != value:
            raise ValueError(
                f"{source[canonical]} and {name} name the same field but disagree "
                f"({data[canonical]!r} vs {value!r})"
            )
        data[canonical], source[canonical] = value, name
    return data


def _missing(data: dict[str, Any], name: str) -> KeyError:
    hint = difflib.get_close_matches(name, data["_unknown"], n=1, cutoff=0.75)
    guess = f"; the row has {hint[0]!r}: a misspelling?" if hint else ""
    return KeyError(f"{_names(name)} is required{guess}")


def _count(data: dict[str, Any], name: str, default: Any = ...) -> Any:
    if name not in data:
        if default is ...:
            raise _missing(data, name)
        return default
    raw = data[name]
    try:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError
        value = int(str(raw).strip()) if not isinstance(raw, int | float) else int(raw)
    except ValueError:
        raise ValueError(f"{_names(name)}: {raw!r} is not a whole number of tokens") from None
    if value < 0:
        raise ValueError(f"{_names(name)}: {value} cannot be negative")
    return value


def _cost(data: dict[str, Any]) -> int | None:
    if "cost_micros" in data:
        return int(_count(data, "cost_micros"))
    if "cost_usd" not in data:
        return None
    raw = data["cost_usd"]
    try:
        micros = micros_from_usd(str(raw).strip())
    except (ValueError, ArithmeticError):
        raise ValueError(f"cost_usd: {raw!r} is not an amount of USD (e.g. 0.0012)") from None
    if micros is None or micros < 0:
        raise ValueError(f"cost_usd: {raw!r} cannot be negative")
    return micros


operator_commands(reconcile_app)
