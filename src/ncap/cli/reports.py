"""``ncap audit``, ``ncap report daily`` and ``ncap ledger generate``.

The report commands open the configured ledger read-only (no running gateway needed)
and print the report as rich tables, JSON or one self-contained HTML page. On a
terminal they show which query is running; piped output stays clean.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ncap.config import Config, parse_duration, utcnow
from ncap.domain.money import format_usd
from ncap.errors import ConfigError
from ncap.reports import (
    STEPS,
    Report,
    Window,
    build_report,
    day_window,
    render_html,
    render_json,
    render_tables,
    render_tsv,
    report_dict,
    since_window,
    source_from_url,
)
from ncap.reports.admin_tables import revoked_exceptions, with_admin_exceptions
from ncap.reports.render import evidence_tables

__all__ = ["audit", "generate", "report_app"]

report_app = typer.Typer(no_args_is_help=True, help="Control reports over the ledger.")
err = Console(stderr=True)

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config")]
LedgerOpt = Annotated[
    str | None, typer.Option("--ledger", help="Ledger URL instead of the config's stores.ledger")
]
FormatOpt = Annotated[
    str,
    typer.Option("--format", help="table (tab-separated when not a terminal), tsv, json or html"),
]
Format = Literal["table", "tsv", "json", "html"]


def _load(path: Path | None) -> Config:
    from ncap.cli._load import load_or_exit

    return load_or_exit(path)


def _format(value: str) -> Format:
    if value not in ("table", "tsv", "json", "html"):
        raise typer.BadParameter("use table, tsv, json or html", param_hint="--format")
    return value  # type: ignore[return-value]


def audit(
    since: Annotated[str, typer.Option(help="Window length back from now, e.g. 7d, 24h")] = "7d",
    format: FormatOpt = "table",
    ledger: LedgerOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Audit the ledger: candidate counts, output per request, exceptions, denials, spend."""
    fmt = _format(format)
    try:
        length = parse_duration(since)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--since") from None
    if length <= timedelta(0):
        raise typer.BadParameter("the window must be longer than zero", param_hint="--since")
    window = _representable(lambda: since_window(length, utcnow()), "--since")
    cfg = _load(config)
    _run(cfg, ledger, window, "audit", fmt)


def _representable(make: Callable[[], Window], hint: str) -> Window:
    """The window, refused as a bad parameter when it or the window before it (the
    comparison) would start before year 1."""
    try:
        window = make()
        window.previous()
    except OverflowError:
        raise typer.BadParameter(
            "too far back: the window and the one before it must start after year 1",
            param_hint=hint,
        ) from None
    return window


@report_app.command("daily")
def daily(
    day: Annotated[
        str | None, typer.Option("--date", help="UTC day YYYY-MM-DD (default: yesterday)")
    ] = None,
    format: FormatOpt = "table",
    ledger: LedgerOpt = None,
    config: ConfigOpt = None,
) -> None:
    """The daily control: one UTC day against the thresholds of ``reports.thresholds``."""
    fmt = _format(format)
    try:
        chosen = date.fromisoformat(day) if day else (utcnow() - timedelta(days=1)).date()
    except ValueError:
        raise typer.BadParameter("use YYYY-MM-DD", param_hint="--date") from None
    window = _representable(lambda: day_window(chosen), "--date")
    cfg = _load(config)
    _run(cfg, ledger, window, "daily", fmt)


@report_app.command("candidates")
def candidates(
    since: Annotated[str, typer.Option(help="Window length back from now, e.g. 7d, 24h")] = "7d",
    format: FormatOpt = "table",
    ledger: LedgerOpt = None,
    config: ConfigOpt = None,
) -> None:
    """The exception review: per workload and exception, how different the candidates
    were, what the duplicates cost, and what each candidate count would have cost."""
    fmt = _format(format)
    if fmt == "html":
        raise typer.BadParameter("use table or json", param_hint="--format")
    try:
        length = parse_duration(since)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--since") from None
    cfg = _load(config)
    report = _build(cfg, ledger, since_window(length, utcnow()), "audit")
    review = _review(report)
    if fmt == "json":
        typer.echo(json.dumps(review, indent=2))
        return
    console = Console(highlight=False)
    for section in evidence_tables(report.candidates):
        console.print(section.rich())
    console.print(_review_table(review["exceptions"]))
    for alert in review["alerts"]:
        console.print(f"[yellow]{alert['severity']}[/yellow] ", Text(alert["message"]))


def _review(report: Report) -> dict[str, Any]:
    """Per exception: its spend and requests (``ExceptionUsage``) beside its evidence."""
    data = report_dict(report)
    evidence = {c["exception_id"]: c for c in data["candidates"] if c["exception_id"]}
    exceptions = [
        {
            "id": e["id"],
            "workload": e["workload"],
            "status": e["status"],
            "requests_window": e["requests_window"],
            "spent_micros": e["spent_micros"],
            "evidence": evidence.get(e["id"]),
        }
        for e in data["exceptions"]
    ]
    alerts = [a for a in data["alerts"] if a["source"] == "candidates"]
    return {"window": data["window"], "candidates": data["candidates"],
            "exceptions": exceptions, "alerts": alerts}  # fmt: skip


