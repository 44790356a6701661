"""Synthetic ledgers for tests, benchmarks and demos (``ncap ledger generate``).

The rows are what the gateway would write (the real schema of
``stores/sqlite/ledger.py``, one row per attempt): five workloads on four routes,
omitted and explicit ``n``, exceptions (one of them expired while a stale replica
kept using it, one close to its budget), denials by reason, retries after timeouts
and 429s, fallbacks, emulated fan-out branches, returned-count mismatches, streams
cut without usage (pending), reconciled rows, and from ``shift_day`` on a client
library change that makes ``support-draft`` send ``n=2`` (a requested-candidate
distribution shift, mostly denied). Everything is drawn from one seeded
``random.Random``, so a spec always gives the same ledger.

Speed: rows are plain tuples written with ``executemany`` in one transaction
(``synchronous=OFF`` while generating; the file is a normal WAL ledger afterwards).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import random
import sqlite3
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

from ncap.domain.events import LEDGER_COLUMNS
from ncap.stores import SQLiteLedgerStore, ensure_report_indexes

__all__ = ["LedgerSpec", "generate_ledger", "synthetic_config"]

BATCH = 20_000
# USD per Mtok == micro-USD per token
_PRICES = {
    "primary-chat": (0.15, 0.60, "gpt-4o-mini"),
    "secondary-chat": (0.25, 1.00, "claude-haiku"),
    "emulated-chat": (0.10, 0.40, "mistral-small"),
    "local-smollm2": (0.0, 0.0, "smollm2"),
}


@dataclass(frozen=True, slots=True)
class _Profile:
    name: str
    weight: float
    alias: str
    chain: tuple[str, ...]
    requested: tuple[tuple[int | None, float], ...]
    max_candidates: int
    exception: str | None
    ceiling: int
    stream: float
    output_mean: float


_PROFILES = (
    _Profile(
        "support-draft",
        0.45,
        "approved-standard",
        ("primary-chat", "secondary-chat"),
        ((None, 0.7), (1, 0.3)),
        1,
        None,
        512,
        0.3,
        180.0,
    ),
    _Profile(
        "support-eval",
        0.15,
        "approved-standard",
        ("primary-chat", "secondary-chat"),
        ((4, 0.9), (1, 0.07), (6, 0.03)),
        1,
        "eval-q4",
        512,
        0.0,
        220.0,
    ),
    _Profile(
        "brainstorm",
        0.15,
        "emulated",
        ("emulated-chat",),
        ((2, 0.6), (3, 0.4)),
        1,
        "brainstorm-3",
        256,
        0.0,
        120.0,
    ),
    _Profile(
        "batch-summarize",
        0.15,
        "smollm2",
        ("local-smollm2",),
        ((None, 1.0),),
        1,
        None,
        1024,
        1.0,
        300.0,
    ),
    _Profile(
        "ranker",
        0.10,
        "approved-standard",
        ("primary-chat", "secondary-chat"),
        ((3, 0.95), (None, 0.05)),
        1,
        "ranker-3",
        128,
        0.0,
        60.0,
    ),
)
_SHIFTED = ((None, 0.4), (1, 0.2), (2, 0.4))


@dataclass(frozen=True, slots=True)
class LedgerSpec:
    """What to generate; ``end`` defaults to the current hour, ``shift_day`` to 2 days
    before ``end``. ``rename`` maps a workload to another name (e.g. a canary)."""

    rows: int = 100_000
    days: int = 14
    end: datetime | None = None
    seed: int = 11
    shift_day: date | None = None
    rename: Mapping[str, str] = field(default_factory=dict)
    # a workload (its generator name) whose traffic halves on that UTC day
    dips: Mapping[str, date] = field(default_factory=dict)

    def resolved_end(self) -> datetime:
        end = self.end or datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        return end.astimezone(UTC)

    def resolved_shift(self) -> date:
        return self.shift_day or (self.resolved_end() - timedelta(days=2)).date()


def synthetic_config(spec: LedgerSpec, ledger_path: str | Path) -> dict[str, Any]:
    """A config (YAML-ready dict) whose workloads, exceptions and routes match the
    ledger ``spec`` generates, with ``stores.ledger`` pointing at ``ledger_path``."""
    end = spec.resolved_end()
    names = {p.name: spec.rename.get(p.name, p.name) for p in _PROFILES}
    route = {
        "provider": "openai",
        "base_url": "http://127.0.0.1:9100/v1",
        "contract": {"candidates": "native", "max_candidates": 8},
    }
    return {
        "stores": {"ledger": f"sqlite:///{Path(ledger_path).resolve()}", "budgets": "memory://"},
        "workloads": {"default": {"max_candidates": 1}}
        | {
            names[p.name]: {"max_candidates": p.max_candidates, "output_ceiling": p.ceiling}
            for p in _PROFILES
        },
        "exceptions": [_exception(e, names, end) for e in _EXCEPTIONS],
        "models": {
            "approved-standard": ["primary-chat", "secondary-chat"],
            "emulated": ["emulated-chat"],
            "smollm2": ["local-smollm2"],
        },
        "routes": {
            rid: {
                **route,
                "upstream_model": model,
                "pricing": {"input_per_mtok": pin, "output_per_mtok": pout},
            }
            if rid != "local-smollm2"
            else {"provider": "local", "contract": {"candidates": "native", "max_candidates": 32}}
            for rid, (pin, pout, model) in _PRICES.items()
        },
        "reports": {
            "thresholds": {
                "output_tokens_per_request_p95": 1500,
                "denial_rate": 0.05,
                "pending_age": "24h",
            }
        },
    }


# id, workload, owner, max, ceiling, budget USD, expires relative to end
_EXCEPTIONS = (
    ("eval-q4", "support-eval", "finops@example.com", 4, 512, 250.0, timedelta(days=30)),
    ("brainstorm-3", "brainstorm", "product@example.com", 3, 256, 40.0, timedelta(days=-4)),
    ("ranker-3", "ranker", "search@example.com", 3, 128, 5.0, timedelta(days=60)),
)


def _exception(e: tuple[Any, ...], names: Mapping[str, str], end: datetime) -> dict[str, Any]:
    eid, workload, owner, top, ceiling, budget, expires = e
    return {
        "id": eid,
        "workload": names[workload],
        "owner": owner,
        "max_candidates": top,
        "output_ceiling": ceiling,
        "budget_usd": budget,
        "expires": (end + expires).isoformat().replace("+00:00", "Z"),
        "reason": "synthetic",
    }


_ROW_ORDER = (
    "timestamp",
    "request_id",
    "attempt",
    "workload_id",
    "environment",
    "route_id",
    "model_alias",
    "upstream_model",
    "provider_request_id",
    "requested_candidate_count",
    "effective_candidate_count",
    "returned_candidate_count",
    "exception_id",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens_total",
    "reasoning_tokens",
    "total_tokens",
    "reserved_input_tokens",
    "reserved_output_tokens",
    "reserved_cost_micros",
    "cost_micros",
    "finish_reasons",
    "stream_mode",
    "usage_source",
    "quota_scope",
    "policy_result",
    "policy_reason",
    "state",
    "reconciliation_reason",
    "gateway_instance",
    "latency_ms",
    "output_tokens_per_choice",
    "candidates_compared",
    "candidates_distinct",
    "candidates_majority",
    "candidates_tool_calls",
)


# later columns (denial details, upstream status, …) are nullable: generated rows
# leave them null
_INSERT = (
    f"INSERT INTO ledger_events ({', '.join(_ROW_ORDER)}) "
    f"VALUES ({', '.join('?' for _ in _ROW_ORDER)})"
)


def _check_order() -> None:
    """The generator writes positional tuples of the columns it knows; fail loudly if
    one of them leaves the schema."""
    missing = set(_ROW_ORDER) - set(LEDGER_COLUMNS)
    if missing:
        raise RuntimeError(f"ledger columns {sorted(missing)} are gone; update ledger_gen")


def _text(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def generate_ledger(
    path: str | Path, spec: LedgerSpec, *, progress: Callable[[int], None] | None = None
) -> int:
    """Write ``spec.rows`` rows into a new ledger file at ``path``; returns the count."""
    _check_order()
    target = Path(path)
    if target.exists():
        raise FileExistsError(f"{target} exists; generate into a new file")
    _create_schema(target)
    conn = sqlite3.connect(target, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous = OFF")
        written = 0
        conn.execute("BEGIN")
        for batch in _batches(_rows(spec), spec.rows):
            conn.executemany(_INSERT, batch)
            written += len(batch)
            if progress:
                progress(written)
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    ensure_report_indexes(target)  # as a gateway's start-up would
    return written


def _create_schema(path: Path) -> None:
    """The real store creates (and migrates) the file, so the schema is exactly its."""
    asyncio.run(SQLiteLedgerStore(path).close())


def _batches(rows: Iterator[tuple[Any, ...]], limit: int) -> Iterator[list[tuple[Any, ...]]]:
    batch: list[tuple[Any, ...]] = []
    for count, row in enumerate(rows, 1):
        batch.append(row)
        if len(batch) >= BATCH:
            yield batch
            batch = []
        if count >= limit:
            break
    if batch:
        yield batch


@dataclass(slots=True)
class _Draw:
    """Per-generation state: the random source, the clock frame, the names."""

    rng: random.Random
    end: datetime
    days: int
    shift: str
    names: dict[str, str]
    brainstorm_expiry: str
    day_texts: tuple[str, ...]
    instances: tuple[str, ...] = ("gw-a", "gw-b", "gw-c")
    dips: Mapping[str, str] = field(default_factory=dict)


def _rows(spec: LedgerSpec) -> Iterator[tuple[Any, ...]]:
    end = spec.resolved_end()
    draw = _Draw(
        random.Random(spec.seed),
        end,
        spec.days,
        spec.resolved_shift().isoformat(),
        {p.name: spec.rename.get(p.name, p.name) for p in _PROFILES},
        _text(end + _EXCEPTIONS[1][6]),
        tuple((end - timedelta(days=d + 1)).strftime("%Y-%m-%d") for d in range(spec.days)),
        dips={name: day.isoformat() for name, day in spec.dips.items()},
    )
    cum = list(itertools.accumulate(p.weight for p in _PROFILES))
    number = 0
    while True:
        number += 1
        profile = draw.rng.choices(_PROFILES, cum_weights=cum)[0]
        yield from _request(draw, profile, f"req-syn-{number:08x}")


def _stamp(draw: _Draw) -> str:
    """A time in the span, weighted to working hours (UTC), as the ledger's text."""
    rng = draw.rng
    day = draw.day_texts[rng.randrange(draw.days)]
    hour = min(23, max(0, int(rng.gauss(13, 4))))
    rest = rng.randrange(3_600_000_000)
    minute, rest = divmod(rest, 60_000_000)
    second, micro = divmod(rest, 1_000_000)
    return f"{day}T{hour:02d}:{minute:02d}:{second:02d}.{micro:06d}Z"


