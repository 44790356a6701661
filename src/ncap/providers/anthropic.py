"""Provider ``anthropic``: the Anthropic Messages API (``POST {base_url}/messages``),
served by the translated-pair adapter (``providers.translated``) with the Anthropic
translator (``providers.openai_anthropic``) the registry picks. Messages has no ``n``:
a route serves n > 1 only by fan-out (``candidates: emulate``), each branch one request.

The route's credential goes in ``x-api-key`` with the route's ``anthropic-version``;
the client's own ``Authorization`` is never sent. The upstream names its request in
the ``request-id`` header.
"""

from __future__ import annotations

from ncap.config import AnthropicRoute
from ncap.providers.credentials import route_headers
from ncap.providers.translated import Endpoint, TranslatedProvider

__all__ = ["DEFAULT_BASE_URL", "AnthropicProvider", "anthropic_endpoint"]

DEFAULT_BASE_URL = "https://api.anthropic.com/v1"


def anthropic_endpoint(route: AnthropicRoute, route_id: str) -> Endpoint:
    headers = route_headers(route, route_id, header="x-api-key", scheme="")
    headers["anthropic-version"] = route.anthropic_version
    url = (route.base_url or DEFAULT_BASE_URL).rstrip("/") + "/messages"
    return Endpoint(url, headers, request_id_header="request-id")


class AnthropicProvider(TranslatedProvider):
    """One route's Anthropic model."""

    def __init__(self, route: AnthropicRoute, *, route_id: str) -> None:
        super().__init__(route, route_id=route_id, endpoint=anthropic_endpoint(route, route_id))
