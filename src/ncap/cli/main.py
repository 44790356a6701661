"""The ``ncap`` command line (typer + rich). Every command takes ``--config``."""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console

from ncap.config import Config, load_config
from ncap.errors import ConfigError

__all__ = ["app", "main"]

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
keys_app = typer.Typer(no_args_is_help=True, help="API keys (stored hashed).")
app.add_typer(keys_app, name="keys")

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="YAML config (default: ./ncap.yaml, else built-in)"),
]
err = Console(stderr=True)


def load_or_exit(path: Path | None) -> Config:
    """The config, or every problem printed and exit status 2."""
    return _config(path)


def _config(path: Path | None) -> Config:
    try:
        return load_config(path)
    except ConfigError as exc:
        for problem in exc.problems:
            err.print(f"[red]error[/red] {problem}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


@app.command()
def serve(
    config: ConfigOpt = None,
    host: Annotated[str | None, typer.Option(help="Bind address")] = None,
    port: Annotated[int | None, typer.Option(help="Port")] = None,
) -> None:
    """Run the gateway."""
    from aiohttp import web

    from ncap.http.app import create_app

    cfg = _config(config)
    server = cfg.server.model_copy(
        update={k: v for k, v in (("host", host), ("port", port)) if v is not None}
    )
    cfg = cfg.model_copy(update={"server": server})
    if not server.is_loopback and not cfg.keys:
        err.print(
            f"[red]refusing to start[/red]: bound to {server.host}, which is not loopback, "
            "with no API keys configured (create one with `ncap keys create`)."
        )
        raise typer.Exit(2)
    _use_uvloop()
    err.print(f"ncap listening on http://{server.host}:{server.port}", highlight=False)
    web.run_app(create_app(cfg), host=server.host, port=server.port, access_log=None, print=None)


def _use_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


@app.command("check-config")
def check_config(
    file: Annotated[Path | None, typer.Argument(help="Config file to check")] = None,
    config: ConfigOpt = None,
) -> None:
    """Validate a config file; print the resolved config or every problem with its place."""
    cfg = _config(file or config)
    typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


@keys_app.command("create")
def keys_create(
    workload: Annotated[str, typer.Option(help="Workload the key maps to")],
    environment: Annotated[str, typer.Option(help="Environment label")] = "production",
    config: ConfigOpt = None,
) -> None:
    """Print a new API key once; store only its SHA-256 hash in the config file."""
    from ncap.auth import hash_key

    path = config or Path("ncap.yaml")
    raw: dict[str, Any] = {}
    if path.exists():
        raw = yaml.safe_load(path.read_text()) or {}
    cfg = _config(path) if path.exists() else load_config(None)
    if workload not in cfg.workloads:
        err.print(f"[red]error[/red] unknown workload {workload!r}; add it to {path} first")
        raise typer.Exit(2)
    key = "ncap-" + secrets.token_urlsafe(32)
    entry = {"hash": hash_key(key), "workload": workload, "environment": environment}
    raw.setdefault("keys", []).append(entry)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    err.print(f"stored the key's hash in {path}; the key is shown once:")
    typer.echo(key)


@app.command("fake-upstream")
def fake_upstream(
    port: Annotated[int, typer.Option(help="Port")] = 9100,
    host: Annotated[str, typer.Option(help="Bind address")] = "127.0.0.1",
    profile: Annotated[str | None, typer.Option(help="Fault profile(s), comma-separated")] = None,
    latency_ms: Annotated[float, typer.Option(help="Added latency per request")] = 0.0,
    config: ConfigOpt = None,
) -> None:
    """Run the OpenAI-compatible fake provider (fault injection for tests and benchmarks)."""
    from ncap.cli.fake_upstream import run_fake_upstream

    _use_uvloop()
    run_fake_upstream(host, port, profile, latency_ms)


def _mount() -> None:
    from ncap.cli.ledger import ledger_app, reconcile_app

    app.add_typer(ledger_app, name="ledger")
    app.add_typer(reconcile_app, name="reconcile")


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
    try:
        app()
    except ConfigError as exc:
        for problem in exc.problems:
            err.print(f"[red]error[/red] {problem}", highlight=False, soft_wrap=True)
        sys.exit(2)


def _print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


if __name__ == "__main__":
    main()
