"""Composition root: builds stores, providers, accounting and the gateway, and the aiohttp app.

Handlers are thin: authenticate, admit, hand raw bytes to ``Gateway``, write the reply.
Every handler is registered ``guarded``: an ``NcapError`` becomes OpenAI's envelope and
anything else a generic 500 envelope (logged without request content), never a traceback.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from datetime import datetime
from functools import partial
from typing import Any, Protocol, TypeVar

import msgspec
from aiohttp import web

from ncap.auth import hash_key
from ncap.config import Config, Limits, Route
from ncap.domain.grants import Grants, key_id
from ncap.errors import (
    BodyTooLarge,
    ConfigError,
    Forbidden,
    InvalidApiKey,
    InvalidRequest,
    NcapError,
    PolicyDenied,
    RequestTimeout,
)
from ncap.http.admin import ADMIN_STORE, GRANTS, GRANTS_SYNC, GrantsSync, add_admin_routes
from ncap.http.alerts import BudgetAlerter, Webhook
from ncap.http.candidate_alerts import CandidateWatch
from ncap.http.dashboard import DASHBOARD, MIN_ADMIN_KEY_LENGTH, Sessions, add_dashboard_routes
from ncap.http.front import Message
from ncap.http.inflight import InFlightLimit
from ncap.http.limits import (
    body_at_hand,
    body_deadline,
    handler_limits,
    read_limited,
    too_large,
    write_stream,
)
from ncap.http.malformed import protocol_handler_args
from ncap.http.observe import MULTI_CANDIDATE_FIELDS, StoreGauges
from ncap.http.openapi import add_openapi_route
from ncap.http.signals import RequestSignals
from ncap.http.telemetry import telemetry_for
from ncap.lifecycle import Accounting, Caller, Gateway, Reply, RouteRuntime, Settlement
from ncap.lifecycle.health import RouteHealth
from ncap.lifecycle.peers import PeerWatch
from ncap.logsafe import log_internal_error
from ncap.metrics import Metrics
from ncap.providers import capabilities_of, provider_for
from ncap.providers.base import RequestKind
from ncap.stores import Identity, StoreOptions, Stores, open_stores
from ncap.stores.ports import AdminChange, AdminStore

__all__ = ["create_app", "front_of"]

log = logging.getLogger("ncap.http")
_encode = msgspec.json.Encoder().encode

GATEWAY = web.AppKey("gateway", Gateway)
IN_FLIGHT = web.AppKey("in_flight", InFlightLimit)
CONFIG = web.AppKey("config", Config)
ACCOUNTING = web.AppKey("accounting", Accounting)
SETTLEMENT = web.AppKey("settlement", Settlement)
METRICS = web.AppKey("metrics", Metrics)
PEERS = web.AppKey("peers", PeerWatch)
STORES = web.AppKey("stores", Stores)
GAUGES = web.AppKey("gauges", StoreGauges)
STORE_SWEEP_S = 10.0  # how often the store gauges are re-read without a scrape
REQUEST_ID = web.RequestKey("request_id", str)
SIGNALS = web.AppKey("signals", RequestSignals)
ALERTER = web.AppKey("alerter", BudgetAlerter)
CANDIDATE_WATCH = web.AppKey("candidate_watch", CandidateWatch)
WEBHOOK = web.AppKey("webhook", Webhook)


class _NoStats:
    queue_depth = 0


_NO_STATS = _NoStats()


class RequestIds:
    """``req-<random per process>-<counter>``: unique across processes and restarts
    without a random draw (a getrandom syscall) per request."""

    def __init__(self) -> None:
        self._prefix = "req-" + uuid.uuid4().hex[:16] + "-"
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):x}"


REQUEST_IDS = web.AppKey("request_ids", RequestIds)
FRONT_ROUTES = web.AppKey("front_routes", dict)


def front_of(app: web.Application) -> Callable[[], tuple[dict[str, Any], Limits]] | None:
    """What ``http.front`` serves itself for ``app`` (its completion routes and the
    limits they keep), or None for an app without them."""
    if FRONT_ROUTES not in app:
        return None
    return lambda: (app[FRONT_ROUTES], app[CONFIG].limits)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(error: NcapError, request_id: str | None = None) -> web.Response:
    headers = error.headers()
    if request_id:
        headers["x-request-id"] = request_id
    return web.Response(
        status=error.status,
        body=_encode(error.envelope()),
        content_type="application/json",
        headers=headers,
    )


def guarded(handler: Handler) -> Handler:
    """``handler`` with whatever it raises answered in OpenAI's envelope: an ``NcapError``
    as itself, an aiohttp ``HTTPException`` as an invalid request, anything else as a 500
    (logged without request content), never a traceback.

    Every route's handler is registered guarded, and unrouted requests reach guarded
    handlers too (``_add_fallback_routes``), instead of one app middleware: aiohttp runs
    an app's middlewares through layers of its own on every request (a partial per
    middleware and one that sets the request's current app), about 13k instructions of
    a request's 790k."""

    async def guard(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except Exception as exc:
            return _error_answer(request, exc)

    return guard


def _error_answer(request: web.Request, exc: Exception) -> web.Response:
    """What a route answers for ``exc``, in OpenAI's envelope (the route guard's answer)."""
    where = f"{request.method} {request.path}"
    return _error_for(request.app[METRICS], where, exc, request.get(REQUEST_ID))


def _error_for(
    metrics_: Metrics, where: str, exc: Exception, request_id: str | None
) -> web.Response:
    """``_error_answer`` given the parts of the request it uses (``where``: its method
    and path, for the log line of an internal error)."""
    if isinstance(exc, NcapError):
        _count_refusal(metrics_, exc)
        response = error_response(exc, request_id)
        if isinstance(exc, RequestTimeout):
            response.force_close()  # the rest of a stalled body is never waited for
        return response
    if isinstance(exc, web.HTTPException):
        return _http_exception(exc)
    log_internal_error(log, f"internal error on {where}", exc)
    return error_response(NcapError("The gateway had an internal error."), request_id)


def _add_fallback_routes(app: web.Application) -> None:
    """Requests no route takes, answered by guarded handlers in OpenAI's envelope: a
    known path with another method 405, any other path 404. Added last: a resource
    tries its own methods first, the router its other resources before the catch-all."""
    for resource in list(app.router.resources()):
        if isinstance(resource, web.Resource):  # every route's: no static files, no sub-apps
            allowed = frozenset(route.method for route in resource)
            resource.add_route("*", guarded(_method_not_allowed(allowed)))
    app.router.add_route("*", "/{path:.*}", guarded(_not_found))


def _method_not_allowed(allowed: frozenset[str]) -> Handler:
    async def refuse(request: web.Request) -> web.StreamResponse:
        raise web.HTTPMethodNotAllowed(request.method, allowed)

    return refuse


async def _not_found(request: web.Request) -> web.StreamResponse:
    raise web.HTTPNotFound()


def _count_refusal(metrics_: Metrics, exc: NcapError) -> None:
    """Body-validation refusals by code; policy denials are counted by the lifecycle."""
    if isinstance(exc, InvalidRequest) and not isinstance(exc, PolicyDenied):
        multi = exc.param in MULTI_CANDIDATE_FIELDS
        metrics_.validation_refused(str(exc.code), multi)


def _http_exception(exc: web.HTTPException) -> web.Response:
    code = "not_found" if exc.status == 404 else "invalid_request"
    err = {"message": exc.reason, "type": "invalid_request_error", "param": None, "code": code}
    if exc.status == 413:
        err.update(message="The request body is too large.", code="request_too_large")
    return web.Response(
        status=exc.status, body=_encode({"error": err}), content_type="application/json"
    )


_LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


_LOOPBACK_SEEN: dict[str, bool] = {}  # Host headers already classified (at most 64)


def _loopback_host(value: str) -> bool:
    """``value`` (a Host header, or an origin's host[:port]) names this machine."""
    seen = _LOOPBACK_SEEN.get(value)
    if seen is None:
        seen = _classify_host(value)
        if len(_LOOPBACK_SEEN) < 64:
            _LOOPBACK_SEEN[value] = seen
    return seen


def _classify_host(value: str) -> bool:
    host = value.strip().lower()
    if host.startswith("["):  # [::1]:8080
        host = host[1 : host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host in _LOOPBACK_HOSTS:
        return True
    try:  # 127.0.0.2 and the rest of 127.0.0.0/8 (a bind the config allows keyless)
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _media_type(value: str | None) -> str:
    """A ``Content-Type`` value's media type, lower-cased, without its parameters."""
    return "" if value is None else value.partition(";")[0].strip().lower()


def _keyless_refusal(method: str, headers: Mapping[str, str]) -> str | None:
    """Why a keyless request may not be served. Keyless mode serves programs on this
    machine, not web pages: a browser can be made to send a cross-site "simple" POST
    (``text/plain``, no preflight) or, by DNS rebinding, a same-origin one under
    another host name. So: a JSON body, a loopback ``Host``, and no ``Origin`` but a
    loopback one."""
    content_type = headers.get("Content-Type")
    if (
        method == "POST"
        and content_type != "application/json"  # as the SDKs send it
        and _media_type(content_type) != "application/json"  # with parameters, in any case
    ):
        return "Keyless mode only serves requests with Content-Type: application/json."
    if not _loopback_host(headers.get("Host", "")):
        return "Keyless mode only serves requests addressed to a loopback host."
    origin = headers.get("Origin")
    if origin is not None:
        scheme, _, rest = origin.partition("://")
        if scheme not in ("http", "https") or not _loopback_host(rest.rstrip("/")):
            return "Keyless mode does not serve requests from web pages of other origins."
    return None


def _authenticate(
    method: str, headers: Mapping[str, str], grants: Grants, retries: int | None = None
) -> Caller:
    """The caller of a key in force (config's and admin-made, minus revoked ones);
    while no key was ever set, every request is workload ``default``, if it is one a
    local program sent (``_keyless_refusal``). ``retries``: the client's own retry
    number, recorded with the caller (built once, not copied to add it)."""
    if not grants.keys_required:
        refusal = _keyless_refusal(method, headers)
        if refusal is not None:
            raise Forbidden(refusal + " Create an API key (`ncap keys create`) to serve others.")
        return Caller("default", "default", retries)
    header = headers.get("Authorization", "")
    if not header.strip():
        raise InvalidApiKey(
            "You didn't provide an API key. You need to provide your API key in an "
            "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY). "
            "An operator creates keys with `ncap keys create`."
        )
    scheme, _, key = header.partition(" ")
    if scheme.lower() == "bearer" and key:
        digest = hash_key(key.strip())
        for entry in grants.keys:
            if secrets.compare_digest(entry.hash, digest):
                return Caller(entry.workload, entry.environment, retries, key_id(entry))
    raise InvalidApiKey("Incorrect API key provided.")


class Completions:
    """The completion endpoints (``/v1/chat/completions`` and the legacy
    ``/v1/completions``), with the app's parts every request uses resolved once, when the
    routes are added: each ``request.app[...]`` is a Python call into aiohttp's
    ``Application``.

    One handler, ``_serve``, over two ways in: ncap's front (``http.front``), which
    serves these routes on every connection ``ncap serve`` accepts, and aiohttp's router
    (a connection aiohttp already owns, or an app served by aiohttp alone), each an
    ``_Exchange`` that reads the body and writes the answer its way."""

    def __init__(self, app: web.Application) -> None:
        self._ids = app[REQUEST_IDS]
        self._signals = app[SIGNALS]
        self._grants = app[GRANTS]
        self._in_flight = app[IN_FLIGHT]
        self._limits = app[CONFIG].limits
        self._gateway = app[GATEWAY]
        self._metrics = app[METRICS]

    def handlers(self) -> tuple[Handler, Handler]:
        """aiohttp's handlers of ``/v1/chat/completions`` and of the legacy
        ``/v1/completions`` (``n`` and ``best_of``, through the same lifecycle). Each is
        its own guard: it answers errors as ``guarded`` does, so a request runs one
        coroutine fewer."""

        async def chat(request: web.Request) -> web.StreamResponse:
            return await self._serve(_AiohttpExchange(request, self._metrics), "chat")

        async def legacy(request: web.Request) -> web.StreamResponse:
            return await self._serve(_AiohttpExchange(request, self._metrics), "completions")

        return chat, legacy

    def front_routes(self) -> dict[str, Callable[[Message], Awaitable[None]]]:
        """The front's handlers, by path (each answers on the message's connection)."""

        async def chat(message: Message) -> None:
            await self._serve(_FrontExchange(message, self._metrics), "chat")

        async def legacy(message: Message) -> None:
            await self._serve(_FrontExchange(message, self._metrics), "completions")

        return {"/v1/chat/completions": chat, "/v1/completions": legacy}

    async def _serve(self, ex: _Exchange[_A], kind: RequestKind) -> _A:
        """The request's answer; an error answered as ``guarded`` answers it."""
        request_id = self._ids.next()
        ex.begin(request_id)
        signals = self._signals
        try:
            headers = ex.headers
            signals.begin(request_id, headers)
            retries = _client_retry_count(headers.get("x-stainless-retry-count"))
            caller = _authenticate(ex.method, headers, self._grants, retries)
            signals.caller(request_id, caller)
            in_flight = self._in_flight
            in_flight.enter()
            try:
                limits = self._limits
                raw = ex.body_now(limits.max_body_bytes)
                if raw is None:  # more of it is to come
                    async with body_deadline(limits.body_timeout_s):
                        raw = await ex.read_body(limits.max_body_bytes)
                gateway = self._gateway
                if kind == "chat":
                    key = headers.get("Idempotency-Key")
                    reply = await gateway.chat(raw, caller, request_id, idempotency_key=key)
                else:
                    reply = await gateway.completions(raw, caller, request_id)
                reply.headers["x-request-id"] = request_id
                signals.responded(request_id, reply.status)
                stream = reply.stream
                if stream is None:
                    if not reply.settling:
                        signals.end(request_id)
                    return ex.whole(reply)
                relay = partial(
                    _relay, stream=stream, request_id=request_id, signals=signals, limits=limits
                )
                return await ex.stream(reply, relay)
            finally:
                in_flight.leave()
        except Exception as exc:
            try:
                _ended(signals, request_id, exc)
            except Exception as bug:  # the record's own failure is what the client gets
                exc = bug
            return ex.error(exc, request_id)
        except BaseException as exc:  # cancelled: the client went away
            _ended(signals, request_id, exc)
            raise


_A = TypeVar("_A", covariant=True)
# ``_relay`` with the stream and its request's parts bound: (request, response) -> written
_Relay = Callable[[Any, Any], Awaitable[bool]]


class _Exchange(Protocol[_A]):
    """One request as ``Completions._serve`` sees it: its head, its body and how its
    answer (of type ``_A``) is written."""

    @property
    def method(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    def begin(self, request_id: str) -> None: ...

    def body_now(self, limit: int) -> bytes | None: ...

    async def read_body(self, limit: int) -> bytes: ...

    def whole(self, reply: Reply) -> _A: ...

    async def stream(self, reply: Reply, relay: _Relay) -> _A: ...

    def error(self, exc: Exception, request_id: str) -> _A: ...


class _AiohttpExchange:
    """A request aiohttp parsed: the answer is a response aiohttp writes."""

    __slots__ = ("_metrics", "_request", "headers", "method")

    def __init__(self, request: web.Request, metrics_: Metrics) -> None:
        self._request = request
        self._metrics = metrics_
        self.headers = request.headers
        self.method = request.method

    def begin(self, request_id: str) -> None:
        self._request[REQUEST_ID] = request_id

    def body_now(self, limit: int) -> bytes | None:
        return body_at_hand(self._request, limit)

    async def read_body(self, limit: int) -> bytes:
        raw = await read_limited(self._request, limit)
        if raw is None:
            raise too_large(limit)
        return raw

    def whole(self, reply: Reply) -> web.StreamResponse:
        return web.Response(status=reply.status, body=reply.body, headers=reply.headers)

    async def stream(self, reply: Reply, relay: _Relay) -> web.StreamResponse:
        response = web.StreamResponse(status=reply.status, headers=reply.headers)
        await relay(self._request, response)
        return response

    def error(self, exc: Exception, request_id: str) -> web.StreamResponse:
        request = self._request
        return _error_for(self._metrics, f"{request.method} {request.path}", exc, request_id)


class _FrontExchange:
    """A request ncap's front parsed: the answer is written on its connection."""

    __slots__ = ("_message", "_metrics", "headers", "method")

    def __init__(self, message: Message, metrics_: Metrics) -> None:
        self._message = message
        self._metrics = metrics_
        self.headers = message.headers
        self.method = message.method

    def begin(self, request_id: str) -> None:
        pass

    def body_now(self, limit: int) -> bytes | None:
        return self._message.body_now(limit)

    async def read_body(self, limit: int) -> bytes:
        return await self._message.read_body(limit)

    def whole(self, reply: Reply) -> None:
        self._message.answer(reply.status, reply.headers, reply.body)

    async def stream(self, reply: Reply, relay: _Relay) -> None:
        message = self._message
        response = message.stream(reply.status, reply.headers)
        if await relay(message, response):
            await response.write_eof()

    def error(self, exc: Exception, request_id: str) -> None:
        message = self._message
        response = _error_for(self._metrics, f"{message.method} {message.path}", exc, request_id)
        body = response.body
        assert isinstance(body, bytes)
        # a body over the limit is not read to its end: the connection closes
        close = response.keep_alive is False or isinstance(exc, BodyTooLarge)
        message.answer(response.status, response.headers, body, close=close)


def _ended(signals: RequestSignals, request_id: str, exc: BaseException) -> None:
    """The record of a request that ended in ``exc`` (a no-op when its answer already
    ended it)."""
    signals.responded(request_id, *_status_of(exc))
    signals.end(request_id)


def _status_of(exc: BaseException) -> tuple[int, str | None]:
    """The status and code the client gets for ``exc`` (what ``guarded`` answers)."""
    if isinstance(exc, NcapError):
        return exc.status, str(exc.code)
    if isinstance(exc, web.HTTPException):
        return exc.status, None
    if isinstance(exc, asyncio.CancelledError):
        return 499, "client_closed_request"
    return 500, "internal_error"


def _client_retry_count(header: str | None) -> int | None:
    """The SDK's retry number (0 on the first try); anything not a small count is
    ignored (it is only recorded, never acted on)."""
    if header is None or not header.strip().isdigit():
        return None
    value = int(header)
    return value if value < 2**31 else None


async def _relay(
    request: Any,
    response: Any,
    *,
    stream: AsyncIterator[bytes],
    request_id: str,
    signals: RequestSignals,
    limits: Limits,
) -> bool:
    """A streamed answer written as its chunks come; False when the client went away.
    A whole answer whose settlement the lifecycle runs beside it (``Reply.settling``)
    has its record ended by the settlement service, once its tokens are known."""
    try:
        # the stream is started before anything can fail, so that closing it always
        # runs its settlement and closes the upstream (its first event is already here)
        await write_stream(
            request, response, stream, limits, lambda: signals.first_chunk(request_id)
        )
        return True
    except (ConnectionError, OSError):
        return False  # the client went away; closing the stream cancels the upstream request
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
        signals.end(request_id)  # every attempt of the stream is closed by now


async def list_models(request: web.Request) -> web.Response:
    caller = _authenticate(request.method, request.headers, request.app[GRANTS])
    created = int(time.time())
    data = [
        {"id": alias, "object": "model", "created": created, "owned_by": "ncap"}
        for alias in request.app[GATEWAY].models_for(caller)
    ]
    return web.json_response({"object": "list", "data": data}, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return _encode(obj).decode()


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


OPERATIONS_KEY = web.AppKey("operations_key", str)


def operations_key_from_env(config: Config) -> str | None:
    """The token ``/metrics``, ``/readyz`` and ``/openapi.json`` require, when the config
    names its variable; ``ConfigError`` when that variable is unset or too short (the
    config asked for a credential: never serve them open by accident)."""
    env = config.server.operations_key_env
    if env is None:
        return None
    key = os.environ.get(env, "")
    if len(key) < MIN_ADMIN_KEY_LENGTH:
        raise ConfigError(
            f"server.operations_key_env names {env}, which holds {len(key)} characters; "
            f"at least {MIN_ADMIN_KEY_LENGTH} are required"
        )
    return key


def _operations_guard(request: web.Request) -> None:
    """401 without a token, 403 with a wrong one, when an operations key is set (the
    admin key is accepted as well)."""
    key = request.app.get(OPERATIONS_KEY)
    if key is None:
        return
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise InvalidApiKey(
            "Send the operations key (server.operations_key_env) as a Bearer token."
        )
    admin = request.app[DASHBOARD].admin_key
    if secrets.compare_digest(token.encode(), key.encode()):
        return
    if admin is not None and secrets.compare_digest(token.encode(), admin.encode()):
        return
    raise Forbidden("That key is not the operations key.")


async def readyz(request: web.Request) -> web.Response:
    """Ready when every store answers; a failure names the store and its backend."""
    _operations_guard(request)
    stores = await request.app[ACCOUNTING].check_ready()
    problems = [
        f"{name} ({s['backend']}): {s['error']}" for name, s in stores.items() if not s["ready"]
    ]
    body = {"ready": not problems, "problems": problems, "stores": stores}
    return web.json_response(body, status=200 if not problems else 503)


async def metrics(request: web.Request) -> web.Response:
    _operations_guard(request)
    await request.app[GAUGES].refresh()  # store-derived gauges, cached briefly
    body, content_type = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": content_type})


def _health(route: Route, route_id: str, metrics: Metrics) -> RouteHealth | None:
    """Remote routes report their health; the local engine has its own queue gauge."""
    if capabilities_of(route.provider).in_process:
        return None
    return RouteHealth(metrics, route_id)


async def _warm_local_engines(routes: Iterable[RouteRuntime], metrics: Metrics) -> None:
    """Load local models before serving (not on the first request) and export the
    engine's queue depth."""
    local_routes = [rt for rt in routes if rt.capabilities.in_process]
    if not local_routes:
        return
    from ncap.providers.local import LocalProvider

    locals_ = [rt.provider for rt in local_routes if isinstance(rt.provider, LocalProvider)]
    for provider in locals_:
        await provider.engine()

    def depth() -> float:
        return float(sum((p.stats() or _NO_STATS).queue_depth for p in locals_))

    metrics.watch_engine_queue(depth)


def _grants_sync(config: Config, stores: Stores, grants: Grants) -> GrantsSync:
    """Other gateways on a shared ledger change its admin tables too: re-read them every
    ``stores.admin_refresh_s``; a ledger no other process writes has no other writer."""
    refresh = config.stores.admin_refresh_s if stores.shared else None
    return GrantsSync(stores.admin, grants, refresh)


def _open_stores(config: Config, instance: str) -> Stores:
    """The stores the config names; budgets rebuild from the ledger (at start-up when
    in-process, whenever Redis lost them)."""
    stores = config.stores
    options = StoreOptions(
        gateway_instance=instance, durability=stores.ledger_durability, timeout_s=stores.timeout_s
    )
    return open_stores(stores.ledger, stores.budgets, options)


def _request_signals(config: Config, tracer_provider: Any, meter_provider: Any) -> RequestSignals:
    """The access log, spans and GenAI metrics, as the observability settings ask."""
    obs = config.observability
    telemetry = telemetry_for(obs, tracer_provider=tracer_provider, meter_provider=meter_provider)
    return RequestSignals(access_log=obs.access_log, telemetry=telemetry)


def _route_runtimes(config: Config, metrics: Metrics) -> dict[str, RouteRuntime]:
    """Each configured route with its provider (remote ones report their health); a
    contract asking a provider for a candidate mode it does not have is refused here."""
    for rid, route in config.routes.items():
        mode = route.contract.candidates
        caps = capabilities_of(route.provider)
        if mode in ("native", "emulate") and mode not in caps.candidates:
            raise ConfigError(
                f"routes.{rid}.contract.candidates: {caps.title} route has no native n; "
                "use candidates: emulate (fan-out)"
            )
    return {
        rid: RouteRuntime(
            rid, route, provider_for(route, route_id=rid), _health(route, rid, metrics)
        )
        for rid, route in config.routes.items()
    }


def _sessions(store: AdminStore, sync: GrantsSync, grants: Grants) -> Sessions:
    """A dashboard sign-out: an audit row every gateway of the ledger reads back."""

    async def end(at: datetime) -> None:
        await store.record(AdminChange("dashboard", "revoke", "session", "dashboard"), at)
        await sync.reload()

    return Sessions(grants, end)


def _add_routes(app: web.Application, config: Config, stores: Stores, sessions: Sessions) -> None:
    """Every API endpoint (README.md, docs/operations.md), the dashboard, the admin API and
    the OpenAPI document."""
    completions = Completions(app)
    app[FRONT_ROUTES] = completions.front_routes()
    chat, legacy = completions.handlers()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", legacy)
    app.router.add_get("/v1/models", guarded(list_models))
    app.router.add_get("/healthz", guarded(healthz))
    app.router.add_get("/readyz", guarded(readyz))
    app.router.add_get("/metrics", guarded(metrics))
    add_dashboard_routes(app, config, stores, sessions, guard=guarded)
    add_admin_routes(app, config, guard=guarded)
    add_openapi_route(app, _operations_guard, guard=guarded)
    _add_fallback_routes(app)


def create_app(
    config: Config,
    *,
    instance_id: str | None = None,
    tracer_provider: Any = None,
    meter_provider: Any = None,
    stores: Stores | None = None,
) -> web.Application:
    """Wire every concrete part once; the app owns them and closes them on cleanup.
    ``stores``: opened stores to use (by default, those ``config.stores`` names)."""
    app = web.Application(
        client_max_size=config.limits.max_body_bytes + 1024,
        handler_args=protocol_handler_args() | handler_limits(config.limits),
    )
    instance = instance_id or config.server.instance_id or f"{os.uname().nodename}-{os.getpid()}"
    metrics_ = app[METRICS] = Metrics()
    stores = app[STORES] = stores or _open_stores(config, instance)
    grants = app[GRANTS] = Grants.from_config(config)
    app[ADMIN_STORE] = stores.admin
    app[GRANTS_SYNC] = _grants_sync(config, stores, grants)
    signals = app[SIGNALS] = _request_signals(config, tracer_provider, meter_provider)
    accounting = app[ACCOUNTING] = _books(app, config, stores, instance, signals)
    ledger, budgets = accounting.ledger, accounting.budgets
    app[GAUGES] = StoreGauges(
        config, ledger, budgets, metrics_, max_age_s=config.server.metrics_cache_s, grants=grants
    )
    app[PEERS] = PeerWatch(
        stores.instances,
        ledger,
        budgets,
        Identity.current(instance),
        interval_s=config.server.heartbeat_interval_s,
        timeout_s=config.server.heartbeat_timeout_s,
        reserved_timeout_s=config.reserved_timeout_s,
    )
    routes = _route_runtimes(config, metrics_)
    app[CONFIG] = config
    app[IN_FLIGHT] = InFlightLimit(config.server.max_in_flight, config.server.ramp)
    app[GATEWAY] = Gateway(config, routes, accounting, idempotency=stores.idempotency)
    app[REQUEST_IDS] = RequestIds()
    operations_key = operations_key_from_env(config)
    if operations_key is not None:
        app[OPERATIONS_KEY] = operations_key
    _add_routes(app, config, stores, _sessions(stores.admin, app[GRANTS_SYNC], grants))

    app.cleanup_ctx.append(_lifecycle)
    return app


def _books(
    app: web.Application, config: Config, stores: Stores, instance: str, signals: RequestSignals
) -> Accounting:
    """The ledger (observed for the cost metrics) and the budgets, with what watches each
    closed attempt: the request's record, the budget alerts and the candidates' watch
    (the latter two kept on the app for the admin API and start-up)."""
    metrics_, grants, admin_store = app[METRICS], app[GRANTS], app[ADMIN_STORE]
    webhook = app[WEBHOOK] = Webhook(config.alerts, metrics_)
    alerter = app[ALERTER] = BudgetAlerter(
        config, grants, stores.budgets, admin_store, metrics=metrics_, webhook=webhook
    )
    duplicates = app[CANDIDATE_WATCH] = CandidateWatch(config, admin_store, webhook)
    settlement = app[SETTLEMENT] = Settlement(metrics_, on_request_settled=signals.settled)
    return Accounting(
        config,
        stores.ledger,
        stores.budgets,
        instance=instance,
        metrics=metrics_,
        grants=grants,
        observers=[o for o in (signals, alerter, duplicates) if o.enabled],
        start_observers=[signals] if signals.telemetry is not None else [],
        settlement=settlement,
    )


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Start-up before the first request, then the orderly shutdown (``cleanup_ctx``)."""
    accounting, peers, admin_store = app[ACCOUNTING], app[PEERS], app[ADMIN_STORE]
    routes = app[GATEWAY].routes.values()
    # recovery that knows its peers (docs/decisions/peer-recovery-heartbeats.md): only dead
    # instances' rows are lost
    await peers.start()
    # shared counters made whole from the ledger before serving (Redis)
    await app[STORES].prepare(app[CONFIG].workloads)
    # in-process budgets rebuild from the ledger here even when no peer was lost
    # (once; a no-op for shared stores: this new instance holds nothing yet)
    await accounting.budgets.recover_lost(accounting.instance)
    await app[GRANTS_SYNC].start()  # admin-made entries survive a restart; replicas sync
    await app[GAUGES].refresh(force=True)
    # the store snapshot also settles holds another process reconciled: not only on scrape
    gauges = asyncio.create_task(app[GAUGES].run(STORE_SWEEP_S))
    await _warm_local_engines(routes, app[METRICS])
    yield
    gauges.cancel()
    await asyncio.gather(gauges, return_exceptions=True)
    await app[SETTLEMENT].drain()  # the answers' settlements, before their observers stop
    await app[ALERTER].drain()
    await app[CANDIDATE_WATCH].drain()
    await app[WEBHOOK].close()  # after both: either may be posting until its drain ends
    app[SIGNALS].shutdown()  # the last spans and metrics exported (OTLP)
    await app[GRANTS_SYNC].stop()
    for rt in routes:
        await rt.provider.aclose()
    # settlements a store refused are retried until the deadline; what is left stays
    # where recovery finds it: this instance remains registered, as if it had died
    left = await app[SETTLEMENT].stop(app[CONFIG].server.shutdown_retry_s)
    await peers.stop(leave=left == 0)
    await accounting.close()
    await admin_store.close()
