"""Reconciliation of rows the provider never named, by ncap's own ids.

A ``gateway_lost`` or ``timeout`` row has no provider request id (the gateway never
saw the answer's head), so an import keyed by it cannot find them. ncap sends its own
id with every attempt (``X-Client-Request-Id: <request id>#<attempt>``, which OpenAI
keeps and shows in its logs), so:

- ``ncap reconcile import`` matches rows that carry ``client_request_id`` instead of a
  provider id by that (``import_by_client_id``);
- ``ncap reconcile settle REQUEST_ID`` / ``release REQUEST_ID`` let an operator close a
  row by hand, with a reason the ledger keeps on the row (``reconciliation_reason``
  becomes ``<why it was pending>; settled by <actor>: <reason>``) and a line on
  standard output: never silent. ``release`` settles at zero (nothing was billed,
  e.g. the provider's logs show the request never arrived); ``settle`` at the given
  usage. The budget hold is settled first, then the row, as the gateway does.
"""

from __future__ import annotations

import asyncio
import getpass
import json
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

import typer

from ncap.config import Config, Pricing, utcnow
from ncap.domain.events import UNSETTLED_STATES, LedgerEvent, ReconciliationRow, reconcile
from ncap.domain.money import cost_micros, micros_from_usd
from ncap.errors import ConfigError
from ncap.stores import ImportResult, LedgerStore, budgets_from_url, hold_id_for, ledger_from_url

__all__ = ["import_by_client_id", "merge_results", "operator_commands"]

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config")]
ReasonOpt = Annotated[
    str, typer.Option("--reason", help="Why (kept on the row: the ledger's audit of it)")
]
AttemptOpt = Annotated[
    int | None, typer.Option("--attempt", help="The attempt (default: the one unsettled)")
]
ActorOpt = Annotated[str | None, typer.Option("--actor", help="Who (default: the login name)")]


def split_client_id(client_id: str) -> tuple[str, int | None]:
    """``req-…#2`` -> (``req-…``, 2); a bare request id -> (it, None)."""
    request_id, sep, attempt = client_id.rpartition("#")
    if sep and attempt.isdigit():
        return request_id, int(attempt)
    return client_id, None


def _unsettled(events: Sequence[LedgerEvent], attempt: int | None) -> list[LedgerEvent]:
    if attempt is not None:
        return [e for e in events if e.attempt == attempt]
    pending = [e for e in events if e.state in UNSETTLED_STATES]
    return pending or [e for e in events if e.state == "reconciled"]


async def import_by_client_id(
    ledger: LedgerStore, rows: Sequence[ReconciliationRow], pricing: Mapping[str, Pricing]
) -> ImportResult:
    """Reconcile rows keyed by the client request id ncap sent; the same outcomes as an
    import by provider id (re-importing changes nothing)."""
    result = ImportResult()
    for row in rows:
        cid = row.client_request_id or ""
        request_id, attempt = split_client_id(cid)
        hits = _unsettled(await ledger.get(request_id), attempt)
        if len(hits) != 1:
            (result.ambiguous if hits else result.unmatched).append(cid)
            continue
        outcome, updated = reconcile(hits[0], row, pricing.get(hits[0].route_id or ""))
        if outcome == "reconciled":
            await ledger.update(updated.request_id, updated.attempt, **_usage_of(updated))
            result.reconciled.append(updated)
        else:
            bucket = {"conflict": "conflicts"}.get(outcome, outcome)
            getattr(result, bucket).append(cid)
    return result


def _usage_of(event: LedgerEvent) -> dict[str, Any]:
    names = (
        "input_tokens",
        "cached_input_tokens",
        "output_tokens_total",
        "reasoning_tokens",
        "total_tokens",
        "cost_micros",
        "usage_source",
        "state",
    )
    return {n: getattr(event, n) for n in names}


def merge_results(into: ImportResult, other: ImportResult) -> None:
    for name in ImportResult.__dataclass_fields__:
        getattr(into, name).extend(getattr(other, name))


# -- the operator's commands -------------------------------------------------------------


