"""A fake Azure OpenAI upstream: the OpenAI fake (``fake_upstream``: same answers, same
fault profiles) behind Azure's URLs, credential and error shapes.

    POST /openai/deployments/{deployment}/chat/completions?api-version=V   (and /completions)
    POST /openai/v1/chat/completions                                       (and /completions)

The key is read from ``api-key`` (401 with Azure's envelope when it is wrong or missing);
the deployment form needs the ``api-version`` the fake was built with (404 "Resource not
found" otherwise, as Azure answers). ``x-fake-azure`` selects Azure's own behaviours:

    prompt_filtered      400 ``content_filter``: the prompt tripped the content filter
    output_filtered      every choice stops with ``finish_reason: content_filter`` and
                         carries ``content_filter_results`` (whole or streamed)
    rate_limited=MS      429 with ``retry-after-ms: MS`` (and ``retry-after`` rounded up)
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from ncap.testing.fake_upstream import create_app

__all__ = ["AZURE_LOG", "AzureLog", "create_azure_app"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_ENCODE = msgspec.json.encode
_FILTERED = {
    "hate": {"filtered": False, "severity": "safe"},
    "self_harm": {"filtered": False, "severity": "safe"},
    "sexual": {"filtered": False, "severity": "safe"},
    "violence": {"filtered": True, "severity": "medium"},
}


@dataclass(slots=True)
class AzureLog:
    """The Azure paths the fake served, and the api-key each request presented."""

    paths: list[str] = field(default_factory=list)
    keys: list[str | None] = field(default_factory=list)


AZURE_LOG = web.AppKey("ncap_fake_azure_log", AzureLog)


def _azure_error(status: int, code: str, message: str, **extra: Any) -> web.Response:
    body = {"error": {"code": code, "message": message, **extra}}
    return web.Response(status=status, body=_ENCODE(body), content_type="application/json")


def _filtered_body(request_body: dict[str, Any], rid: str) -> dict[str, Any]:
    n = int(request_body.get("n") or 1)
    choices = [
        {
            "index": i,
            "finish_reason": "content_filter",
            "message": {"role": "assistant", "content": None},
            "content_filter_results": _FILTERED,
            "logprobs": None,
        }
        for i in range(n)
    ]
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": 1700000000,
        "model": str(request_body.get("model") or "gpt-4o"),
        "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": {}}],
        "choices": choices,
        "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n},
    }


def _filtered_stream(whole: dict[str, Any], include_usage: bool) -> bytes:
    base = {k: whole[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    events = [{**base, "choices": [], "prompt_filter_results": whole["prompt_filter_results"]}]
    for choice in whole["choices"]:
        delta = {
            "index": choice["index"],
            "delta": {"role": "assistant", "content": ""},
            "finish_reason": None,
        }
        events.append({**base, "choices": [delta]})
        end = {
            "index": choice["index"],
            "delta": {},
            "finish_reason": "content_filter",
            "content_filter_results": _FILTERED,
        }
        events.append({**base, "choices": [end]})
    if include_usage:
        events.append({**base, "choices": [], "usage": whole["usage"]})
    data = b"".join(b"data: " + _ENCODE(e) + b"\n\n" for e in events)
    return data + b"data: [DONE]\n\n"


async def _output_filtered(request: web.Request) -> web.StreamResponse:
    body = msgspec.json.decode(await request.read())
    whole = _filtered_body(body, "azure")
    if not body.get("stream"):
        return web.json_response(whole)
    include = bool((body.get("stream_options") or {}).get("include_usage"))
    payload = _filtered_stream(whole, include)
    return web.Response(body=payload, content_type="text/event-stream")


def _gate(api_key: str | None, api_version: str, endpoint: Handler) -> Handler:
    """Azure's checks and behaviours in front of one of the OpenAI fake's endpoints."""

    async def handle(request: web.Request) -> web.StreamResponse:
        log = request.app[AZURE_LOG]
        log.paths.append(request.path_qs)
        log.keys.append(request.headers.get("api-key"))
        if "deployment" in request.match_info and request.query.get("api-version") != api_version:
            return _azure_error(404, "404", "Resource not found")
        if api_key is not None and request.headers.get("api-key") != api_key:
            message = "Access denied due to invalid subscription key or wrong API endpoint."
            return _azure_error(401, "401", message)
        behaviour, _, value = request.headers.get("x-fake-azure", "").partition("=")
        if behaviour == "prompt_filtered":
            message = (
                "The response was filtered due to the prompt triggering Azure OpenAI's "
                "content management policy."
            )
            inner = {"code": "ResponsibleAIPolicyViolation", "content_filter_result": _FILTERED}
            return _azure_error(400, "content_filter", message, param="prompt", innererror=inner)
        if behaviour == "rate_limited":
            ms = int(value or "1000")
            headers = {"retry-after-ms": str(ms), "retry-after": str(math.ceil(ms / 1000))}
            response = _azure_error(429, "429", "Requests have exceeded the token rate limit.")
            response.headers.update(headers)
            return response
        if behaviour == "output_filtered":
            return await _output_filtered(request)
        return await endpoint(request)

    return handle


def create_azure_app(
    profile: str | None = None, *, api_key: str | None = None, api_version: str = "2024-10-21"
) -> web.Application:
    """The OpenAI fake's app (its ``STATE`` counts every request) with Azure's routes."""
    app = create_app(profile)
    app[AZURE_LOG] = AzureLog()
    endpoints = {
        r.resource.canonical: r.handler
        for r in app.router.routes()
        if r.resource is not None and r.method == "POST"
    }
    for path in ("chat/completions", "completions"):
        endpoint = _gate(api_key, api_version, endpoints[f"/v1/{path}"])
        app.router.add_post(f"/openai/deployments/{{deployment}}/{path}", endpoint)
        app.router.add_post(f"/openai/v1/{path}", endpoint)
    return app
