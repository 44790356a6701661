"""The ``ncap`` command line (typer + rich). Every command takes ``--config``.

A user's mistake (a bad option, a broken config, an unreadable file, a store that
cannot be opened) is one line on standard error and exit status 2, never a traceback:
``main`` is the one place that maps errors to exit statuses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
import yaml
from pydantic import ValidationError
from rich.console import Console
from typer.core import TyperGroup

from ncap.cli._load import load_or_exit
from ncap.cli.keys import keys_app
from ncap.config import Config, Server, resolved, warnings_for
from ncap.errors import NcapError

__all__ = ["app", "main"]

HELP = (
    "ncap: an OpenAI-compatible Chat Completions gateway that makes `n` correct and "
    "affordable (candidate caps before dispatch, reservations, a per-attempt ledger)."
    "\n\n"
    "Every command takes --config FILE; without it ./ncap.yaml when present, else the "
    "embedded default (the local smollm2 demo). Guides: docs/operations.md, "
    "docs/configuration.md, docs/ledger.md."
)


class _Group(TyperGroup):
    """The root command group: a user's mistake raised by any subcommand (an
    ``NcapError``, an ``OSError``) becomes its message and exit status 2 here, so the
    commands behave the same under ``main`` and under a test runner."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except NcapError as exc:
            _print_problems(exc)
            raise typer.Exit(2) from None
        except BrokenPipeError:
            _reader_left()
        except OSError as exc:
            _print_os_error(exc)
            raise typer.Exit(2) from None


app = typer.Typer(no_args_is_help=True, add_completion=False, help=HELP, cls=_Group)
app.add_typer(keys_app, name="keys")

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="YAML config (default: ./ncap.yaml, else built-in)"),
]
err = Console(stderr=True)


@app.command()
def serve(
    config: ConfigOpt = None,
    host: Annotated[str | None, typer.Option(help="Bind address")] = None,
    port: Annotated[int | None, typer.Option(help="Port")] = None,
    workers: Annotated[
        int, typer.Option(min=1, help="Gateway processes on this port (shared stores only)")
    ] = 1,
    reuse_port: Annotated[bool, typer.Option(hidden=True)] = False,
    instance_id: Annotated[str | None, typer.Option(hidden=True)] = None,
) -> None:
    """Run the gateway."""
    from ncap.cli.workers import refuse_unshared, supervise
    from ncap.errors import ConfigError
    from ncap.http.app import create_app, front_of
    from ncap.http.front import run

    cfg = load_or_exit(config)
    _warn(cfg, config)
    refusal = refuse_unshared(cfg, workers)
    if refusal is not None:
        err.print(f"[red]refusing to start[/red]: {refusal}", highlight=False)
        raise typer.Exit(2)
    server = _server(cfg, host, port)
    cfg = cfg.model_copy(update={"server": server})
    if not server.is_loopback and not cfg.keys:
        err.print(
            f"[red]refusing to start[/red]: bound to {server.host}, which is not loopback, "
            "with no API keys configured (create one with `ncap keys create`)."
        )
        raise typer.Exit(2)
    if workers > 1:
        args = ["--host", server.host, "--port", str(server.port)]
        args += ["--config", str(config)] if config else []
        err.print(f"ncap: {workers} workers on http://{server.host}:{server.port}")
        raise typer.Exit(supervise(args, workers, cfg.server.instance_id))
    _use_uvloop()
    _lean_logging()
    if cfg.observability.access_log:
        from ncap.http.signals import log_access_to_stdout

        log_access_to_stdout()
    try:
        gateway = create_app(cfg, instance_id=instance_id)
    except ConfigError as exc:
        err.print(f"[red]refusing to start[/red]: {exc}", highlight=False)
        raise typer.Exit(2) from None
    gateway.on_startup.append(_settle_the_heap)
    where = f"http://{server.host}:{server.port}"
    run(
        gateway,
        front_of(gateway),
        host=server.host,
        port=server.port,
        # called once the socket is bound: a busy port fails before saying it listens
        on_listening=lambda: err.print(f"ncap listening on {where}", highlight=False),
        reuse_port=reuse_port or None,
    )


