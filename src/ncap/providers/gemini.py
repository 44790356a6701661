"""Provider ``gemini``: the Gemini API (``generateContent`` / ``streamGenerateContent``),
served by the translated-pair adapter (``providers.translated``) with the Gemini
translator (``providers.openai_gemini``) the registry picks.

The key goes in ``x-goog-api-key``, never in the URL (``?key=`` would land in access
logs). Whole answers and streams are two methods of the model's URL.
"""

from __future__ import annotations

from ncap.config import GeminiRoute
from ncap.providers.credentials import route_headers
from ncap.providers.translated import Endpoint, TranslatedProvider

__all__ = ["DEFAULT_BASE_URL", "GeminiProvider", "gemini_endpoint"]

DEFAULT_BASE_URL = "https://generativelanguage.googleapis.com/v1beta"


def gemini_endpoint(route: GeminiRoute, route_id: str) -> Endpoint:
    base = (route.base_url or DEFAULT_BASE_URL).rstrip("/") + f"/models/{route.upstream_model}"
    return Endpoint(
        base + ":generateContent",
        route_headers(route, route_id, header="x-goog-api-key", scheme=""),
        stream_url=base + ":streamGenerateContent?alt=sse",
    )


class GeminiProvider(TranslatedProvider):
    """One route's Gemini model."""

    def __init__(self, route: GeminiRoute, *, route_id: str) -> None:
        super().__init__(route, route_id=route_id, endpoint=gemini_endpoint(route, route_id))
