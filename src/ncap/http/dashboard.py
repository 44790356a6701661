"""``/dashboard``: the audit report as charts and tables, for the admin key only.

Who may see it: whoever presents the admin key, the value of the environment variable
``server.admin_key_env`` names. A script sends it as ``Authorization: Bearer <key>``;
a browser posts it once to the sign-in form and gets a session cookie
(``HttpOnly; SameSite=Strict; Path=/dashboard``, ``Secure`` as ``server.secure_cookies``
says) holding when it was issued, an expiry and an HMAC of both keyed by the admin key,
so the key itself is never in a URL or a cookie and changing the key signs every
browser out. Signing out ends every session issued before it, on every gateway of the
ledger: the sign-out is an audit row of the admin store (kind ``session``), whose
instant every gateway reads back with the admin changes (``Grants.sessions_ended_at``).
Any other key (a workload's API key included) is refused with 403. Without an admin
key set the dashboard is off (403 saying so); an admin key shorter than
``MIN_ADMIN_KEY_LENGTH`` refuses the start.

Failed attempts (a wrong admin key on any admin route or the sign-in form, a forged or
ended session) are counted per client address (``AuthThrottle``): past
``server.admin_auth_failures_per_minute``, every admin attempt from that address is
refused with 429 and ``Retry-After`` before any key is compared.

What it shows: ``build_report`` over the configured ledger for the chosen window
(default the last 24 hours against the 24 before) and its time views
(``reports.timeline``: series per workload, what changed, budgets, pending by route),
rendered by the same template as ``ncap audit --format html``: server-side SVG,
inline CSS, no script, nothing fetched (a Content-Security-Policy of
``default-src 'none'`` makes sure), every value escaped. The report is built in a
worker thread and kept for ``CACHE_S`` seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import os
import secrets
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from aiohttp import web
from aiohttp.typedefs import Handler
from jinja2 import Environment, select_autoescape

from ncap.config import Config, parse_duration, utcnow
from ncap.domain.grants import Grants
from ncap.errors import ConfigError
from ncap.http.limits import body_deadline
from ncap.reports import (
    Report,
    build_report,
    render_html,
    report_dict,
    since_window,
)
from ncap.reports.admin_tables import revoked_exceptions, with_admin_exceptions
from ncap.reports.timeline import Timeline, build_timeline, timeline_dict
from ncap.stores import LedgerSource, Stores

__all__ = [
    "DASHBOARD_PATH",
    "MIN_ADMIN_KEY_LENGTH",
    "AuthThrottle",
    "Refused",
    "Sessions",
    "add_dashboard_routes",
    "admin_refusal",
]

log = logging.getLogger("ncap.dashboard")
DASHBOARD_PATH = "/dashboard"
_STORES = web.AppKey("dashboard_stores", Stores)
COOKIE = "ncap_dashboard"
SESSION_S = 12 * 3600
# an admin key is typed by an operator, not drawn by ncap: 20 characters at least
# (``secrets.token_urlsafe(32)`` gives 43)
MIN_ADMIN_KEY_LENGTH = 20
CACHE_S = 30.0
CHOICES = ("1h", "24h", "7d", "30d")
DEFAULT_SINCE = "24h"
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_LOGIN = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>ncap dashboard · sign in</title><style>body{font:15px system-ui,sans-serif;
margin:10vh auto;max-width:420px;color:#1d2530}input{width:100%;padding:6px;margin:8px 0}
.msg{background:#fde2e1;padding:6px 8px;border-radius:4px}</style></head><body>
<h1>ncap dashboard</h1>{% if message %}<p class="msg" id="message">{{ message }}</p>{% endif %}
{% if enabled %}<form method="post" action="{{ action }}"><label>admin key
<input type="password" name="key" autocomplete="current-password" autofocus></label>
<button type="submit">sign in</button></form>{% endif %}</body></html>"""


class Refused(NamedTuple):
    """Why an admin request is refused: 401 (no key), 403 (a wrong one, or no admin key
    configured) or 429 (too many failures from its address; ``retry_after`` s)."""

    status: int
    message: str
    retry_after: float | None = None


