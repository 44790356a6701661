"""The security review (docs/reliability.md), one test (or more) per point.

Endpoints live in ``ENDPOINTS`` below: the legacy ``/v1/completions`` and the admin API
join every check here with one line each once they exist.
"""

from __future__ import annotations

import json
import logging
import secrets
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from ncap.auth import hash_key
from ncap.http import app as app_module
from ncap.testing.fake_upstream import FakeState
from tests.hardening.conftest import (
    ADMIN_KEY,
    CLIENT_KEY,
    FAULTS,
    MODEL,
    fault_alias,
    hardened_config,
)
from tests.support import UPSTREAM_KEY, ServerThread, gateway, gateway_config

CANARY = "CANARY7f3q"
MSG = [{"role": "user", "content": "hi"}]
# (method, path, needs a client key, body) — one line per endpoint
ENDPOINTS: list[tuple[str, str, bool, dict[str, Any] | None]] = [
    ("POST", "/v1/chat/completions", True, {"model": MODEL, "messages": MSG}),
    ("GET", "/v1/models", True, None),
    ("POST", "/v1/completions", True, {"model": MODEL, "prompt": "hi"}),
]
ADMIN_ENDPOINTS = [
    "/dashboard",
    "/dashboard/report.json",
    "/admin/exceptions",
    "/admin/keys",
    "/admin/audit",
]


