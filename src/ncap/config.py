"""The YAML configuration (docs/configuration.md), validated on load.

Every field has a default, so an empty file (or none) is the embedded default. The
loader collects *every* problem with its location (``routes.primary-chat.contract.
max_age (line 42)``) instead of stopping at the first one, which is why this module
uses pydantic rather than msgspec: config loading is off the hot path and operators
fix files faster from a full list.
"""

from __future__ import annotations

import difflib
import hashlib
import ipaddress
import re
import types
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from ncap.errors import ConfigError

__all__ = [
    "ROUTE_KINDS",
    "AnthropicRoute",
    "AzureRoute",
    "Config",
    "Contract",
    "ExceptionGrant",
    "GeminiRoute",
    "HttpRoute",
    "KeyEntry",
    "LedgerDurability",
    "LocalRoute",
    "OpenAIRoute",
    "Pricing",
    "Reports",
    "Route",
    "Thresholds",
    "Workload",
    "default_config",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_route",
    "reference_problems",
    "resolved",
    "warnings_for",
]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, None: 1}


def parse_duration(value: str | float | int) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``15s``, ``250ms`` or a number of seconds."""
    if isinstance(value, int | float):
        return timedelta(seconds=float(value))
    m = _DURATION.match(value)
    if not m:
        raise ValueError(f"not a duration: {value!r} (use e.g. 30d, 12h, 90m, 15s)")
    return timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])


def _bare_number(v: float) -> str:
    """The one message for a duration written as a bare YAML number (docs/configuration.md)."""
    return f"a bare number is ambiguous: write the unit, e.g. {v:g}d, {v:g}h or {v:g}s"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Ramp(_Model):
    requests_per_second: float = Field(500.0, gt=0)
    burst: int = Field(1000, ge=1)


class Server(_Model):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    admin_key_env: str = "NCAP_ADMIN_KEY"
    max_in_flight: int = Field(512, ge=1)
    ramp: Ramp = Ramp()
    instance_id: str | None = None
    # heartbeats into the shared store; a gateway silent for heartbeat_timeout_s is
    # lost: its in-flight rows become gateway_lost and its holds stay counted
    heartbeat_interval_s: float = Field(2.0, gt=0)
    heartbeat_timeout_s: float = Field(15.0, gt=0)
    # how long a /metrics scrape may reuse the last store snapshot (ledger and budget
    # gauges); 0 re-reads the stores on every scrape
    metrics_cache_s: float = Field(2.0, ge=0)
    # Idempotency-Key: how long a key is remembered (per workload, in the budget store),
    # and whether the first answer is kept that long to replay it to a repeat
    # (off: a repeat gets 409 naming the first request)
    idempotency_ttl_s: float = Field(86400.0, gt=0)
    idempotency_keep_answers: bool = False
    # a stopping gateway retries the settlements a store refused (an outage) for up to
    # this long; rows still unsettled then are left to recovery (gateway_lost)
    shutdown_retry_s: float = Field(10.0, ge=0, le=600)
    # a bearer token /metrics, /readyz and /openapi.json require (the admin key is
    # accepted too), in this environment variable; None: they are open (/healthz is)
    operations_key_env: str | None = None
    # the dashboard's session cookie: Secure always (true: behind a TLS-terminating
    # proxy, where the gateway itself sees plain HTTP), never (false), or as the
    # connection is (null)
    secure_cookies: bool | None = None
    # failed admin authentications (a wrong admin key, a forged or ended session) per
    # client address and minute; past it every admin attempt from there gets 429
    admin_auth_failures_per_minute: int = Field(10, ge=1)

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


LedgerDurability = Literal["normal", "full"]


class Stores(_Model):
    ledger: str = "sqlite:///.ncap/ledger.db"
    # in-process counters rebuilt from the ledger at start-up (the embedded default)
    budgets: str = "memory://"
    # SQLite ledger: normal survives kill -9, full also power loss (docs/configuration.md)
    ledger_durability: LedgerDurability = "normal"
    # how often each gateway re-reads the admin tables of a shared ledger, so that a
    # change made through another replica applies here too (docs/configuration.md)
    admin_refresh_s: float = Field(5.0, gt=0, le=3600)
    # the longest one call to a shared store (PostgreSQL, Redis) may take: connecting,
    # a pool checkout, one statement or script call; past it the request gets 503
    # store_unavailable (a partitioned server is not waited for)
    timeout_s: float = Field(2.0, gt=0, le=60)

    @field_validator("ledger")
    @classmethod
    def _ledger_scheme(cls, v: str) -> str:
        if not v.startswith(("sqlite://", "postgresql://", "postgres://", "memory://")):
            raise ValueError("ledger store must be sqlite:///PATH or postgresql://…")
        return v

    @field_validator("budgets")
    @classmethod
    def _budget_scheme(cls, v: str) -> str:
        if not v.startswith(("sqlite://", "redis://", "rediss://", "memory://")):
            raise ValueError("budget store must be memory://, sqlite:///PATH or redis://…")
        return v


class Limits(_Model):
    max_candidates_absolute: int = Field(16, ge=1, le=128)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # the rest of the request's size limits (see http/limits.py)
    max_header_bytes: int = Field(8190, ge=1024)  # one header line (aiohttp's default)
    max_headers: int = Field(100, ge=8)
    max_messages: int = Field(2048, ge=1)
    max_stream_s: float = Field(900, gt=0)  # wall clock of one streamed answer
    # a client that stalls: the whole body must arrive within this after the headers,
    # and a streamed answer's client must take each chunk within the other
    body_timeout_s: float = Field(30, gt=0)
    stream_write_timeout_s: float = Field(30, gt=0)
    # the most bytes read of one upstream answer, for routes without their own
    # ``max_answer_bytes``; None: derived per request from n x its output ceiling
    max_upstream_answer_bytes: int | None = Field(None, ge=1024)


# strings people put in an example or a first test: their SHA-256 is no secret, and a
# key that hashes to one would let anyone in (an example config's "placeholders" once did)
_WELL_KNOWN_KEYS = (
    *("", "test", "test1", "test2", "test123", "testing", "password", "passw0rd", "secret"),
    *("changeme", "change-me", "admin", "root", "key", "apikey", "api-key", "api_key"),
    *("sk-test", "sk-xxx", "sk-...", "token", "1234", "12345", "123456", "12345678"),
    *("letmein", "example", "placeholder", "your-api-key", "YOUR_API_KEY", "YOUR_KEY"),
    *("your-key", "ncap", "demo", "default", "foo", "bar", "qwerty", "dev", "local"),
)
WEAK_KEY_HASHES = frozenset(
    "sha256:" + hashlib.sha256(k.encode()).hexdigest() for k in _WELL_KNOWN_KEYS
)


# what an admin or a config names (an exception's id, a key's environment): it reaches
# metric labels, the ledger and URLs, so it is short and plain
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,63}$"
# a key's label (for `ncap keys list` / `revoke`): the same, spaces allowed inside
LABEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+ -]{0,63}$"


class KeyEntry(_Model):
    hash: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    workload: str
    environment: str = Field("production", pattern=ID_PATTERN)
    label: str | None = Field(None, pattern=LABEL_PATTERN)  # `ncap keys list` / `revoke`
    created: datetime | None = None

    @field_validator("hash")
    @classmethod
    def _not_well_known(cls, v: str) -> str:
        if v in WEAK_KEY_HASHES:
            raise ValueError(
                "this is the SHA-256 of a well-known string (such as 'test' or 'password'): "
                "anyone could send it as a key; create one with `ncap keys create`"
            )
        return v


class Workload(_Model):
    max_candidates: int = Field(1, ge=1, le=128)
    output_ceiling: int = Field(1024, ge=1)
    greedy_candidates: Literal["reject", "allow"] = "reject"
    max_concurrency: int | None = Field(32, ge=1)
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    tokens_per_day: int | None = Field(None, ge=1)
    usd_per_day: float | None = Field(None, ge=0)
    usd_per_month: float | None = Field(None, ge=0)
    models: list[str] = ["*"]

    def allows_model(self, alias: str) -> bool:
        return "*" in self.models or alias in self.models


class ExceptionGrant(_Model):
    id: str = Field(pattern=ID_PATTERN)
    workload: str
    owner: str = Field(min_length=1, max_length=256)
    max_candidates: int = Field(ge=1, le=128)
    output_ceiling: int | None = Field(None, ge=1)
    budget_usd: float | None = Field(None, ge=0)
    expires: datetime
    reason: str = Field("", max_length=2000)

    @field_validator("expires")
    @classmethod
    def _aware(cls, v: datetime) -> datetime:
        return v if v.tzinfo else v.replace(tzinfo=UTC)


class Pricing(_Model):
    input_per_mtok: float = Field(0.0, ge=0)
    cached_input_per_mtok: float | None = Field(None, ge=0)
    # prompt tokens written to the provider's cache (Anthropic: 125 % of input); unset:
    # the input price
    cache_write_input_per_mtok: float | None = Field(None, ge=0)
    output_per_mtok: float = Field(0.0, ge=0)


class Fingerprint(_Model):
    provider: str | None = None
    upstream_model: str | None = None
    gateway_version: str | None = None


class Contract(_Model):
    candidates: Literal["native", "emulate", "unsupported"] | None = None
    max_candidates: int = Field(1, ge=1, le=128)
    output_cap: Literal["per_candidate", "shared"] = "per_candidate"
    stream_usage: Literal["include_usage", "none"] = "none"
    verified_at: datetime | None = None
    max_age: str | None = None
    fingerprint: Fingerprint | None = None
    # what a well-formed upstream error answer (a JSON error envelope, e.g. a 500) says
    # about billing: ``unbilled`` (nothing was generated: settle at zero) or ``unknown``
    # (hold the reservation until reconciled); see docs/configuration.md
    error_responses: Literal["unbilled", "unknown"] = "unbilled"
    # the provider caches a repeated prompt prefix and bills the cached part at its
    # cached rate (``ncap probe`` records it when a repeat reports cached tokens)
    prompt_cache: bool = False

    @field_validator("max_age", mode="before")
    @classmethod
    def _max_age(cls, v: object) -> object:
        """A duration with its unit; a bare number is refused: ``30`` could mean days."""
        if isinstance(v, int | float) and not isinstance(v, bool):
            raise ValueError(_bare_number(v))
        if isinstance(v, str):
            parse_duration(v)
        return v

    @field_validator("verified_at")
    @classmethod
    def _aware(cls, v: datetime | None) -> datetime | None:
        return v.replace(tzinfo=UTC) if v is not None and v.tzinfo is None else v

    @property
    def max_age_delta(self) -> timedelta | None:
        return parse_duration(self.max_age) if self.max_age else None


class _RouteBase(_Model):
    """What every route has, whatever serves it."""

    upstream_model: str | None = None
    timeout_s: float = Field(30.0, gt=0)
    retries: int = Field(2, ge=0, le=10)
    backoff_s: float = Field(0.5, ge=0)
    extra_fields: list[str] = []
    pricing: Pricing = Pricing()
    contract: Contract = Contract()
    # a fan-out on a route whose contract says its provider caches prompts sends branch
    # 0 first and the others once its first byte arrived (they read its cached prompt);
    # false: all branches at once
    fanout_cache_priming: bool = True


class _HttpRoute(_RouteBase):
    """A route served over HTTP: where, with which credential and connection pool."""

    base_url: str | None = None
    api_key_env: str | None = None
    connect_timeout_s: float = Field(5.0, gt=0)
    max_connections: int = Field(1024, ge=1)
    # static headers sent upstream on every attempt (e.g. an organisation id); never
    # the client's own headers, which are not forwarded
    headers: dict[str, str] = {}
    # the most bytes read of one answer (decompressed; a stream's bytes in all); past it
    # the attempt fails with a 502. None: ``limits.max_upstream_answer_bytes``, else
    # 1 MiB + 4 KiB per token the request allows (n x its output ceiling)
    max_answer_bytes: int | None = Field(None, ge=1024)

    @model_validator(mode="after")
    def _required(self) -> _HttpRoute:
        provider = getattr(self, "provider", "")
        if provider in _NEEDS_BASE_URL and not self.base_url:
            raise ValueError(f"base_url is required for provider {provider}")
        # the upstream model is part of every URL (gemini), the deployment (azure), or
        # required by the API (anthropic)
        if provider in _NEEDS_MODEL and not self.upstream_model:
            raise ValueError(f"upstream_model is required for provider {provider}")
        return self


_NEEDS_BASE_URL = ("openai", "azure")
_NEEDS_MODEL = ("gemini", "anthropic", "azure")


class OpenAIRoute(_HttpRoute):
    """Any OpenAI-compatible Chat Completions API."""

    provider: Literal["openai"]


class AzureRoute(_HttpRoute):
    """Azure OpenAI: set, the deployment URL form with this api-version; unset, the
    /openai/v1 form (``upstream_model`` is the deployment's name)."""

    provider: Literal["azure"]
    api_version: str | None = None


class AnthropicRoute(_HttpRoute):
    """Anthropic's Messages API (``anthropic_version``: the header every request sends)."""

    provider: Literal["anthropic"]
    anthropic_version: str = "2023-06-01"


class GeminiRoute(_HttpRoute):
    """Google's Gemini API (``base_url`` defaults to Google's, providers/gemini.py)."""

    provider: Literal["gemini"]


class LocalRoute(_RouteBase):
    """The in-process llama.cpp engine."""

    provider: Literal["local"]
    model_path: str | None = None
    n_ctx: int = Field(8192, ge=256)
    max_sequences: int = Field(32, ge=1, le=256)
    max_queue: int = Field(64, ge=1)
    threads: int | None = Field(None, ge=1)
    # KV cells of recent prompts kept for reuse by later requests (0: no prefix cache)
    prefix_cache_tokens: int = Field(4096, ge=0)
    # weights loaded: auto (Q8_0 conversion of the bundled model, model_path as it is),
    # original, or a one-off conversion to q8_0 / q4_0 (ncap.engine.weights)
    weights: Literal["auto", "original", "q8_0", "q4_0"] = "auto"


HttpRoute = OpenAIRoute | AzureRoute | AnthropicRoute | GeminiRoute
Route = Annotated[HttpRoute | LocalRoute, Field(discriminator="provider")]
"""A route, by the kind of provider that serves it: a local route has no ``base_url``
and an HTTP route no ``n_ctx`` (either is an unknown field there)."""
_ROUTE = TypeAdapter(Route)


def _reads_answers(route: Any) -> bool:
    """A route (as written) of a kind that reads answers over HTTP, without its own
    ``max_answer_bytes`` (the local engine's answers are its own)."""
    if not isinstance(route, Mapping) or route.get("max_answer_bytes") is not None:
        return False
    kind = ROUTE_KINDS.get(str(route.get("provider")))
    return kind is not None and "max_answer_bytes" in kind.model_fields


def parse_route(data: Any) -> OpenAIRoute | AzureRoute | AnthropicRoute | GeminiRoute | LocalRoute:
    """One route from its mapping, by its ``provider`` (pydantic's errors as they are)."""
    return _ROUTE.validate_python(data)


ROUTE_KINDS: dict[str, type[_RouteBase]] = {
    "openai": OpenAIRoute,
    "azure": AzureRoute,
    "anthropic": AnthropicRoute,
    "gemini": GeminiRoute,
    "local": LocalRoute,
}


class Thresholds(_Model):
    """What the audit and the daily report flag (``reports.thresholds``); None: no check."""

    output_tokens_per_request_p95: int | None = Field(None, ge=0)
    output_tokens_per_request_mean: float | None = Field(None, ge=0)
    denial_rate: float | None = Field(0.05, ge=0, le=1)
    mismatch_rate: float | None = Field(0.0, ge=0, le=1)
    pending_count: int | None = Field(None, ge=0)
    pending_age: str | None = "24h"
    exception_budget_warn: float = Field(0.8, gt=0, le=1)
    distribution_shift_psi: float = Field(0.2, gt=0)
    shift_min_requests: int = Field(100, ge=1)
    # "candidates mostly duplicate": a workload's (or exception's) mean distinct share of
    # its returned candidates below this, over at least candidates_min_requests requests
    candidates_distinct_share: float | None = Field(0.5, gt=0, le=1)
    candidates_min_requests: int = Field(20, ge=1)

    @field_validator("pending_age", mode="before")
    @classmethod
    def _age(cls, v: Any) -> Any:
        if v is None:
            return v
        if isinstance(v, int | float) and not isinstance(v, bool):
            raise ValueError(_bare_number(v))  # 24 could mean hours as well as seconds
        if isinstance(v, str):
            parse_duration(v)
        return v

    @property
    def pending_age_delta(self) -> timedelta | None:
        return parse_duration(self.pending_age) if self.pending_age else None


class Reports(_Model):
    thresholds: Thresholds = Thresholds()


class Otlp(_Model):
    """OTLP/HTTP (protobuf) export of the GenAI spans and metrics (``observability.otlp``).

    Every field left unset falls back to the standard ``OTEL_*`` variable the
    OpenTelemetry SDK reads (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``…_HEADERS``,
    ``OTEL_TRACES_SAMPLER``/``…_ARG``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
    ``OTEL_METRIC_EXPORT_INTERVAL``), then to the SDK's default."""

    # the collector's base URL (``/v1/traces`` and ``/v1/metrics`` are appended)
    endpoint: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    # the share of root traces kept (parent-based: a sampled client trace is kept)
    sampling: float | None = Field(None, ge=0, le=1)
    timeout_s: float | None = Field(None, gt=0)
    metrics_interval_s: float | None = Field(None, gt=0)
    service_name: str | None = None

    @field_validator("endpoint")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("an OTLP/HTTP endpoint is an http:// or https:// URL")
        return v


class Observability(_Model):
    """Operators' signals (``observability:``): the JSON access log on ``ncap.access``
    (one line per request, no content), OpenTelemetry spans and GenAI metrics (needs
    the ``otel`` extra): exported over OTLP when ``otlp`` is set, else given to the
    process's tracer and meter providers when ``traces`` is on."""

    access_log: bool = True
    traces: bool = False
    otlp: Otlp | None = None

    @property
    def telemetry(self) -> bool:
        """Whether spans and GenAI metrics are made at all (off: not even built)."""
        return self.traces or self.otlp is not None


AlertScope = Literal["day", "month", "exception"]
ALERT_SCOPES: tuple[AlertScope, ...] = ("day", "month", "exception")


class BudgetAlerts(_Model):
    """Budget-threshold alerts (``alerts:``): each percentage of each budget (a
    workload's day or month USD budget, an exception's lifetime budget) is posted once
    per window period to ``webhook_url`` and shown in the report."""

    webhook_url: str | None = None
    thresholds: list[int] = Field(default_factory=lambda: [50, 80, 100])
    scopes: list[AlertScope] = Field(default_factory=lambda: list(ALERT_SCOPES))
    timeout_s: float = Field(5.0, gt=0)
    retries: int = Field(3, ge=0, le=10)
    backoff_s: float = Field(1.0, ge=0)
    # also post "candidates mostly duplicate" as it happens, on the report's thresholds
    # (``reports.thresholds.candidates_*``), once per workload or exception and UTC day
    candidates: bool = True

    @field_validator("thresholds")
    @classmethod
    def _percentages(cls, v: list[int]) -> list[int]:
        if any(p < 1 or p > 1000 for p in v):
            raise ValueError("thresholds are percentages of a budget, 1 to 1000")
        return sorted(set(v))

    @field_validator("webhook_url")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("webhook_url must be an http:// or https:// URL")
        return v


class Config(_Model):
    server: Server = Server()
    stores: Stores = Stores()
    limits: Limits = Limits()
    keys: list[KeyEntry] = []
    workloads: dict[str, Workload] = {"default": Workload()}
    exceptions: list[ExceptionGrant] = []
    models: dict[str, list[str]] = {}
    routes: dict[str, Route] = {}
    reports: Reports = Reports()
    observability: Observability = Observability()

    @property
    def reserved_timeout_s(self) -> float:
        """How long an attempt's row may stay ``reserved``: its longest time limit (a
        route's timeout, a stream's wall clock) and a heartbeat timeout to spare. A
        row older than that was never closed by its gateway, whatever the cause (a
        write that committed after its caller gave up, a settlement lost); recovery
        turns it into ``usage_reconciliation_required``/``reserved_timeout``."""
        longest = max([r.timeout_s for r in self.routes.values()] + [self.limits.max_stream_s])
        return longest + self.server.heartbeat_timeout_s

    alerts: BudgetAlerts = BudgetAlerts()

    @model_validator(mode="before")
    @classmethod
    def _answer_bound(cls, data: Any) -> Any:
        """``limits.max_upstream_answer_bytes`` is every route's ``max_answer_bytes``
        unless the route sets its own (a provider only sees its route)."""
        if not isinstance(data, Mapping):
            return data
        limits, routes = data.get("limits"), data.get("routes")
        bound = limits.get("max_upstream_answer_bytes") if isinstance(limits, Mapping) else None
        if bound is None or not isinstance(routes, Mapping):
            return data
        filled = {
            rid: {**r, "max_answer_bytes": bound} if _reads_answers(r) else r
            for rid, r in routes.items()
        }
        return {**data, "routes": filled}

    @model_validator(mode="after")
    def _references(self) -> Config:
        """Cross-section references; ``parse_config`` reports the same with lines."""
        problems = reference_problems(self.model_dump(mode="json"))
        if problems:
            raise ValueError("; ".join(f"{_dotted(loc)}: {msg}" for loc, msg in problems))
        return self


Loc = tuple[str, ...]


def reference_problems(raw: Mapping[str, Any]) -> list[tuple[Loc, str]]:
    """Every reference across sections that points nowhere, with the place it is written.

    Runs on the raw mapping as well as on a validated ``Config``, so a file gets these
    in the same run as its field errors; malformed sections are skipped (the field
    checks report them).
    """
    workloads = _mapping(raw.get("workloads", {"default": {}}))
    models = _mapping(raw.get("models"))
    routes = _mapping(raw.get("routes"))
    keys = _entries(raw.get("keys"))
    exceptions = _entries(raw.get("exceptions"))
    out: list[tuple[Loc, str]] = []
    if not keys and "default" not in workloads:
        out.append(
            (
                ("workloads",),
                "without keys every request is workload 'default', "
                "which is missing: add a `default` workload or create a key",
            )
        )
    for name, w in workloads.items():
        for i, alias in enumerate(_entries(_mapping(w).get("models", ["*"]))):
            if alias != "*" and alias not in models:
                out.append(
                    (
                        (("workloads", str(name), "models", str(i))),
                        f"unknown model alias {alias!r}{_hint(alias, models)}",
                    )
                )
    for alias, chain in models.items():
        if isinstance(chain, list) and not chain:
            out.append((("models", str(alias)), "a route chain needs at least one route"))
        for i, rid in enumerate(_entries(chain)):
            if rid not in routes:
                out.append(
                    (("models", str(alias), str(i)), f"unknown route {rid!r}{_hint(rid, routes)}")
                )
    for section, entries in (("exceptions", exceptions), ("keys", keys)):
        for i, entry in enumerate(entries):
            wid = _mapping(entry).get("workload")
            if isinstance(wid, str) and wid not in workloads:
                out.append(
                    (
                        (section, str(i), "workload"),
                        f"unknown workload {wid!r}{_hint(wid, workloads)}",
                    )
                )
    seen: set[str] = set()
    for i, entry in enumerate(exceptions):
        eid = _mapping(entry).get("id")
        if isinstance(eid, str) and eid in seen:
            out.append((("exceptions", str(i), "id"), f"duplicate id {eid!r}"))
        seen.add(str(eid))
    return out


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _entries(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _hint(word: str, known: Iterable[Any]) -> str:
    """`` (did you mean 'x'?)`` for a near miss, else the known names when there are few."""
    names = [str(k) for k in known]
    close = difflib.get_close_matches(str(word), names, n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]!r}?)"
    if names and len(names) <= 8:
        return f" (known: {', '.join(sorted(names))})"
    return ""


