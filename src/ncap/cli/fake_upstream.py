"""``ncap fake-upstream``: run the fault-injecting fake provider as its own process."""

from __future__ import annotations

from ncap.errors import ConfigError
from ncap.testing._fake_faults import parse_faults
from ncap.testing.fake_upstream import serve

__all__ = ["run_fake_upstream"]


def run_fake_upstream(host: str, port: int, profile: str | None, latency_ms: float) -> None:
    """Serve until interrupted (uvloop when installed); prints the base URL once bound.

    ``profile`` is ``name[=value],...`` (e.g. ``rate_limit=2,latency=50``); an unknown
    name is a ``ConfigError`` raised before anything binds."""
    try:
        parse_faults(profile)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if latency_ms < 0:
        raise ConfigError("--latency-ms must be >= 0")
    serve(host, port, profile, latency_ms)