def _auth(key: str = CLIENT_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _gateway_log(caplog: pytest.LogCaptureFixture) -> str:
    """What the gateway's own loggers wrote (not the test client's httpx debug lines)."""
    records = [r for r in caplog.records if r.name.startswith(("ncap", "aiohttp"))]
    return "\n".join(logging.Formatter().format(r) for r in records)


def _ledger_bytes(server: ServerThread) -> bytes:
    assert server.app is not None
    url = server.app[app_module.CONFIG].stores.ledger
    path = Path(url.removeprefix("sqlite:///"))
    out = b""
    for p in path.parent.glob(path.name + "*"):  # the database, its WAL and SHM
        out += p.read_bytes()
    return out


# --- client keys: hashed at rest, compared in constant time ---


def test_keys_are_stored_as_hashes_only(hgw: ServerThread) -> None:
    assert hgw.app is not None
    config = hgw.app[app_module.CONFIG]
    dumped = config.model_dump_json()
    assert CLIENT_KEY not in dumped
    assert [k.hash for k in config.keys] == [hash_key(CLIENT_KEY)]
    # the stored hash is not itself a credential
    r = httpx.get(hgw.url + "/v1/models", headers=_auth(hash_key(CLIENT_KEY)), timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_key_check_compares_digests_with_compare_digest(
    hgw: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every configured entry is compared with ``secrets.compare_digest`` on the SHA-256
    digest (never ``==`` on the key): the work does not depend on how many leading
    characters of a guess are right. (A dict keyed by digest would also be safe, since
    an attacker cannot choose a digest's prefix; the loop is kept for its simplicity at
    the small key counts of a config file.)"""
    calls: list[tuple[str, str]] = []
    real = secrets.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.secrets, "compare_digest", spy)
    r = httpx.get(hgw.url + "/v1/models", headers=_auth("sk-wrong"), timeout=10)
    assert r.status_code == 401
    assert calls == [(hash_key(CLIENT_KEY), hash_key("sk-wrong"))]


@pytest.mark.parametrize(("method", "path", "needs_key", "body"), ENDPOINTS)
def test_client_endpoints_need_a_key(
    hgw: ServerThread, method: str, path: str, needs_key: bool, body: dict[str, Any] | None
) -> None:
    for headers in ({}, _auth("sk-wrong"), {"Authorization": "Basic " + CLIENT_KEY}):
        r = httpx.request(method, hgw.url + path, json=body, headers=headers, timeout=10)
        assert r.status_code == 401, (headers, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# --- admin endpoints and the dashboard need the admin key ---


@pytest.mark.parametrize("path", ADMIN_ENDPOINTS)
def test_admin_endpoints_need_the_admin_key(hgw: ServerThread, path: str) -> None:
    for headers in ({}, _auth(CLIENT_KEY), _auth("sk-wrong")):
        r = httpx.get(hgw.url + path, headers=headers, timeout=10)
        assert r.status_code in (401, 403), (path, headers, r.status_code)
    r = httpx.get(hgw.url + path, headers=_auth(ADMIN_KEY), timeout=30)
    assert r.status_code == 200, r.text[:300]


def test_dashboard_escapes_operator_and_store_values(
    fake: tuple[str, FakeState], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names reach the page from the config and the ledger; markup in them is shown as
    text. (User-sent values never reach the ledger, see the canary tests.)"""
    evil_alias = '<img src=x onerror="alert(1)">'
    evil_workload = "<script>alert(2)</script>"
    monkeypatch.setenv("NCAP_ADMIN_KEY", ADMIN_KEY)
    config = gateway_config(
        fake[0],
        tmp_path,
        models={evil_alias: ["fake"]},
        workloads={evil_workload: {"max_candidates": 4, "output_ceiling": 256}},
        keys=[{"hash": hash_key(CLIENT_KEY), "workload": evil_workload}],
    )
    with gateway(config) as gw:
        body = {"model": evil_alias, "messages": MSG}
        assert (
            httpx.post(
                gw.url + "/v1/chat/completions", json=body, headers=_auth(), timeout=10
            ).status_code
            == 200
        )
        time.sleep(0.3)  # the settlement runs beside the answer
        page = httpx.get(gw.url + "/dashboard", headers=_auth(ADMIN_KEY), timeout=30)
    assert page.status_code == 200
    assert "<script>alert(2)</script>" not in page.text
    assert 'onerror="alert(1)"' not in page.text
    assert "&lt;script&gt;" in page.text or "\\u003cscript" in page.text


# --- headers never go upstream; the upstream key never comes back ---


def test_client_headers_never_go_upstream(hgw: ServerThread, fake: tuple[str, FakeState]) -> None:
    state = fake[1]
    headers = {
        **_auth(),
        "X-Canary": CANARY,
        "Cookie": f"session={CANARY}",
        "OpenAI-Organization": CANARY,
        "X-Forwarded-For": CANARY,
    }
    body = {"model": MODEL, "messages": MSG}
    r = httpx.post(hgw.url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
    assert r.status_code == 200
    seen = state.last_headers
    assert seen is not None
    assert seen.get("Authorization") == f"Bearer {UPSTREAM_KEY}"
    assert CLIENT_KEY not in json.dumps(dict(seen))
    assert CANARY not in json.dumps(dict(seen))


def test_upstream_key_never_reaches_client_log_metric_or_ledger(
    hgw: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    answers: list[httpx.Response] = []
    with httpx.Client(base_url=hgw.url, timeout=10) as client:
        for alias in (MODEL, *(fault_alias(f) for f in FAULTS)):
            for stream in (False, True):
                body = {"model": alias, "messages": MSG, "stream": stream}
                answers.append(client.post("/v1/chat/completions", json=body, headers=_auth()))
        answers.append(client.get("/v1/models", headers=_auth()))
        answers.append(client.get("/metrics"))
        answers.append(client.get("/readyz"))
        answers.append(client.get("/dashboard/report.json", headers=_auth(ADMIN_KEY)))
    time.sleep(0.3)
    for answer in answers:
        assert UPSTREAM_KEY not in answer.text
        assert UPSTREAM_KEY not in json.dumps(dict(answer.headers))
    assert UPSTREAM_KEY not in _gateway_log(caplog)
    assert UPSTREAM_KEY.encode() not in _ledger_bytes(hgw)


# --- no user-controlled URL reaches an outbound request ---


def test_no_user_controlled_url_is_dialled(hgw: ServerThread, fake: tuple[str, FakeState]) -> None:
    """A listener stands for an attacker's host; its URL goes in every place a user
    controls. Nothing may connect to it."""
    hits: list[str] = []

    async def record(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(text="{}")

    def evil_app() -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", record)
        return app

    evil = ServerThread(evil_app).start()
    try:
        url = evil.url + "/v1"
        bodies: list[dict[str, Any]] = [
            {"model": url, "messages": MSG},
            {"model": MODEL, "messages": MSG, "base_url": url, "api_base": url},
            {"model": MODEL, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url + "/x.png"}}]}]},
            {"model": MODEL, "messages": MSG, "metadata": {"callback": url}},
        ]  # fmt: skip
        headers = {**_auth(), "X-Forwarded-Host": evil.url[7:], "X-Base-Url": url}
        for body in bodies:
            r = httpx.post(hgw.url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
            assert r.status_code < 500
        time.sleep(0.3)
        assert hits == []
    finally:
        evil.stop()


# --- limits: body, header, message count, n, nesting, stream duration ---


def _post(gw: ServerThread, content: bytes, **headers: str) -> httpx.Response:
    h = {**_auth(), "content-type": "application/json", **headers}
    return httpx.post(gw.url + "/v1/chat/completions", content=content, headers=h, timeout=30)


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text[:300]
    error: dict[str, Any] = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_body_size_limit(hgw: ServerThread) -> None:
    assert hgw.app is not None
    limit = hgw.app[app_module.CONFIG].limits.max_body_bytes
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * limit}]})
    assert _error(_post(hgw, big.encode()), 413)["code"] == "request_too_large"