def _review_table(exceptions: list[dict[str, Any]]) -> Table:
    table = Table(
        "exception", "workload", "status", "requests", "spent (life)", "distinct / returned",
        "agreement", "saving at n=1", title=Text("exception review"), title_justify="left",
    )  # fmt: skip
    for e in exceptions:
        ev = e["evidence"] or {}
        table.add_row(
            *(
                Text(str(cell))
                for cell in (
                    e["id"], e["workload"] or "–", e["status"], e["requests_window"],
                    format_usd(e["spent_micros"]), ev.get("distinct_share_mean", "–"),
                    ev.get("agreement_mean", "–"),
                    "–" if ev.get("saving_at_one_micros") is None
                    else format_usd(ev["saving_at_one_micros"]),
                )
            )
        )  # fmt: skip
    return table


def _build(
    cfg: Config, ledger: str | None, window: Window, kind: Literal["audit", "daily"]
) -> Report:
    try:
        source = source_from_url(ledger or cfg.stores.ledger)
    except ConfigError as exc:
        err.print(f"[red]error[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    try:
        with _progress() as step:
            return build_report(
                source,
                window,
                kind=kind,
                exceptions=with_admin_exceptions(source, cfg.exceptions),
                revoked=revoked_exceptions(source),
                pricing={rid: route.pricing for rid, route in cfg.routes.items()},
                thresholds=cfg.reports.thresholds,
                step=step,
            )
    finally:
        source.close()


def _run(
    cfg: Config, ledger: str | None, window: Window, kind: Literal["audit", "daily"], fmt: Format
) -> None:
    _emit(_build(cfg, ledger, window, kind), fmt)


@contextmanager
def _progress() -> Iterator[Callable[[str], None]]:
    """A bar over the report's queries, on stderr, only when stdout is a terminal."""
    if not sys.stdout.isatty():
        yield lambda _name: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task("reading the ledger", total=len(STEPS))
        seen: list[str] = []

        def step(name: str) -> None:
            if seen:
                progress.advance(task)
            seen.append(name)
            progress.update(task, description=f"query: {name}")

        yield step
        progress.update(task, completed=len(STEPS))


def _emit(report: Report, fmt: Format) -> None:
    if fmt == "json":
        typer.echo(render_json(report))
    elif fmt == "html":
        typer.echo(render_html(report))
    elif fmt == "tsv" or not sys.stdout.isatty():
        # a pipe or a file gets every column whole (a terminal's 80 columns cut them)
        typer.echo(render_tsv(report))
    else:
        render_tables(report, Console(highlight=False))


def generate(
    rows: Annotated[int, typer.Option(help="Rows (attempts) to write", min=1)] = 100_000,
    out: Annotated[Path, typer.Option(help="New SQLite ledger file")] = Path("synthetic.db"),
    days: Annotated[int, typer.Option(help="Days of history, ending now", min=2)] = 14,
    shift_day: Annotated[
        str | None, typer.Option(help="Day the n=2 client change starts (default: 2 days ago)")
    ] = None,
    seed: Annotated[int, typer.Option(help="Random seed")] = 11,
    write_config: Annotated[
        Path | None, typer.Option(help="Also write a matching config (exceptions, routes)")
    ] = None,
) -> None:
    """Write a realistic synthetic ledger (for tests, benchmarks and demos)."""
    from ncap.testing.ledger_gen import LedgerSpec, generate_ledger, synthetic_config

    try:
        shift = date.fromisoformat(shift_day) if shift_day else None
    except ValueError:
        raise typer.BadParameter("use YYYY-MM-DD", param_hint="--shift-day") from None
    spec = LedgerSpec(rows=rows, days=days, seed=seed, shift_day=shift)
    if out.exists():
        err.print(f"[red]error[/red] {out} exists; choose a new file", highlight=False)
        raise typer.Exit(2)
    if not out.parent.is_dir():
        err.print(f"[red]error[/red] no such directory: {out.parent}", highlight=False)
        raise typer.Exit(2)
    started = datetime.now()
    with Progress(console=err, disable=not sys.stdout.isatty(), transient=True) as progress:
        task = progress.add_task("writing rows", total=rows)
        written = generate_ledger(out, spec, progress=lambda n: progress.update(task, completed=n))
    seconds = (datetime.now() - started).total_seconds()
    err.print(f"wrote {written:,} rows to {out} in {seconds:.1f} s", highlight=False)
    if write_config:
        write_config.write_text(yaml.safe_dump(synthetic_config(spec, out), sort_keys=False))
        err.print(f"wrote the matching config to {write_config}", highlight=False)
