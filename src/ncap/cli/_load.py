"""Loading the config for a command: shared by every command module, so none of them
imports the module that mounts it (``cli/main.py``)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from ncap.config import Config, load_config
from ncap.errors import ConfigError

__all__ = ["load_or_exit"]


def load_or_exit(path: Path | None) -> Config:
    """The config, or every problem printed on stderr and exit status 2."""
    try:
        return load_config(path)
    except ConfigError as exc:
        err = Console(stderr=True)
        for problem in exc.problems:
            err.print(f"[red]error[/red] {problem}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