def test_header_size_and_count_limits(hgw: ServerThread) -> None:
    body = json.dumps({"model": MODEL, "messages": MSG}).encode()
    assert _post(hgw, body, **{"X-Big": "a" * 9000}).status_code == 400
    many = {f"X-H{i}": "v" for i in range(120)}
    assert _post(hgw, body, **many).status_code == 400


def test_message_count_limit(hgw: ServerThread) -> None:
    assert hgw.app is not None
    limit = hgw.app[app_module.CONFIG].limits.max_messages
    body = json.dumps({"model": MODEL, "messages": MSG * (limit + 1)}).encode()
    error = _error(_post(hgw, body), 400)
    assert error["param"] == "messages" and str(limit) in error["message"]
    ok = json.dumps({"model": MODEL, "messages": MSG * 3}).encode()
    assert _post(hgw, ok).status_code == 200


def test_n_limit(hgw: ServerThread) -> None:
    for n, status in ((4, 200), (5, 400), (129, 400), (0, 400)):
        r = _post(
            hgw, json.dumps({"model": MODEL, "messages": MSG, "n": n, "temperature": 1}).encode()
        )
        assert r.status_code == status, (n, r.text)


def test_nesting_depth_limit(hgw: ServerThread) -> None:
    deep: Any = {}
    for _ in range(200):
        deep = {"a": deep}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    r = _post(hgw, json.dumps({"model": MODEL, "messages": MSG, "tools": [tool]}).encode())
    assert "nested" in _error(r, 400)["message"]
    r = _post(hgw, b"[" * 100_000 + b"]" * 100_000)
    assert _error(r, 400)["code"] == "invalid_json"


def test_stream_duration_limit(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    """A stream slower than ``limits.max_stream_s`` ends with one error event; its
    attempt is still settled (a row, nothing left reserved)."""
    config = gateway_config(
        fake[0],
        tmp_path,
        limits={"max_stream_s": 1.0},
        routes={"fake": {"headers": {"x-fake-fault": "slow_chunks=300"}, "timeout_s": 30}},
    )
    with gateway(config) as gw:
        body = {"model": MODEL, "messages": MSG, "stream": True, "max_tokens": 200}
        started = time.monotonic()
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)
        took = time.monotonic() - started
        time.sleep(0.5)
        ledger = gw.app[app_module.CONFIG].stores.ledger.removeprefix("sqlite:///")  # type: ignore[index]
    assert r.status_code == 200
    assert '"stream_timeout"' in r.text
    assert took < 10
    with sqlite3.connect(ledger) as db:
        statuses = [row[0] for row in db.execute("SELECT state FROM ledger_events")]
    assert statuses and "reserved" not in statuses, statuses


