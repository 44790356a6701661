"""Provider ``azure``: Azure OpenAI, which speaks OpenAI's wire shapes (``n`` native)
at its own URLs, with its own credential header and error envelope.

Two URL forms, picked by the route:

- with ``api_version``: the deployment form,
  ``{base_url}/openai/deployments/{upstream_model}/chat/completions?api-version=V``
  (``upstream_model`` is the deployment's name);
- without it: the v1 form, ``{base_url}/openai/v1/chat/completions``, the deployment
  named by ``model`` in the body.

The route's key goes in ``api-key`` (the client's ``Authorization`` is never sent).
Azure's error bodies carry no ``type`` and their own codes: ``azure_failure`` reads
them leniently and states the facts (a prompt refused by the content filter keeps
``content_filter``; a 429 is a rate limit, its delay from ``retry-after-ms``). A
completion the filter stopped already says ``finish_reason: content_filter``, relayed
as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import quote

import msgspec

from ncap.config import AzureRoute
from ncap.providers.base import AttemptFailed, RequestKind, UpstreamErrorDetail
from ncap.providers.credentials import route_headers
from ncap.providers.openai import OpenAIProvider
from ncap.providers.transport import parse_retry_after

__all__ = ["azure_failure", "azure_provider", "azure_urls"]

_PATHS: dict[RequestKind, str] = {"chat": "chat/completions", "completions": "completions"}


class _AzureError(msgspec.Struct):
    message: str = ""
    code: str | None = None
    param: str | None = None


class _AzureEnvelope(msgspec.Struct):
    error: _AzureError


_decode_error = msgspec.json.Decoder(_AzureEnvelope).decode


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
    return OpenAIProvider(
        route, route_id=route_id, urls=azure_urls(route), headers=headers, failure_of=azure_failure
    )


def azure_failure(status: int, headers: Mapping[str, str], payload: bytes) -> AttemptFailed:
    """A non-200 Azure answer as facts; Azure's 429 code (``"429"``) is a rate limit."""
    try:
        err: _AzureError | None = _decode_error(payload).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        err = None
    detail = None
    if err is not None:
        code = "rate_limit_exceeded" if status == 429 else err.code
        detail = UpstreamErrorDetail(err.message or f"status {status}", code=code, param=err.param)
    return AttemptFailed(
        "status",
        status,
        retry_after=parse_retry_after(headers),
        error=detail,
        provider_request_id=headers.get("x-request-id") or headers.get("apim-request-id"),
    )