class AuthThrottle:
    """Failed admin authentications per client address: a bucket of ``per_minute``
    failures, refilled at that rate. Only failures take from it; an empty bucket
    refuses every attempt from the address (a right key too, so guessing on cannot
    tell success). At most ``max_addresses`` are tracked (the oldest dropped)."""

    def __init__(
        self,
        per_minute: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_addresses: int = 10_000,
    ) -> None:
        self._burst = float(per_minute)
        self._rate = per_minute / 60.0
        self._clock = clock
        self._max = max_addresses
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, at)

    def _tokens(self, address: str, now: float) -> float:
        tokens, at = self._buckets.get(address, (self._burst, now))
        return min(self._burst, tokens + (now - at) * self._rate)

    def retry_after(self, address: str) -> float | None:
        """Seconds until ``address`` may try again; None when it may now."""
        tokens = self._tokens(address, self._clock())
        return None if tokens >= 1 else (1 - tokens) / self._rate

    def failed(self, address: str) -> None:
        now = self._clock()
        tokens = max(0.0, self._tokens(address, now) - 1)
        self._buckets.pop(address, None)
        if len(self._buckets) >= self._max:
            self._buckets.pop(next(iter(self._buckets)))
        self._buckets[address] = (tokens, now)


@dataclass(slots=True)
class Sessions:
    """Where sessions end: ``grants.sessions_ended_at`` (every gateway's latest
    sign-out), and ``end`` to record a sign-out at an instant (the composition root
    writes it to the admin store and reloads the grants)."""

    grants: Grants
    end: Callable[[datetime], Awaitable[None]]


@dataclass(slots=True)
class _Dashboard:
    """Per-app state: the admin key (read once at start-up), sessions, the throttle of
    failed attempts and the report cache."""

    config: Config
    admin_key: str | None
    open_source: Callable[[], LedgerSource]  # a read-only source on the ledger, per report
    sessions: Sessions | None = None
    throttle: AuthThrottle = field(default_factory=lambda: AuthThrottle(10))
    cache: dict[str, tuple[float, Views]] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    login: Any = None

    def session_value(self, issued_ms: int, expires: int) -> str:
        assert self.admin_key is not None
        mac = hmac.new(
            self.admin_key.encode(),
            f"ncap-dashboard:{issued_ms}:{expires}".encode(),
            hashlib.sha256,
        ).hexdigest()
        return f"{issued_ms}.{expires}.{mac}"

    def ended_ms(self) -> int:
        ended = self.sessions.grants.sessions_ended_at if self.sessions else None
        return int(ended.timestamp() * 1000) if ended is not None else 0

    def valid_session(self, cookie: str | None) -> bool:
        if not cookie or self.admin_key is None:
            return False
        issued, _, rest = cookie.partition(".")
        expires, _, _ = rest.partition(".")
        if not (issued.isdigit() and expires.isdigit()) or int(expires) < time.time():
            return False
        if int(issued) <= self.ended_ms():
            return False  # signed out since (on any gateway)
        return secrets.compare_digest(cookie, self.session_value(int(issued), int(expires)))

    def is_admin_key(self, key: str) -> bool:
        return self.admin_key is not None and secrets.compare_digest(
            key.encode(), self.admin_key.encode()
        )


DASHBOARD = web.AppKey("dashboard", _Dashboard)


@dataclass(frozen=True, slots=True)
class Views:
    """What one build gives the page: the report and its time views."""

    report: Report
    timeline: Timeline