def _server(cfg: Config, host: str | None, port: int | None) -> Server:
    """The config's server section with ``--host``/``--port`` applied and checked by
    the same rules as the config (a port above 65535 is refused, not wrapped)."""
    changes = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    try:
        return Server.model_validate(cfg.server.model_dump() | changes)
    except ValidationError as exc:
        for problem in exc.errors():
            where = "--" + ".".join(str(part) for part in problem["loc"])
            err.print(f"[red]error[/red] {where}: {problem['msg']}", highlight=False)
        raise typer.Exit(2) from None


def _lean_logging() -> None:
    """Log records without the fields no ncap formatter prints: the thread, process
    and multiprocessing names (``getpid`` per record) and the caller's file and line
    (a frame walk per record; the logging module documents ``_srcfile = None`` for
    exactly this). Every access line is a record, so this is on the hot path."""
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging._srcfile = None


async def _settle_the_heap(_app: object) -> None:
    """Once the stores are open and the engines warm: what start-up made lives as long
    as the process, so it leaves the collector's view (``gc.freeze``), and the
    youngest generation is collected less often (each request allocates a few
    thousand short-lived objects; most die by reference count, not by the collector).
    Measured in docs/decisions/gc-tuned-in-serve.md."""
    import gc

    if os.environ.get("NCAP_GC_TUNING", "1") == "0":
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(*_GC_THRESHOLDS)


_GC_THRESHOLDS = (50_000, 20, 100)  # CPython's defaults: (700, 10, 10)


def _use_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


@app.command("check-config")
def checkload_or_exit(
    file: Annotated[Path | None, typer.Argument(help="Config file to check")] = None,
    config: ConfigOpt = None,
) -> None:
    """Validate a config file; print the resolved config or every problem with its place.

    Also warns (without failing) about what is valid but refuses requests today: route
    contracts already stale, exceptions already expired."""
    path = file or config
    cfg = load_or_exit(path)
    _check_stores(cfg)
    _warn(cfg, path)
    typer.echo(yaml.safe_dump(resolved(cfg), sort_keys=False))


def _check_stores(cfg: Config) -> None:
    """The store URLs name backends that keep those stores (``serve`` would refuse to
    start otherwise): every problem printed, exit status 2."""
    from ncap.errors import ConfigError
    from ncap.stores import check_store_urls

    try:
        check_store_urls(cfg.stores.ledger, cfg.stores.budgets)
    except ConfigError as exc:
        for problem in exc.problems:
            err.print(f"[red]error[/red] {problem}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _warn(cfg: Config, path: Path | None) -> None:
    """Print what is valid but refuses requests today (stale contracts, expired grants)."""
    source = path or (Path("ncap.yaml") if Path("ncap.yaml").exists() else None)
    if source is None:
        return
    for warning in warnings_for(cfg, source.read_text(), str(source), datetime.now(UTC)):
        err.print(f"[yellow]warning[/yellow] {warning}", highlight=False, soft_wrap=True)


@app.command()
def probe(
    route: Annotated[str, typer.Argument(help="Route id, as configured under routes:")],
    config: ConfigOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the findings; write nothing")
    ] = False,
) -> None:
    """Send a minimal n=2 request (and a streamed one) through a configured route and
    record what came back as its contract (routes.ROUTE.contract in the config file).

    Without a config file (the embedded default) the findings are only printed. An
    inconclusive answer (429, 5xx, a refused credential) writes nothing (exit 1)."""
    from ncap.cli.probe import print_findings, probe_route, record_findings
    from ncap.domain.probe import ProbeInconclusive

    path = config or (Path("ncap.yaml") if Path("ncap.yaml").exists() else None)
    cfg = load_or_exit(path)
    try:
        findings = asyncio.run(probe_route(cfg, route))
    except ProbeInconclusive as exc:
        err.print(f"[red]inconclusive[/red] {exc}; nothing was written", highlight=False)
        raise typer.Exit(1) from None
    print_findings(Console(), route, findings)
    if path is None or dry_run:
        reason = "--dry-run" if dry_run else "no config file (the embedded default)"
        err.print(f"nothing written: {reason}", highlight=False)
        return
    record_findings(path, route, findings)
    err.print(f"recorded routes.{route}.contract in {path}", highlight=False)