# --- nothing a user sent reaches the logs or the ledger ---


def _canary_bodies() -> Iterator[tuple[str, bytes]]:
    c = CANARY
    yield "every field", json.dumps({
        "model": MODEL, "user": c, "metadata": {c: c}, "stop": [c], "seed": 1,
        "messages": [{"role": "system", "content": c, "name": c},
                     {"role": "user", "content": [{"type": "text", "text": c}]},
                     {"role": "assistant", "content": c, "tool_calls": [
                         {"id": c, "type": "function", "function": {"name": c, "arguments": c}}]},
                     {"role": "tool", "content": c, "tool_call_id": c}],
        "tools": [{"type": "function", "function": {"name": "f" + c, "description": c,
                                                    "parameters": {"type": "object", "title": c}}}],
        "prompt_cache_key": c, "safety_identifier": c[:60],
    }).encode()  # fmt: skip
    yield (
        "bad model",
        json.dumps({"model": c, "messages": [{"role": "user", "content": c}]}).encode(),
    )
    yield "unknown field", json.dumps({"model": MODEL, "messages": MSG, c: c}).encode()
    yield (
        "multi-candidate field",
        json.dumps({"model": MODEL, "messages": MSG, "best_of": c}).encode(),
    )
    yield (
        "bad type",
        json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": 5}], "user": c}
        ).encode(),
    )
    yield "bad json", b'{"model": "' + c.encode() + b'", '
    yield (
        "n over policy",
        json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": c}], "n": 9, "temperature": 1}
        ).encode(),
    )
    yield (
        "greedy n",
        json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": c}], "n": 2, "temperature": 0}
        ).encode(),
    )


def test_canary_never_reaches_logs_metrics_or_ledger(
    hgw: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    statuses = []
    with httpx.Client(base_url=hgw.url, timeout=10) as client:
        for _, raw in _canary_bodies():
            for stream in (False, True):
                content = raw.replace(b'"seed": 1', b'"seed": 1, "stream": true') if stream else raw
                for alias in (MODEL, *(fault_alias(f) for f in FAULTS)):
                    sent = content.replace(
                        f'"model": "{MODEL}"'.encode(), f'"model": "{alias}"'.encode()
                    )
                    headers = {**_auth(), "content-type": "application/json", "X-Canary": CANARY,
                               "User-Agent": CANARY}  # fmt: skip
                    statuses.append(
                        client.post(
                            "/v1/chat/completions", content=sent, headers=headers
                        ).status_code
                    )
        for method, path, _, body in ENDPOINTS:
            client.request(
                method, path + "?q=" + CANARY, json=body, headers={**_auth(), "X-Canary": CANARY}
            )
            client.request(method, path, headers={"Authorization": "Bearer " + CANARY})
        client.get("/dashboard?x=" + CANARY, headers=_auth(CANARY))
        metrics_text = client.get("/metrics").text
    time.sleep(0.5)  # settlements beside the answers
    assert 200 in statuses and any(s >= 400 for s in statuses)
    assert CANARY not in _gateway_log(caplog)
    assert _gateway_log(caplog)  # the error paths did log (so the check looked at something)
    assert CANARY not in metrics_text
    assert CANARY.encode() not in _ledger_bytes(hgw)


def test_hardened_config_is_the_fixture_config(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    """Guard: the suites above run with a client key (auth is not bypassed)."""
    config = hardened_config(fake[0], tmp_path)
    assert config.keys  # type: ignore[attr-defined]
