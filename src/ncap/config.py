"""The YAML configuration (SPEC Appendix A), validated on load.

Every field has a default, so an empty file (or none) is the embedded default. The
loader collects *every* problem with its location (``routes.primary-chat.contract.
max_age (line 42)``) instead of stopping at the first one, which is why this module
uses pydantic rather than msgspec: config loading is off the hot path and operators
fix files faster from a full list.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ncap.errors import ConfigError

__all__ = [
    "Config",
    "Contract",
    "ExceptionGrant",
    "KeyEntry",
    "Pricing",
    "Route",
    "Workload",
    "default_config",
    "load_config",
    "parse_duration",
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

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


class Stores(_Model):
    ledger: str = "sqlite:///.ncap/ledger.db"
    budgets: str = "sqlite:///.ncap/budgets.db"

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


class KeyEntry(_Model):
    hash: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    workload: str
    environment: str = "production"


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
    id: str
    workload: str
    owner: str
    max_candidates: int = Field(ge=1, le=128)
    output_ceiling: int | None = Field(None, ge=1)
    budget_usd: float | None = Field(None, ge=0)
    expires: datetime
    reason: str = ""

    @field_validator("expires")
    @classmethod
    def _aware(cls, v: datetime) -> datetime:
        return v if v.tzinfo else v.replace(tzinfo=UTC)


class Pricing(_Model):
    input_per_mtok: float = Field(0.0, ge=0)
    cached_input_per_mtok: float | None = Field(None, ge=0)
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

    @field_validator("max_age", mode="before")
    @classmethod
    def _max_age(cls, v: object) -> object:
        """A duration string, or a plain number of seconds."""
        if isinstance(v, int | float) and not isinstance(v, bool):
            v = f"{v}s"
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


class Route(_Model):
    provider: Literal["openai", "gemini", "local"]
    base_url: str | None = None
    upstream_model: str | None = None
    api_key_env: str | None = None
    timeout_s: float = Field(30.0, gt=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    retries: int = Field(2, ge=0, le=10)
    backoff_s: float = Field(0.5, ge=0)
    max_connections: int = Field(1024, ge=1)
    extra_fields: list[str] = []
    # static headers sent upstream on every attempt (e.g. an organisation id); never
    # the client's own headers, which are not forwarded
    headers: dict[str, str] = {}
    pricing: Pricing = Pricing()
    contract: Contract = Contract()
    # provider: local
    model_path: str | None = None
    n_ctx: int = Field(8192, ge=256)
    max_sequences: int = Field(32, ge=1, le=256)
    max_queue: int = Field(64, ge=1)
    threads: int | None = Field(None, ge=1)
    # KV cells of recent prompts kept for reuse by later requests (0: no prefix cache)
    prefix_cache_tokens: int = Field(4096, ge=0)

    @model_validator(mode="after")
    def _provider_fields(self) -> Route:
        if self.provider == "gemini":
            raise ValueError("provider gemini is not available in this build yet")
        if self.provider == "openai" and not self.base_url:
            raise ValueError(f"base_url is required for provider {self.provider}")
        return self


class Config(_Model):
    server: Server = Server()
    stores: Stores = Stores()
    limits: Limits = Limits()
    keys: list[KeyEntry] = []
    workloads: dict[str, Workload] = {"default": Workload()}
    exceptions: list[ExceptionGrant] = []
    models: dict[str, list[str]] = {}
    routes: dict[str, Route] = {}

    @model_validator(mode="after")
    def _references(self) -> Config:
        problems: list[str] = []
        if not self.keys and "default" not in self.workloads:
            problems.append(
                "workloads: without keys every request is workload 'default', which is missing"
            )
        problems += [
            f"workloads.{name}.models: unknown model alias {alias!r}"
            for name, w in self.workloads.items()
            for alias in w.models
            if alias != "*" and alias not in self.models
        ]
        for alias, chain in self.models.items():
            if not chain:
                problems.append(f"models.{alias}: a route chain needs at least one route")
            problems += [
                f"models.{alias}: unknown route {rid!r}" for rid in chain if rid not in self.routes
            ]
        problems += [
            f"exceptions.{e.id}: unknown workload {e.workload!r}"
            for e in self.exceptions
            if e.workload not in self.workloads
        ]
        problems += [
            f"keys: unknown workload {k.workload!r}"
            for k in self.keys
            if k.workload not in self.workloads
        ]
        ids = [e.id for e in self.exceptions]
        problems += [
            f"exceptions: duplicate id {i!r}" for i in {i for i in ids if ids.count(i) > 1}
        ]
        if problems:
            raise ValueError("; ".join(problems))
        return self


def default_config() -> Config:
    """The embedded default: the local engine serving SmolLM2 as ``smollm2``."""
    return Config(
        workloads={"default": Workload(max_candidates=4)},
        models={"smollm2": ["local-smollm2"]},
        routes={
            "local-smollm2": Route(
                provider="local",
                timeout_s=300,  # a long local generation on a laptop is not a failure
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


def parse_config(text: str, source: str = "<config>") -> Config:
    try:
        raw = yaml.safe_load(text)
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if raw is None:
        return default_config()  # an empty file is the embedded default
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    if "models" not in raw and "routes" not in raw:
        embedded = default_config()
        raw = {
            **raw,
            "models": embedded.models,
            "routes": {k: r.model_dump(mode="json") for k, r in embedded.routes.items()},
        }
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        problems = list(_describe(exc.errors(), root, source))
        raise ConfigError(f"{source}: {len(problems)} problem(s)", problems) from None


def _describe(errors: Iterable[Any], root: yaml.Node | None, source: str) -> Iterable[str]:
    for err in errors:
        loc = [str(part) for part in err["loc"]]
        line = _line_of(root, loc)
        where = ".".join(loc) or "(top level)"
        at = f" (line {line})" if line else ""
        msg = err["msg"].removeprefix("Value error, ")
        yield f"{source}: {where}{at}: {msg}"


def _line_of(node: yaml.Node | None, loc: list[str]) -> int | None:
    """The 1-based line of the deepest YAML node the pydantic location reaches."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if str(k.value) == part), None)
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
        else:
            break
        if node is None:
            break
        line = node.start_mark.line + 1
    return line


def utcnow() -> datetime:
    return datetime.now(UTC)
