"""Upstream adapters behind one ``Provider`` protocol (``ncap.providers.base``).

``provider_for`` is the one place a route's kind picks its adapter; what each kind can
do, and the translator of its schema pair, are declared beside, in the registry
``ncap.providers.kinds``. The adapters are imported there, lazily, so importing the
protocol costs no HTTP client and no llama.cpp.
"""

from __future__ import annotations

from ncap.config import (
    AnthropicRoute,
    AzureRoute,
    GeminiRoute,
    LocalRoute,
    OpenAIRoute,
    Route,
)
from ncap.providers.base import Provider
from ncap.providers.kinds import Capabilities, capabilities_of

__all__ = ["Capabilities", "capabilities_of", "provider_for"]


def provider_for(route: Route, *, route_id: str) -> Provider:
    """The adapter that serves ``route`` (one instance per route, owning its pool)."""
    match route:
        case OpenAIRoute():
            from ncap.providers.openai import OpenAIProvider

            return OpenAIProvider(route, route_id=route_id)
        case AzureRoute():
            from ncap.providers.azure import azure_provider

            return azure_provider(route, route_id=route_id)
        case AnthropicRoute():
            from ncap.providers.anthropic import AnthropicProvider

            return AnthropicProvider(route, route_id=route_id)
        case GeminiRoute():
            from ncap.providers.gemini import GeminiProvider

            return GeminiProvider(route, route_id=route_id)
        case LocalRoute():
            from ncap.providers.local import LocalProvider

            return LocalProvider(route)