def _pick(rng: random.Random, choices: tuple[tuple[int | None, float], ...]) -> int | None:
    x = rng.random()
    for value, weight in choices:
        x -= weight
        if x < 0:
            return value
    return choices[-1][0]


def _request(draw: _Draw, p: _Profile, request_id: str) -> Iterator[tuple[Any, ...]]:
    rng = draw.rng
    ts = _stamp(draw)
    dip = draw.dips.get(p.name)
    if dip is not None and ts.startswith(dip) and rng.random() < 0.5:
        return  # the planted dip: half of this workload's requests that day never came
    mix = _SHIFTED if p.name == "support-draft" and ts >= draw.shift else p.requested
    requested = _pick(rng, mix)
    effective = requested or 1
    grant = p.exception if effective > p.max_candidates else None
    top = max(
        p.max_candidates,
        3
        if grant == "brainstorm-3"
        else 4
        if grant == "eval-q4"
        else 3
        if grant == "ranker-3"
        else 1,
    )
    if grant == "brainstorm-3" and ts >= draw.brainstorm_expiry and rng.random() < 0.9:
        grant, top = None, 1  # the exception expired; only a stale replica still uses it
    base = _Base(
        draw.names[p.name],
        p,
        ts,
        request_id,
        requested,
        effective,
        grant,
        rng.choice(draw.instances),
        p.stream > 0 and rng.random() < p.stream,
    )
    reason = _denial(rng, effective, top)
    if reason is not None:
        yield base.denied(reason)
        return
    yield from _attempts(rng, base)


