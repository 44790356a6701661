"""Provider ``azure``: Azure OpenAI, which speaks OpenAI's wire shapes (``n`` native)
at its own URLs, with its own credential header and error envelope.

Two URL forms, picked by the route:

- with ``api_version``: the deployment form,
  ``{base_url}/openai/deployments/{upstream_model}/chat/completions?api-version=V``
  (``upstream_model`` is the deployment's name);
- without it: the v1 form, ``{base_url}/openai/v1/chat/completions``, the deployment
  named by ``model`` in the body.

The route's key goes in ``api-key`` (the client's ``Authorization`` is never sent).
Azure's error bodies carry no ``type`` and their own codes: its translator
(``providers.openai_passthrough.AzureTranslator``, picked by the registry) reads them
leniently and states the facts. A completion the filter stopped already says
``finish_reason: content_filter``, relayed as it is.
"""

from __future__ import annotations

from urllib.parse import quote

from ncap.config import AzureRoute
from ncap.providers.base import RequestKind
from ncap.providers.credentials import route_headers
from ncap.providers.openai import OpenAIProvider

__all__ = ["azure_provider", "azure_urls"]

_PATHS: dict[RequestKind, str] = {"chat": "chat/completions", "completions": "completions"}


def azure_urls(route: AzureRoute) -> dict[RequestKind, str]:
    """The endpoint URLs of the route's form (see the module docstring)."""
    assert route.base_url is not None and route.upstream_model is not None
    base = route.base_url.rstrip("/")
    if route.api_version is None:
        root = base if base.endswith("/openai/v1") else f"{base}/openai/v1"
        return {kind: f"{root}/{path}" for kind, path in _PATHS.items()}
    root = base.removesuffix("/openai") + f"/openai/deployments/{quote(route.upstream_model)}"
    version = quote(route.api_version)
    return {kind: f"{root}/{path}?api-version={version}" for kind, path in _PATHS.items()}


def azure_provider(route: AzureRoute, *, route_id: str) -> OpenAIProvider:
    headers = route_headers(route, route_id, header="api-key", scheme="")
    return OpenAIProvider(route, route_id=route_id, urls=azure_urls(route), headers=headers)