def admin_key_from_env(config: Config) -> str | None:
    """The admin key, read once; ``ConfigError`` for one too short to be a secret."""
    env = config.server.admin_key_env
    key = os.environ.get(env) or None
    if key is not None and len(key) < MIN_ADMIN_KEY_LENGTH:
        raise ConfigError(
            f"the admin key in {env} has {len(key)} characters; at least "
            f"{MIN_ADMIN_KEY_LENGTH} are required (e.g. the output of "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return key


def add_dashboard_routes(
    app: web.Application,
    config: Config,
    stores: Stores,
    sessions: Sessions | None = None,
    *,
    guard: Callable[[Handler], Handler],
) -> None:
    """Register ``/dashboard`` (page, sign-in, sign-out, JSON) on ``app``, reading the
    ledger of ``stores``; ``guard`` wraps each handler (the app's error envelope)."""
    key = admin_key_from_env(config)
    env = Environment(autoescape=select_autoescape(default=True, default_for_string=True))
    throttle = AuthThrottle(config.server.admin_auth_failures_per_minute)
    app[DASHBOARD] = _Dashboard(
        config,
        key,
        stores.report_source,
        sessions=sessions,
        throttle=throttle,
        login=env.from_string(_LOGIN),
    )
    app[_STORES] = stores
    app.router.add_get(DASHBOARD_PATH, guard(page))
    app.router.add_post(f"{DASHBOARD_PATH}/login", guard(login))
    app.router.add_post(f"{DASHBOARD_PATH}/logout", guard(logout))
    app.router.add_get(f"{DASHBOARD_PATH}/report.json", guard(report_json))
    app.on_startup.append(_index_ledger)  # after the stores opened (cleanup_ctx runs first)


async def _index_ledger(app: web.Application) -> None:
    """Give the ledger the report's optional indexes (a SQLite file's partial indexes,
    ``stores/sqlite/report_indexes.py``); without them the report still works, by
    scanning, so a failure is only logged."""
    try:
        await app[_STORES].index_for_reports()
    except (ConfigError, sqlite3.Error) as exc:
        log.warning("report index not created on the ledger: %s", type(exc).__name__)


def _html(body: str, status: int = 200) -> web.Response:
    return web.Response(
        text=body, status=status, content_type="text/html", charset="utf-8", headers=_HEADERS
    )


def _login_page(state: _Dashboard, refused: Refused) -> web.Response:
    body = state.login.render(
        message=refused.message,
        enabled=state.admin_key is not None,
        action=f"{DASHBOARD_PATH}/login",
    )
    response = _html(body, refused.status)
    if refused.retry_after is not None:
        response.headers["Retry-After"] = str(math.ceil(refused.retry_after))
    return response


def _refusal(request: web.Request) -> Refused | None:
    return admin_refusal(request, cookie=True)


def _address(request: web.Request) -> str:
    return request.remote or "unknown"


def _throttled(state: _Dashboard, address: str) -> Refused | None:
    wait = state.throttle.retry_after(address)
    if wait is None:
        return None
    return Refused(
        429,
        f"Too many failed admin attempts from this address; retry in {math.ceil(wait)} s.",
        wait,
    )


def admin_refusal(request: web.Request, *, cookie: bool) -> Refused | None:
    """None when the request carries the admin key (header, or with ``cookie`` the
    dashboard's session cookie); else the status (401 no key, 403 a wrong one or no
    admin key configured, 429 too many failures from the address) and why. The one
    admin check, shared by the admin API."""
    state = request.app[DASHBOARD]
    if state.admin_key is None:
        return Refused(
            403,
            f"The dashboard is off: set the admin key in the environment variable "
            f"{state.config.server.admin_key_env}.",
        )
    address = _address(request)
    throttled = _throttled(state, address)
    if throttled is not None:
        return throttled
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        if state.is_admin_key(key.strip()):
            return None
        state.throttle.failed(address)
        return Refused(403, "That key is not the admin key.")
    session = request.cookies.get(COOKIE) if cookie else None
    if session and state.valid_session(session):
        return None
    if session:
        state.throttle.failed(address)  # forged, expired or signed out
    return Refused(
        401, "Sign in with the admin key." if cookie else "Send the admin key as a Bearer token."
    )


async def page(request: web.Request) -> web.Response:
    state = request.app[DASHBOARD]
    refused = _refusal(request)
    if refused:
        return _login_page(state, refused)
    since = _since(request)
    views = await _report(state, since)
    if isinstance(views, str):
        return _html(f"<!doctype html><title>ncap dashboard</title><p>{_esc(views)}</p>", 503)
    chrome = {
        "path": DASHBOARD_PATH,
        "logout": f"{DASHBOARD_PATH}/logout",
        "choices": CHOICES,
        "since": since,
    }
    return _html(render_html(views.report, dashboard=chrome, timeline=views.timeline))


async def report_json(request: web.Request) -> web.Response:
    refused = _refusal(request)
    if refused:
        code = {401: "invalid_api_key", 429: "rate_limit_exceeded"}.get(refused.status, "forbidden")
        err = {"message": refused.message, "type": "invalid_request_error", "param": None}
        headers = dict(_HEADERS)
        if refused.retry_after is not None:
            headers["Retry-After"] = str(math.ceil(refused.retry_after))
        return web.json_response(
            {"error": {**err, "code": code}}, status=refused.status, headers=headers
        )
    views = await _report(request.app[DASHBOARD], _since(request))
    if isinstance(views, str):
        err = {"message": views, "type": "server_error", "param": None, "code": "ledger"}
        return web.json_response({"error": err}, status=503, headers=_HEADERS)
    data = report_dict(views.report) | {"timeline": timeline_dict(views.timeline)}
    return web.json_response(data, headers=_HEADERS)


async def login(request: web.Request) -> web.Response:
    state = request.app[DASHBOARD]
    if state.admin_key is None:
        return _login_page(state, Refused(403, "The dashboard is off."))
    address = _address(request)
    throttled = _throttled(state, address)
    if throttled is not None:
        return _login_page(state, throttled)
    async with body_deadline(state.config.limits.body_timeout_s):
        form = await request.post()
    key = form.get("key")
    if not isinstance(key, str) or not state.is_admin_key(key.strip()):
        state.throttle.failed(address)
        return _login_page(state, Refused(403, "That key is not the admin key."))
    # issued after the latest sign-out, even within its millisecond
    issued = max(int(time.time() * 1000), state.ended_ms() + 1)
    expires = int(time.time()) + SESSION_S
    response = _see_other()
    secure = state.config.server.secure_cookies
    response.set_cookie(
        COOKIE,
        state.session_value(issued, expires),
        max_age=SESSION_S,
        path=DASHBOARD_PATH,
        httponly=True,
        samesite="Strict",
        secure=request.secure if secure is None else secure,
    )
    return response


async def logout(request: web.Request) -> web.Response:
    """Signing out (with a valid session or the admin key) ends every session issued
    until now, here and on every gateway of the ledger; the cookie is deleted anyway."""
    state = request.app[DASHBOARD]
    if state.sessions is not None and _refusal(request) is None:
        await state.sessions.end(datetime.now(UTC))
    response = _see_other()
    response.del_cookie(COOKIE, path=DASHBOARD_PATH)
    return response


def _see_other() -> web.Response:
    """A plain 303 (an ``HTTPException`` would become JSON in the route guard)."""
    return web.Response(status=303, headers={**_HEADERS, "Location": DASHBOARD_PATH})


def _since(request: web.Request) -> str:
    since = request.query.get("since", DEFAULT_SINCE)
    return since if since in CHOICES else DEFAULT_SINCE


def _esc(text: str) -> str:
    from markupsafe import escape

    return str(escape(text))


async def _report(state: _Dashboard, since: str) -> Views | str:
    """The cached views for ``since``, or a message saying why there are none."""
    async with state.lock:  # one build at a time; a second viewer waits for the first
        hit = state.cache.get(since)
        if hit and time.monotonic() - hit[0] < CACHE_S:
            return hit[1]
        try:
            report = await asyncio.to_thread(
                _build, state.config, parse_duration(since), state.open_source
            )
        except ConfigError as exc:
            return f"The ledger cannot be read: {exc}"
        state.cache[since] = (time.monotonic(), report)
        return report


def _build(config: Config, length: timedelta, open_source: Callable[[], LedgerSource]) -> Views:
    source = open_source()
    window = since_window(length, utcnow())
    try:
        report = build_report(
            source,
            window,
            exceptions=with_admin_exceptions(source, config.exceptions),
            revoked=revoked_exceptions(source),
            pricing={rid: route.pricing for rid, route in config.routes.items()},
            thresholds=config.reports.thresholds,
        )
        return Views(report, build_timeline(source, window, config.workloads))
    finally:
        source.close()
