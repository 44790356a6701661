"""The headers every HTTP provider sends: the route's static headers, JSON, and the
route's credential (read from the environment variable the route names) under the
header its upstream expects. The client's own headers are never among them."""

from __future__ import annotations

import logging
import os

from ncap.config import HttpRoute

__all__ = ["route_headers"]

log = logging.getLogger("ncap.providers")


def route_headers(
    route: HttpRoute, route_id: str, *, header: str = "Authorization", scheme: str = "Bearer "
) -> dict[str, str]:
    """``header: scheme + key`` when the route's key variable is set; a warning (once,
    when the provider is built) when it names a variable that is not set."""
    headers = {**route.headers, "Content-Type": "application/json"}
    key = os.environ.get(route.api_key_env) if route.api_key_env else None
    if key:
        headers[header] = f"{scheme}{key}"
    elif route.api_key_env:
        log.warning(
            "route %s: %s is not set; requests go upstream without a credential",
            route_id,
            route.api_key_env,
        )
    return headers