def _dotted(loc: Iterable[Any]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def default_config() -> Config:
    """The embedded default: the local engine serving SmolLM2 as ``smollm2``."""
    return Config(
        workloads={"default": Workload(max_candidates=4)},
        models={"smollm2": ["local-smollm2"]},
        routes={
            "local-smollm2": LocalRoute(
                # no timeout_s: each attempt gets a budget from its size and the engine's
                # measured speed, charged from admission (providers/local.py)
                provider="local",
                contract=Contract(
                    candidates="native",
                    max_candidates=32,
                    output_cap="per_candidate",
                    stream_usage="include_usage",
                ),
            )
        },
    )


def load_config(path: str | Path | None) -> Config:
    """Load ``path``; None means ``./ncap.yaml`` when present, else the default."""
    if path is None:
        if not Path("ncap.yaml").exists():
            return default_config()
        path = "ncap.yaml"
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from exc
    return parse_config(text, source=str(p))


# the embedded default's demo: taken as one unit, see ``parse_config``
_DEMO_SECTIONS = ("workloads", "models", "routes")


def parse_config(text: str, source: str = "<config>") -> Config:
    """Validate ``text``; every problem is reported with its dotted path and line.

    What an existing file means (one rule, docs/configuration.md): a file that writes
    none of ``workloads``, ``models``, ``routes`` keeps the embedded demo's three
    sections (so an empty or a keys-only file still serves ``smollm2`` with n up to 4);
    a file that writes any of them defines all three itself. Every other section the
    file leaves out takes its field defaults, which are the embedded default's.
    """
    try:
        raw = yaml.safe_load(text)
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    if not any(section in raw for section in _DEMO_SECTIONS):
        raw = {**raw, **_demo_sections()}
    references = reference_problems(raw)
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        problems = [*_describe(exc.errors(), root, source), *_located(references, root, source)]
        if not problems:  # cannot happen: the reference check is the only one at the top
            problems = [f"{source}: {e['msg']}" for e in exc.errors()]
        raise ConfigError(f"{source}: {len(problems)} problem(s)", problems) from None
    return config


def _demo_sections() -> dict[str, Any]:
    demo = default_config().model_dump(mode="json", exclude_defaults=True)
    return {section: demo.get(section, {}) for section in _DEMO_SECTIONS}


def _located(problems: Iterable[tuple[Loc, str]], root: yaml.Node | None, source: str) -> list[str]:
    out = []
    for loc, msg in problems:
        line = _line_of(root, list(loc))
        at = f" (line {line})" if line else ""
        out.append(f"{source}: {_dotted(loc)}{at}: {msg}")
    return out


def _describe(errors: Iterable[Any], root: yaml.Node | None, source: str) -> Iterable[str]:
    for err in errors:
        if not err["loc"]:
            continue  # Config._references: reported by ``_located`` with real places
        loc = _untagged([str(part) for part in err["loc"]])
        line = _line_of(root, loc)
        at = f" (line {line})" if line else ""
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field {loc[-1]!r}{_field_hint(err['loc'])}"
        elif err["type"] == "union_tag_invalid":
            given = str(err.get("ctx", {}).get("tag", ""))
            msg = f"unknown provider {given!r}{_hint(given, ROUTE_KINDS)}"
        elif err["type"] == "union_tag_not_found":
            msg = f"provider is required (one of: {', '.join(ROUTE_KINDS)})"
        yield f"{source}: {_dotted(loc)}{at}: {msg}"


def _untagged(loc: list[str]) -> list[str]:
    """The place as written: pydantic puts a route's kind (its ``provider`` tag) after
    the route's id (``routes.r.openai.base_url``); the file has no such level."""
    if len(loc) > 2 and loc[0] == "routes" and loc[2] in ROUTE_KINDS:
        return [*loc[:2], *loc[3:]]
    return loc


def _field_hint(loc: tuple[Any, ...]) -> str:
    """Did-you-mean for a misspelt key, from the field names of the model it sits in."""
    model = _model_at(loc[:-1])
    if model is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model a location inside the config points into."""
    annotation: Any = Config
    for part in loc:
        annotation = _unwrap(annotation)
        if get_origin(annotation) is Annotated and str(part) in ROUTE_KINDS:
            annotation = ROUTE_KINDS[str(part)]  # the route's kind, from its tag
            continue
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(part))
            if field is None:
                return None
            annotation = field.annotation
        elif get_origin(annotation) in (dict, list):
            annotation = get_args(annotation)[-1]
        else:
            return None
    annotation = _unwrap(annotation)
    is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return annotation if is_model else None


def _unwrap(annotation: Any) -> Any:
    """``X | None`` -> ``X``."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def warnings_for(config: Config, text: str, source: str, now: datetime) -> list[str]:
    """What is valid but will refuse requests today: stale contracts, expired exceptions."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        root = None
    found: list[tuple[Loc, str]] = []
    if not config.server.is_loopback and config.server.operations_key_env is None:
        found.append(
            (
                ("server", "host"),
                f"bound to {config.server.host} without server.operations_key_env: /metrics, "
                "/readyz and /openapi.json (spend and limits per workload, route and "
                "exception ids) answer anyone who can reach it",
            )
        )
    for rid, route in config.routes.items():
        found += _contract_warnings(rid, route.contract, now)
    for i, grant in enumerate(config.exceptions):
        if grant.expires <= now:
            found.append(
                (
                    (("exceptions", str(i), "expires")),
                    f"exception {grant.id!r} expired on {grant.expires:%Y-%m-%d}: it is ignored",
                )
            )
    return _located(found, root, source)


def _contract_warnings(rid: str, contract: Contract, now: datetime) -> list[tuple[Loc, str]]:
    age = contract.max_age_delta
    if age is None or contract.candidates in (None, "unsupported"):
        return []
    loc: Loc = ("routes", rid, "contract", "verified_at")
    refused = "n > 1 on this route is refused (route_contract_stale) until it is re-verified"
    if contract.verified_at is None:
        return [
            (
                ("routes", rid, "contract", "max_age"),
                f"max_age is set but verified_at is not: {refused}",
            )
        ]
    stale_at = contract.verified_at + age
    if stale_at <= now:
        return [
            (
                loc,
                f"the contract went stale on {stale_at:%Y-%m-%d %H:%M} UTC "
                f"(verified {contract.verified_at:%Y-%m-%d}, max_age {contract.max_age}): "
                f"{refused}",
            )
        ]
    return []


def resolved(config: Config) -> dict[str, Any]:
    """The config with every default filled in (each route has only the fields of its
    provider's kind; ``check-config`` prints this)."""
    return config.model_dump(mode="json")


def _line_of(node: yaml.Node | None, loc: list[str]) -> int | None:
    """The 1-based line of the deepest YAML node the pydantic location reaches."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            pair = next(((k, v) for k, v in node.value if str(k.value) == part), None)
            if pair is None:
                break
            # the key's line: a section's value starts on the line after ``name:``
            line, node = pair[0].start_mark.line + 1, pair[1]
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            line = node.start_mark.line + 1
        else:
            break
    return line


def utcnow() -> datetime:
    return datetime.now(UTC)