def _profiles_help() -> str:
    from ncap.testing._fake_faults import PROFILES

    return (
        "Fault profiles: " + ", ".join(sorted(PROFILES)) + ". `name=value` sets a profile's "
        "parameter, e.g. latency=50 (ms), rate_limit=2 (Retry-After s), timeout=5 (s), "
        "reset_mid_stream=3 (chunks). A request's `x-fake-fault` header overrides them."
    )


@app.command("fake-upstream", epilog=_profiles_help())
def fake_upstream(
    port: Annotated[int, typer.Option(help="Port")] = 9100,
    host: Annotated[str, typer.Option(help="Bind address")] = "127.0.0.1",
    profile: Annotated[
        str | None, typer.Option(help="Fault profile(s), comma-separated; see below")
    ] = None,
    latency_ms: Annotated[float, typer.Option(help="Added latency per request")] = 0.0,
    config: ConfigOpt = None,
) -> None:
    """Run the OpenAI-compatible fake provider (fault injection for tests and benchmarks)."""
    from ncap.cli.fake_upstream import run_fake_upstream

    _use_uvloop()
    run_fake_upstream(host, port, profile, latency_ms)


def _mount() -> None:
    from ncap.cli.ledger import ledger_app, reconcile_app
    from ncap.cli.stores import migrate

    app.add_typer(ledger_app, name="ledger")
    app.add_typer(reconcile_app, name="reconcile")
    app.command("migrate")(migrate)
    from ncap.cli.reports import audit, generate, report_app

    app.command("audit")(audit)
    app.add_typer(report_app, name="report")
    ledger_app.command("generate")(generate)


_mount()


def _mount_optional() -> None:
    """Sub-apps whose modules pull heavier imports are mounted when present."""
    try:
        from ncap.cli.engine import engine_app
    except ImportError:
        return
    app.add_typer(engine_app, name="engine", help="The local llama.cpp engine on its own.")


_mount_optional()


def main() -> None:
    """Run the CLI; map every error a user can cause to a message and an exit status."""
    try:
        app()
    except NcapError as exc:  # raised outside a command (e.g. while mounting)
        _print_problems(exc)
        sys.exit(2)
    except BrokenPipeError:
        try:
            _reader_left()
        except typer.Exit:
            sys.exit(0)
    except OSError as exc:
        _print_os_error(exc)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        if os.environ.get("NCAP_DEBUG"):
            raise
        err.print(
            f"[red]internal error[/red] {type(exc).__name__} (this is a bug in ncap; "
            "NCAP_DEBUG=1 shows the traceback)",
            highlight=False,
        )
        sys.exit(1)


def _reader_left() -> NoReturn:
    """The reader of stdout closed it (``ncap ledger export | head -1``): it has what it
    wanted, so stop quietly with status 0 rather than report an error nobody made.
    Python would flush stdout again at exit and fail the same way: point it at
    /dev/null first."""
    try:
        fileno = sys.stdout.fileno()
    except (OSError, ValueError):  # a test runner's captured stdout: nothing to redirect
        raise typer.Exit(0) from None
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fileno)
    raise typer.Exit(0)


def _print_problems(exc: NcapError) -> None:
    for problem in getattr(exc, "problems", None) or [str(exc)]:
        err.print(f"[red]error[/red] {problem}", highlight=False, soft_wrap=True)


def _print_os_error(exc: OSError) -> None:
    """A port in use, a directory that cannot be written, …: the OS's words."""
    where = f": {exc.filename}" if exc.filename else ""
    err.print(f"[red]error[/red] {exc.strerror or exc}{where}", highlight=False)


def _print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


if __name__ == "__main__":
    main()
