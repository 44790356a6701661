"""``ncap probe ROUTE``: ask a configured route what it does with ``n``, and record it.

Two requests go through the route's own provider (so through the Gemini translator on a
``gemini`` route, exactly as the gateway would send them): ``n`` = 2 whole, then
streamed with ``include_usage`` (``n`` = 1 when the first was refused, so that the stream
still tells whether usage arrives; ``n`` = 1 both times on a provider without ``n``,
recorded as ``emulate``). On a provider that caches prompts, one long prompt is sent
twice more: cached tokens on the repeat record ``prompt_cache``. ``ncap.domain.probe``
derives the contract record from the answers; it is written into the config file
(``cli/contract_record.py``) when there is one, and printed either way. Nothing is
sent for a route the config does not name, and an inconclusive probe (429, 5xx, a
refused credential) writes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ncap import __version__
from ncap.cli.contract_record import contract_fields, write_contract_record
from ncap.config import Config, Fingerprint, Route
from ncap.domain.probe import (
    ProbeFindings,
    ProbeReply,
    StreamReply,
    cache_probe_request,
    derive_contract,
    derive_emulated_contract,
    probe_requests,
)
from ncap.errors import ConfigError, NcapError
from ncap.lifecycle.failures import client_error
from ncap.providers import capabilities_of, provider_for
from ncap.providers.base import AttemptFailed, Provider

__all__ = ["print_findings", "probe_route", "record_findings"]

PROBE_N = 2
PROBE_CEILING = 16


async def probe_route(config: Config, route_id: str) -> ProbeFindings:
    """Send the probe's requests through ``route_id``'s provider; derive its record.

    A provider without ``n`` (its capabilities say so) is probed with one candidate and
    recorded as ``emulate``. A provider that caches prompts is sent one long prompt
    twice: cached tokens on the repeat record ``prompt_cache: true``.

    Raises ``ConfigError`` for a route that is not configured (nothing is sent) and
    ``ProbeInconclusive`` when the answers prove nothing."""
    route = config.routes.get(route_id)
    if route is None:
        known = ", ".join(sorted(config.routes)) or "none"
        raise ConfigError(f"route {route_id!r} is not configured (configured routes: {known})")
    caps = capabilities_of(route.provider)
    native = "native" in caps.candidates
    provider = provider_for(route, route_id=route_id)
    try:
        body, streamed = probe_requests(
            route.upstream_model or route_id, n=PROBE_N if native else 1, ceiling=PROBE_CEILING
        )
        if not native:
            body, streamed = _one(body), _one(streamed)
        reply = await _whole(provider, route, body)
        if reply.status != 200 and _refused_n(reply.body):
            streamed = {k: v for k, v in streamed.items() if k != "n"}
        stream = await _stream(provider, route, streamed)
        cached = caps.prompt_cache != "none" and await _caches(provider, route, caps.prompt_cache)
    finally:
        await provider.aclose()
    common: dict[str, Any] = {
        "previous": route.contract,
        "fingerprint": Fingerprint(
            provider=route.provider,
            upstream_model=route.upstream_model,
            gateway_version=__version__,
        ),
        "now": datetime.now(UTC),
        "prompt_cache": cached,
    }
    if not native:
        return derive_emulated_contract(reply, stream, **common)
    return derive_contract(reply, stream, requested_n=PROBE_N, ceiling=PROBE_CEILING, **common)


def _one(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "n"}


async def _caches(provider: Provider, route: Route, mode: str) -> bool:
    """Whether a long prompt sent twice comes back cached the second time (marked with
    a cache breakpoint where the provider caches only what is marked)."""
    body = cache_probe_request(route.upstream_model or "", explicit=mode == "explicit")
    for _ in range(2):
        try:
            result = await provider.complete(body, timeout=route.timeout_s)
        except (AttemptFailed, NcapError):
            return False
    usage = result.summary.usage
    details = usage.prompt_tokens_details if usage is not None else None
    return bool(details is not None and details.cached_tokens)


def record_findings(path: Path, route_id: str, findings: ProbeFindings) -> None:
    write_contract_record(path, route_id, findings.contract)


async def _whole(provider: Provider, route: Route, body: Mapping[str, Any]) -> ProbeReply:
    try:
        result = await provider.complete(body, timeout=route.timeout_s)
    except (AttemptFailed, NcapError) as exc:
        error = _client_error(exc)
        return ProbeReply(error.status, error.envelope())
    return ProbeReply(200, json.loads(result.body))


async def _stream(provider: Provider, route: Route, body: Mapping[str, Any]) -> StreamReply:
    chunks: list[dict[str, Any]] = []
    try:
        async with provider.stream(body, timeout=route.timeout_s) as (_, events):
            async for event in events:
                if event.summary is not None and event.data:
                    chunks.append(json.loads(event.data))
    except (AttemptFailed, NcapError) as exc:
        error = _client_error(exc)
        return StreamReply(error.status, error=error.envelope())
    return StreamReply(200, chunks)


def _client_error(exc: AttemptFailed | NcapError) -> NcapError:
    """What the gateway's client would have been told (so the probe reads the same)."""
    return exc if isinstance(exc, NcapError) else client_error(exc)


def _refused_n(body: Mapping[str, Any]) -> bool:
    error = body.get("error")
    return isinstance(error, Mapping) and (
        error.get("code") == "route_does_not_support_candidates" or error.get("param") == "n"
    )


def print_findings(console: Console, route_id: str, findings: ProbeFindings) -> None:
    """One table: what came back, and the record derived from it."""
    table = Table(title=f"probe of route {route_id}", show_header=True)
    table.add_column("finding")
    table.add_column("value")
    rows: list[tuple[str, Any]] = [
        ("n=2 answer", findings.candidates),
        ("choices returned", findings.returned),
        ("stream choice indexes", findings.stream_indexes),
        ("stated maximum", findings.stated_maximum if findings.stated_maximum else "-"),
        ("model reported", findings.reported_model or "-"),
    ]
    rows += [(f"contract.{k}", _shown(v)) for k, v in contract_fields(findings.contract).items()]
    for name, value in rows:
        table.add_row(name, str(value))
    console.print(table)
    for note in findings.notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)