def _denial(rng: random.Random, effective: int, top: int) -> str | None:
    if effective > top:
        return "candidate_count_exceeds_policy"
    x = rng.random()
    if effective > 1 and x < 0.01:
        return "candidates_with_greedy_sampling"
    if x < 0.015:
        return "output_ceiling_exceeds_policy"
    if x < 0.02:
        return "budget_exhausted"
    if x < 0.022:
        return "rate_limit_exceeded"
    return None


@dataclass(frozen=True, slots=True)
class _Base:
    workload: str
    profile: _Profile
    ts: str
    request_id: str
    requested: int | None
    effective: int
    exception_id: str | None
    instance: str
    stream: bool

    def row(self, attempt: int, route: str, **f: Any) -> tuple[Any, ...]:
        """One row, in ``LEDGER_COLUMNS`` order (checked by ``_check_order``)."""
        pin, pout, model = _PRICES[route]
        per_attempt = 1 if route == "emulated-chat" else self.effective
        r_in = f.get("reserved_input", 1000)
        r_out = per_attempt * self.profile.ceiling
        return (
            self.ts,
            self.request_id,
            attempt,
            self.workload,
            "production",
            route,
            self.profile.alias,
            model,
            f.get("provider_request_id"),
            self.requested,
            self.effective,
            f.get("returned"),
            self.exception_id,
            f.get("input"),
            f.get("cached"),
            f.get("output"),
            None,
            f.get("total"),
            r_in,
            r_out,
            math.ceil(r_in * pin + r_out * pout),
            f.get("cost"),
            f.get("finish", "{}"),
            int(self.stream),
            f.get("usage_source", "none"),
            "global",
            "allow",
            "within_exception" if self.exception_id else "within_default",
            f["state"],
            f.get("reason"),
            self.instance,
            f.get("latency"),
            f.get("per_choice"),
            *f.get("evidence", (None, None, None, None)),
        )

    def denied(self, reason: str) -> tuple[Any, ...]:
        row = list(self.row(0, self.profile.chain[0], state="denied"))
        row[LEDGER_COLUMNS.index("policy_result")] = "deny"
        row[LEDGER_COLUMNS.index("policy_reason")] = reason
        row[LEDGER_COLUMNS.index("reserved_cost_micros")] = 0
        return tuple(row)


