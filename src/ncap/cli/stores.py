"""``ncap migrate``: bring the configured stores to the current schema revision.

Opening a store migrates it too (SQLite under its write lock, PostgreSQL under an
advisory lock), so gateways starting together are safe; this command lets an operator
upgrade ahead of a deploy and see the revision each store is at.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer

from ncap.config import Config
from ncap.stores import migrate_stores

__all__ = ["migrate"]


def migrate(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config")] = None,
) -> None:
    """Apply pending schema migrations to the configured ledger and budget stores."""
    from ncap.cli._load import load_or_exit

    cfg: Config = load_or_exit(config)
    versions = asyncio.run(migrate_stores(cfg.stores.ledger, cfg.stores.budgets))
    typer.echo(json.dumps(versions))