def operator_commands(app: typer.Typer) -> None:
    """``settle`` and ``release`` on ``ncap reconcile``."""

    @app.command("settle")
    def settle_cmd(
        request_id: Annotated[str, typer.Argument(help="ncap's request id (x-request-id)")],
        reason: ReasonOpt,
        input_tokens: Annotated[int, typer.Option("--input-tokens", min=0)],
        output_tokens: Annotated[int, typer.Option("--output-tokens", min=0)],
        cost_usd: Annotated[
            str | None, typer.Option("--cost-usd", help="Default: the route's prices")
        ] = None,
        attempt: AttemptOpt = None,
        actor: ActorOpt = None,
        config: ConfigOpt = None,
    ) -> None:
        """Settle an unsettled row (gateway_lost, timeout, …) at the usage the provider's
        records show, by ncap's request id; the reason is kept on the row."""
        cost = _cost(cost_usd)
        usage = (input_tokens, output_tokens, cost)
        _operate(request_id, attempt, reason, actor, config, usage, "settled")

    @app.command("release")
    def release_cmd(
        request_id: Annotated[str, typer.Argument(help="ncap's request id (x-request-id)")],
        reason: ReasonOpt,
        attempt: AttemptOpt = None,
        actor: ActorOpt = None,
        config: ConfigOpt = None,
    ) -> None:
        """Release an unsettled row's hold: settled at zero (nothing was billed), by
        ncap's request id; the reason is kept on the row."""
        _operate(request_id, attempt, reason, actor, config, (0, 0, 0), "released")


def _cost(cost_usd: str | None) -> int | None:
    if cost_usd is None:
        return None
    try:
        micros = micros_from_usd(cost_usd.strip())
    except (ValueError, ArithmeticError):
        micros = None
    if micros is None or micros < 0:
        raise typer.BadParameter("an amount of USD, e.g. 0.0012", param_hint="--cost-usd")
    return micros


def _operate(
    request_id: str,
    attempt: int | None,
    reason: str,
    actor: str | None,
    config: Path | None,
    usage: tuple[int, int, int | None],
    verb: str,
) -> None:
    from ncap.cli._load import load_or_exit

    if not reason.strip():
        raise typer.BadParameter("say why (it is kept on the row)", param_hint="--reason")
    cfg = load_or_exit(config)
    who = actor or _login()
    done = asyncio.run(_close_row(cfg, request_id, attempt, reason.strip(), who, usage, verb))
    typer.echo(json.dumps(done, default=str))


def _login() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return "operator"


async def _close_row(
    cfg: Config,
    request_id: str,
    attempt: int | None,
    reason: str,
    actor: str,
    usage: tuple[int, int, int | None],
    verb: str,
) -> dict[str, Any]:
    ledger = ledger_from_url(cfg.stores.ledger, durability=cfg.stores.ledger_durability)
    budgets = budgets_from_url(cfg.stores.budgets)
    try:
        event = _target(await ledger.get(request_id), request_id, attempt, cfg)
        tokens_in, tokens_out, cost = usage
        if cost is None:
            route = cfg.routes.get(event.route_id or "")
            if route is None:
                raise ConfigError(f"{request_id}: no route pricing for it; pass --cost-usd")
            cost = cost_micros(tokens_in, 0, tokens_out, route.pricing)
        was = event.reconciliation_reason or event.state
        fields: dict[str, Any] = {
            "input_tokens": tokens_in,
            "cached_input_tokens": 0,
            "output_tokens_total": tokens_out,
            "total_tokens": tokens_in + tokens_out,
            "cost_micros": cost,
            "usage_source": "reconciliation_import",
            "state": "reconciled",
            "reconciliation_reason": f"{was}; {verb} by {actor}: {reason}",
        }
        hold = hold_id_for(event.request_id, event.attempt)
        held = await budgets.settle(hold, tokens_in + tokens_out, cost)  # the hold first
        await ledger.update(event.request_id, event.attempt, **fields)
        return {
            "request_id": event.request_id,
            "attempt": event.attempt,
            "was": event.state,
            "action": verb,
            "by": actor,
            "reason": reason,
            "total_tokens": tokens_in + tokens_out,
            "cost_micros": cost,
            "hold_settled": held,
        }
    finally:
        await ledger.close()
        await budgets.close()


def _target(
    events: Sequence[LedgerEvent], request_id: str, attempt: int | None, cfg: Config
) -> LedgerEvent:
    """The row to close: the given attempt, else the one unsettled (a row still
    ``reserved`` counts only once past its attempt's time limit: before that, a gateway
    may still be settling it)."""
    if not events:
        raise ConfigError(f"{request_id}: no such request in the ledger")
    stale = utcnow() - timedelta(seconds=cfg.reserved_timeout_s)
    open_ = [
        e
        for e in events
        if (attempt is None or e.attempt == attempt)
        and (e.state in UNSETTLED_STATES or (e.state == "reserved" and e.timestamp < stale))
    ]
    if len(open_) == 1:
        return open_[0]
    if not open_:
        states = ", ".join(f"attempt {e.attempt}: {e.state}" for e in events)
        raise ConfigError(
            f"{request_id}: nothing to settle ({states}); a reserved row is closed by its "
            "gateway until its time limit has passed"
        )
    raise ConfigError(f"{request_id}: several unsettled attempts; pass --attempt")
