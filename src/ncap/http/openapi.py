"""ncap's own OpenAPI 3.1 description, generated from the wire structs the validator uses.

The request schema is ``msgspec.json.schema_components`` over the same
``ChatCompletionRequest`` that ``protocol.validate`` converts bodies into, and the
answers are the same response structs the gateway encodes, so the published contract
cannot drift from what is enforced; the legacy ``/v1/completions`` is described the same
way, over ``CompletionRequest`` (what ``parse_completion_request`` converts into) and
``TextCompletion``. A new endpoint is one ``Operation`` in ``OPERATIONS``.

The admin API (``/admin/…``, admin key only) is described from ``ADMIN_ROUTES``, the
table its routes are registered from; its request bodies are the pydantic models the
handlers validate with (their JSON Schema), so those cannot drift either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler

from ncap import __version__
from ncap.http.admin import ADMIN_ROUTES, AdminRoute
from ncap.protocol.chat import ChatCompletionRequest
from ncap.protocol.completions import CompletionRequest, TextCompletion
from ncap.protocol.responses import ChatCompletion, ErrorEnvelope

__all__ = ["OPERATIONS", "Operation", "add_openapi_route", "openapi_document"]

_REF = "#/components/schemas/{name}"


@dataclass(frozen=True, slots=True)
class Operation:
    """One endpoint: its path, method, request struct (None: no body) and 200 struct."""

    path: str
    method: str
    summary: str
    request: type[Any] | None = None
    response: type[Any] | None = None
    stream: bool = False
    auth: bool = True


OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "/v1/chat/completions",
        "post",
        "Create a chat completion (n candidates, budgets enforced).",
        request=ChatCompletionRequest,
        response=ChatCompletion,
        stream=True,
    ),
    Operation(
        "/v1/completions",
        "post",
        "Create a legacy text completion (n and best_of, budgets enforced).",
        request=CompletionRequest,
        response=TextCompletion,
        stream=True,
    ),
    Operation("/v1/models", "get", "List the model aliases this key may use."),
    Operation("/healthz", "get", "Liveness.", auth=False),
    Operation("/readyz", "get", "Readiness (stores reachable).", auth=False),
)


@cache
def openapi_document() -> dict[str, Any]:
    """The whole document; cached (it depends only on the code)."""
    structs = [ErrorEnvelope]
    structs += [t for op in OPERATIONS for t in (op.request, op.response) if t is not None]
    _, components = msgspec.json.schema_components(structs, ref_template=_REF)
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op)
    for route in ADMIN_ROUTES:
        paths.setdefault(route.path, {})[route.method] = _admin_operation(route, components)
    return {
        "openapi": "3.1.0",
        "info": {"title": "ncap", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _ref(struct: type[Any]) -> dict[str, str]:
    return {"$ref": _REF.format(name=struct.__name__)}


def _operation(op: Operation) -> dict[str, Any]:
    error = {"application/json": {"schema": _ref(ErrorEnvelope)}}
    ok: dict[str, Any] = {"application/json": {"schema": _ref(op.response) if op.response else {}}}
    if op.stream:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    out: dict[str, Any] = {
        "summary": op.summary,
        "operationId": op.method + op.path.replace("/", "_").replace(".", "_"),
        "responses": {
            "200": {"description": "OK", "content": ok},
            "default": {"description": "An OpenAI-shaped error.", "content": error},
        },
    }
    if op.auth:
        out["security"] = [{"bearer": []}]
    if op.request is not None:
        out["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(op.request)}},
        }
    return out


def _admin_operation(route: AdminRoute, components: dict[str, Any]) -> dict[str, Any]:
    """An admin endpoint: its body's JSON Schema (from the pydantic model) goes into
    ``components``; answers are JSON objects (a list is ``{"object": "list", "data"}``)."""
    error = {"application/json": {"schema": _ref(ErrorEnvelope)}}
    ok = {"application/json": {"schema": {"type": "object"}}}
    out: dict[str, Any] = {
        "summary": route.summary,
        "tags": ["admin"],
        "operationId": route.method
        + route.path.replace("/", "_").replace("{", "").replace("}", ""),
        "security": [{"bearer": []}],
        "responses": {
            "201" if route.created else "200": {"description": "OK", "content": ok},
            "default": {"description": "An OpenAI-shaped error.", "content": error},
        },
    }
    if "{id}" in route.path:
        out["parameters"] = [
            {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
        ]
    if route.body is not None:
        name = route.body.__name__
        schema = route.body.model_json_schema(ref_template=_REF.replace("{name}", "{model}"))
        components.update(schema.pop("$defs", {}))
        components[name] = schema
        out["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(name=name)}}},
        }
    return out


def add_openapi_route(
    app: web.Application,
    check: Callable[[web.Request], None] | None = None,
    *,
    guard: Callable[[Handler], Handler],
) -> None:
    """``GET /openapi.json``: it describes the API (route and alias names included);
    ``check`` raises for a request that may not read it (``server.operations_key_env``);
    ``guard`` wraps the handler (the app's error envelope)."""
    body = msgspec.json.encode(openapi_document())

    async def handler(request: web.Request) -> web.StreamResponse:
        if check is not None:
            check(request)
        return web.Response(body=body, content_type="application/json")

    app.router.add_get("/openapi.json", guard(handler))