def _usage(rng: random.Random, base: _Base, route: str, choices: int) -> dict[str, Any]:
    pin, pout, _ = _PRICES[route]
    inp = max(20, int(rng.lognormvariate(6.5, 0.5)))
    out = sum(
        min(base.profile.ceiling, max(1, int(rng.expovariate(1 / base.profile.output_mean))))
        for _ in range(choices)
    )
    cached = inp // 2 if rng.random() < 0.2 else 0
    return {
        "input": inp,
        "cached": cached,
        "output": out,
        "total": inp + out,
        "cost": math.ceil(inp * pin + out * pout),
        "returned": choices,
        "usage_source": "provider_stream" if base.stream else "provider_response",
        "finish": f'{{"stop": {choices}}}',
        "latency": round(rng.uniform(200, 4000), 1),
        "reserved_input": int(inp * 1.1) + 8,
    }


def _attempts(rng: random.Random, base: _Base) -> Iterator[tuple[Any, ...]]:
    chain = base.profile.chain
    if chain[0] == "emulated-chat":
        for k in range(1, base.effective + 1):
            usage = _usage(rng, base, chain[0], 1)
            if k == 1:  # the request's evidence, on its first branch
                usage["evidence"] = _evidence(base.request_id, base.effective)
            yield base.row(
                k,
                chain[0],
                state="settled",
                per_choice=str(usage["output"]),  # a branch's own usage: one choice
                provider_request_id=f"{base.request_id}-b{k}",
                **usage,
            )
        return
    attempt, x = 1, rng.random()
    if len(chain) > 1 and x < 0.03:  # a timeout, then a retry on the same route
        yield base.row(
            attempt,
            chain[0],
            state="usage_reconciliation_required",
            reason="timeout",
            provider_request_id=None,
        )
        attempt += 1
    elif len(chain) > 1 and x < 0.04:  # a 429 refusal: settled at zero, then a retry
        yield base.row(
            attempt,
            chain[0],
            state="settled",
            returned=0,
            input=0,
            output=0,
            total=0,
            cost=0,
            cached=0,
            usage_source="provider_response",
        )
        attempt += 1
    route = chain[1] if len(chain) > 1 and 0.04 <= x < 0.045 else chain[0]
    if route != chain[0]:  # a 5xx after dispatch on the primary, then the fallback
        yield base.row(
            attempt,
            chain[0],
            state="usage_reconciliation_required",
            reason="upstream_error_after_dispatch",
        )
        attempt += 1
    yield _final(rng, base, attempt, route)


