"""``/admin/…``: list, create and revoke candidate-count exceptions and API keys.

Admin key only, as a Bearer token (the dashboard's check, ``admin_refusal``; the
dashboard's browser cookie is not accepted here, so no page can make a browser write
through the admin API). Each change is written with its audit row (who, when, what)
in one transaction of the admin store, then the in-memory ``Grants`` snapshot is
swapped, so the next request's policy and key check see it; no restart. The other
gateways on a shared ledger (PostgreSQL replicas, ``--workers`` on one SQLite file)
re-read the store every ``stores.admin_refresh_s`` (``GrantsSync``), so a key revoked
on one is refused by all within that interval. A key is
shown once, in the answer that created it; only its hash is stored. Who made a
change is the credential that made it: the audit's actor is ``admin-key:`` and the
first 12 hex digits of the admin key's SHA-256 (so a rotated key shows as another
actor); an ``X-Ncap-Actor`` header (an operator's name or address) is not verified and
is kept only as ``claimed_actor`` in the audit row's detail.

Every id an admin names (an exception's id, a key's label, a path's id) is bounded in
length and alphabet (``config.ID_PATTERN``, ``LABEL_PATTERN``): it reaches metric
labels, the ledger and the dashboard.

Routes: ``GET/POST /admin/exceptions``, ``DELETE /admin/exceptions/{id}``,
``GET/POST /admin/keys``, ``DELETE /admin/keys/{id}`` (the id is the key's hash
prefix or its label), ``GET /admin/audit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec
import pydantic
from aiohttp import web
from aiohttp.typedefs import Handler

from ncap.auth import hash_key
from ncap.config import ID_PATTERN, LABEL_PATTERN, Config, ExceptionGrant, KeyEntry
from ncap.domain.grants import Grants, key_id
from ncap.errors import (
    Forbidden,
    InvalidApiKey,
    InvalidJSON,
    InvalidType,
    InvalidValue,
    MissingParameter,
    NotFound,
    RateLimitExceeded,
)
from ncap.http.dashboard import DASHBOARD, admin_refusal
from ncap.http.limits import body_deadline, read_limited
from ncap.stores.ports import Action, AdminChange, AdminStore, DuplicateGrant, Kind

__all__ = [
    "ADMIN_ROUTES",
    "ADMIN_STORE",
    "GRANTS",
    "GRANTS_SYNC",
    "AdminRoute",
    "GrantsSync",
    "NewKey",
    "add_admin_routes",
]

log = logging.getLogger("ncap.admin")
GRANTS = web.AppKey("grants", Grants)
ADMIN_STORE = web.AppKey("admin_store", AdminStore)
_ADMIN_CONFIG = web.AppKey("admin_config", Config)
_ACTOR = re.compile(r"^[\w.@+:/ -]{1,128}$")
_ID = re.compile(ID_PATTERN)
_LABEL = re.compile(LABEL_PATTERN)
_KEY_ID = re.compile(r"^sha256:[0-9a-f]{12}$")
_MAX_BODY = 64 * 1024
_encode = msgspec.json.Encoder().encode


class GrantsSync:
    """Keeps ``grants`` equal to the config merged with the admin store's whole state.

    ``reload`` reads the store and swaps the snapshot; it runs at start-up, after each
    change made here, and — when other processes share the store (``every_s`` given) —
    every ``every_s`` in the background, which is how a change made through another
    gateway reaches this one. Reloads are serialized, so a read that began before a
    change committed can never be applied after the read that follows it. A failed
    background reload keeps the snapshot in force (logged once per outage): a gateway
    on a ledger it cannot reach refuses metered requests anyway.
    """

    def __init__(self, store: AdminStore, grants: Grants, every_s: float | None = None) -> None:
        self.store = store
        self.grants = grants
        self.every_s = every_s
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    async def reload(self) -> None:
        async with self._lock:
            self.grants.apply(await self.store.changes())

    async def start(self) -> None:
        """The first reload (a failure fails the start-up), then the periodic one."""
        await self.reload()
        if self.every_s is not None:
            self._task = asyncio.create_task(self._run(self.every_s))

    async def _run(self, every_s: float) -> None:
        failing = False
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.reload()
            except Exception as exc:  # the loop must outlive an outage of the store
                if not failing:
                    log.warning(
                        "admin changes cannot be re-read (%s); keeping the ones in force",
                        type(exc).__name__,
                    )
                failing = True
            else:
                if failing:
                    log.info("admin changes are re-read again")
                failing = False

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


GRANTS_SYNC = web.AppKey("grants_sync", GrantsSync)


def add_admin_routes(
    app: web.Application,
    config: Config,
    *,
    guard: Callable[[Handler], Handler],
) -> None:
    """Every route of ``ADMIN_ROUTES`` (the table ``/openapi.json`` describes too);
    ``guard`` wraps each handler (the app's error envelope)."""
    app[_ADMIN_CONFIG] = config
    for route in ADMIN_ROUTES:
        app.router.add_route(route.method.upper(), route.path, guard(route.handler))


@dataclass(frozen=True, slots=True)
class _Actor:
    """Who makes an admin change: the credential, and the name the request claimed."""

    credential: str
    claimed: str | None

    def change(
        self,
        action: Action,
        kind: Kind,
        target: str,
        entry: ExceptionGrant | KeyEntry | None = None,
    ) -> AdminChange:
        return AdminChange(self.credential, action, kind, target, entry, claimed_by=self.claimed)


def _admin(request: web.Request) -> _Actor:
    """The actor of an admin request; 401/403/429 unless it carries the admin key."""
    refused = admin_refusal(request, cookie=False)
    if refused is not None:
        if refused.status == 429:
            raise RateLimitExceeded(refused.message, retry_after=refused.retry_after)
        raise (InvalidApiKey if refused.status == 401 else Forbidden)(refused.message)
    claimed = request.headers.get("X-Ncap-Actor")
    if claimed is not None and not _ACTOR.match(claimed.strip()):
        raise InvalidValue(
            "X-Ncap-Actor must be 1-128 letters, digits or . @ + : / - _ and spaces.",
            param="X-Ncap-Actor",
        )
    admin_key = request.app[DASHBOARD].admin_key
    assert admin_key is not None  # admin_refusal refuses without one
    return _Actor(admin_actor(admin_key), claimed.strip() if claimed is not None else None)


def admin_actor(admin_key: str) -> str:
    """The audit's name for the admin key: a fingerprint, never the key."""
    return "admin-key:" + hashlib.sha256(admin_key.encode()).hexdigest()[:12]


def _path_id(request: web.Request, *patterns: re.Pattern[str]) -> str:
    """The ``{id}`` of the path, if it is shaped like an id; else 400 (not echoed)."""
    value = request.match_info["id"]
    if not any(p.fullmatch(value) for p in patterns):
        raise InvalidValue("That is not an id this API ever gives out.", param="id")
    return value


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=_encode(data),
        status=status,
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


async def _body(request: web.Request) -> dict[str, Any]:
    async with body_deadline(request.app[_ADMIN_CONFIG].limits.body_timeout_s):
        raw = await read_limited(request, _MAX_BODY)
    if raw is None:
        raise InvalidValue("The request body is too large.")
    try:
        body = msgspec.json.decode(raw) if raw else None
    except msgspec.DecodeError:
        raise InvalidJSON("The body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise InvalidType("The body must be a JSON object.")
    return body


def _validated(model: type[pydantic.BaseModel], body: dict[str, Any]) -> Any:
    """The body as ``model``; the first problem as an OpenAI-shaped 400 naming it."""
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        kind = first["type"]
        if kind == "missing":
            raise MissingParameter(f"Missing required parameter: '{param}'.", param=param) from None
        if kind == "extra_forbidden":
            message = f"Unknown parameter: '{param}'."
            raise InvalidValue(message, param=param, code="unknown_parameter") from None
        raise InvalidValue(f"Invalid value for '{param}': {first['msg']}.", param=param) from None


async def _record(request: web.Request, change: AdminChange) -> None:
    """Write the change and its audit row, then swap the snapshot the policy reads."""
    store = request.app[ADMIN_STORE]
    try:
        await store.record(change, datetime.now(UTC))
    except DuplicateGrant:
        raise InvalidValue(
            f"The id {change.target!r} was already used; ids are not reused.", param="id"
        ) from None
    await request.app[GRANTS_SYNC].reload()


# -- exceptions ---------------------------------------------------------------------------


def _exception_view(grant: ExceptionGrant, config: Config, now: datetime) -> dict[str, Any]:
    source = "config" if any(e.id == grant.id for e in config.exceptions) else "admin"
    status = "expired" if grant.expires <= now else "active"
    return {**grant.model_dump(mode="json"), "source": source, "status": status}


async def list_exceptions(request: web.Request) -> web.Response:
    _admin(request)
    config, now = request.app[_ADMIN_CONFIG], datetime.now(UTC)
    data = [_exception_view(e, config, now) for e in request.app[GRANTS].exceptions]
    return _json({"object": "list", "data": data})


async def create_exception(request: web.Request) -> web.Response:
    actor = _admin(request)
    grant: ExceptionGrant = _validated(ExceptionGrant, await _body(request))
    config = request.app[_ADMIN_CONFIG]
    now = datetime.now(UTC)
    _check_exception(grant, config, request.app[GRANTS], now)
    await _record(request, actor.change("create", "exception", grant.id, grant))
    return _json(_exception_view(grant, config, now), status=201)


def _check_exception(grant: ExceptionGrant, config: Config, grants: Grants, now: datetime) -> None:
    if grant.expires <= now:  # it would never apply, and its id could never be used again
        raise InvalidValue(
            f"expires ({grant.expires.isoformat()}) is in the past: the exception would "
            "never apply.",
            param="expires",
        )
    if grant.workload not in config.workloads:
        raise InvalidValue(f"No workload {grant.workload!r} in the config.", param="workload")
    cap = config.limits.max_candidates_absolute
    if grant.max_candidates > cap:
        raise InvalidValue(
            f"max_candidates is above the global cap ({cap}, limits.max_candidates_absolute).",
            param="max_candidates",
        )
    if grants.exception(grant.id) is not None:
        raise InvalidValue(f"An exception {grant.id!r} exists.", param="id")


async def revoke_exception(request: web.Request) -> web.Response:
    actor = _admin(request)
    eid = _path_id(request, _ID)
    grant = request.app[GRANTS].exception(eid)
    if grant is None:
        raise NotFound(f"No active exception {eid!r}.", param="id")
    await _record(request, actor.change("revoke", "exception", eid))
    return _json({"id": eid, "object": "exception", "revoked": True})


# -- keys -----------------------------------------------------------------------------------


class NewKey(pydantic.BaseModel):
    """The body of ``POST /admin/keys``."""

    model_config = pydantic.ConfigDict(extra="forbid")
    workload: str = pydantic.Field(max_length=128)
    environment: str = pydantic.Field("production", pattern=ID_PATTERN)
    label: str | None = pydantic.Field(None, pattern=LABEL_PATTERN)


def _key_view(entry: KeyEntry, config: Config) -> dict[str, Any]:
    source = "config" if any(k.hash == entry.hash for k in config.keys) else "admin"
    return {
        "id": key_id(entry),
        "label": entry.label,
        "workload": entry.workload,
        "environment": entry.environment,
        "created": entry.created.isoformat() if entry.created else None,
        "source": source,
    }


async def list_keys(request: web.Request) -> web.Response:
    _admin(request)
    config = request.app[_ADMIN_CONFIG]
    data = [_key_view(k, config) for k in request.app[GRANTS].keys]
    return _json({"object": "list", "data": data})


async def create_key(request: web.Request) -> web.Response:
    actor = _admin(request)
    new: NewKey = _validated(NewKey, await _body(request))
    config, grants = request.app[_ADMIN_CONFIG], request.app[GRANTS]
    if new.workload not in config.workloads:
        raise InvalidValue(f"No workload {new.workload!r} in the config.", param="workload")
    if new.label is not None and any(k.label == new.label for k in grants.keys):
        raise InvalidValue(f"A key labelled {new.label!r} exists.", param="label")
    key = "ncap-" + secrets.token_urlsafe(32)
    entry = KeyEntry(
        hash=hash_key(key),
        workload=new.workload,
        environment=new.environment,
        label=new.label,
        created=datetime.now(UTC).replace(microsecond=0),
    )
    await _record(request, actor.change("create", "key", key_id(entry), entry))
    return _json({**_key_view(entry, config), "key": key}, status=201)


async def revoke_key(request: web.Request) -> web.Response:
    actor = _admin(request)
    wanted = _path_id(request, _KEY_ID, _LABEL)
    entry = request.app[GRANTS].key(wanted)
    if entry is None:
        raise NotFound(f"No active key {wanted!r} (give its id or label).", param="id")
    await _record(request, actor.change("revoke", "key", key_id(entry)))
    return _json({"id": key_id(entry), "object": "key", "revoked": True})


async def audit(request: web.Request) -> web.Response:
    _admin(request)
    entries = await request.app[ADMIN_STORE].audit()
    data = [
        {
            "seq": e.seq,
            "at": e.at.isoformat(),
            "actor": e.actor,
            "action": e.action,
            "kind": e.kind,
            "target": e.target,
            "detail": e.detail,
        }
        for e in entries
    ]
    return _json({"object": "list", "data": data})


# -- the routes -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdminRoute:
    """One admin endpoint: registered by ``add_admin_routes`` and described in
    ``/openapi.json`` from this same entry, so the two cannot drift apart."""

    method: str
    path: str
    handler: Callable[[web.Request], Awaitable[web.Response]]
    summary: str
    body: type[pydantic.BaseModel] | None = None
    created: bool = False  # answers 201 (a new object) rather than 200


ADMIN_ROUTES: tuple[AdminRoute, ...] = (
    AdminRoute("get", "/admin/exceptions", list_exceptions, "List candidate-count exceptions."),
    AdminRoute(
        "post",
        "/admin/exceptions",
        create_exception,
        "Create an exception (owner, budget, expiry); audited.",
        body=ExceptionGrant,
        created=True,
    ),
    AdminRoute(
        "delete", "/admin/exceptions/{id}", revoke_exception, "Revoke an exception; audited."
    ),
    AdminRoute("get", "/admin/keys", list_keys, "List API keys (ids and labels, never keys)."),
    AdminRoute(
        "post",
        "/admin/keys",
        create_key,
        "Create an API key for a workload (shown once); audited.",
        body=NewKey,
        created=True,
    ),
    AdminRoute("delete", "/admin/keys/{id}", revoke_key, "Revoke a key (by id or label); audited."),
    AdminRoute("get", "/admin/audit", audit, "The audit log of admin changes."),
)