def _final(rng: random.Random, base: _Base, attempt: int, route: str) -> tuple[Any, ...]:
    usage = _usage(rng, base, route, base.effective)
    prid = f"prov-{base.request_id}-{attempt}"
    y = rng.random()
    if base.stream and y < 0.006:  # a stream cut without usage: pending, held
        return base.row(
            attempt,
            route,
            state="pending",
            reason="stream_cut",
            provider_request_id=prid,
            returned=base.effective,
            reserved_input=usage["reserved_input"],
        )
    if y < 0.009 and base.effective > 1:  # fewer choices than asked
        return base.row(
            attempt,
            route,
            state="usage_reconciliation_required",
            reason="returned_mismatch",
            provider_request_id=prid,
            returned=base.effective - 1,
            reserved_input=usage["reserved_input"],
        )
    if y < 0.012:  # was pending, then reconciled from the provider's export
        usage.update(usage_source="reconciliation_import")
        return base.row(
            attempt,
            route,
            state="reconciled",
            reason="usage_missing",
            provider_request_id=prid,
            **usage,
        )
    if route == "local-smollm2":  # the engine reveals each choice's tokens
        usage["per_choice"] = _split(usage["output"], base.effective)
    usage["evidence"] = _evidence(base.request_id, base.effective)
    return base.row(attempt, route, state="settled", provider_request_id=prid, **usage)


def _evidence(request_id: str, k: int) -> tuple[int | None, ...]:
    """Synthetic candidate evidence for k candidates, from a hash of the request id (no
    random draw, so the rest of the ledger is the same as before the columns existed):
    d distinct of k, the largest group between its least (ceil(k/d)) and its most
    (k − d + 1), every candidate or none calling a tool."""
    if k < 2:
        return (None, None, None, None)
    h = hashlib.blake2b(request_id.encode(), digest_size=4).digest()
    distinct = 1 + h[0] % k
    majority = k - distinct + 1 if h[1] % 2 else -(-k // distinct)
    return (k, distinct, majority, k if h[2] % 5 == 0 else 0)


def _split(total: int, choices: int) -> str:
    """Synthetic per-choice counts (no random draw, so the rest of the ledger is the same
    as before the column existed): ``total`` over ``choices``, the first ones longer."""
    q, r = divmod(total, choices)
    return ",".join(str(q + (1 if i < r else 0)) for i in range(choices))
