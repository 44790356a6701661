"""Hostile clients against every inbound surface: guessed and well-known keys, sessions
kept past logout, unauthenticated operational endpoints, another key's idempotency
keys, cross-site requests in keyless mode, forged actors and oversized ids. Each case
is a real gateway on a free port; the clients are the official ``openai`` SDK where it
applies and ``httpx`` for what the SDK cannot send (forms, cookies, raw headers).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from typer.testing import CliRunner

from ncap.auth import hash_key
from ncap.cli.main import app as cli
from ncap.config import parse_config, warnings_for
from ncap.errors import ConfigError
from ncap.http.app import create_app
from ncap.testing.fake_upstream import FakeState
from tests.support import gateway, gateway_config

DOCS = Path(__file__).parents[2] / "docs"


# --- well-known keys ---


def _documented_example() -> dict[str, Any]:
    """The configuration example of docs/configuration.md, as a mapping."""
    text = (DOCS / "configuration.md").read_text()
    section = text.split("## Example: an OpenAI-compatible route", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    raw = yaml.safe_load(block.group(1))
    assert isinstance(raw, dict)
    return raw


@pytest.mark.parametrize("weak", ["", "test", "test2", "password", "changeme", "sk-test"])
def test_the_hash_of_a_well_known_string_is_refused_at_load(weak: str) -> None:
    text = yaml.safe_dump(
        {"keys": [{"hash": hash_key(weak), "workload": "default"}], "workloads": {"default": {}}}
    )
    with pytest.raises(ConfigError) as refused:
        parse_config(text + "models: {}\nroutes: {}\n", source="ncap.yaml")
    (problem,) = refused.value.problems
    assert problem.startswith("ncap.yaml: keys.0.hash (line 2):")
    assert "well-known string" in problem and "ncap keys create" in problem


def test_the_documented_example_lets_no_key_in(tmp_path: Path) -> None:
    """Loaded as written (but with stores of the test's own and bound by the test), the
    example answers no key at all: its hashes are placeholders no key hashes to."""
    raw = _documented_example()
    raw["stores"] = {
        "ledger": f"sqlite:///{tmp_path}/ledger.db",
        "budgets": f"sqlite:///{tmp_path}/budgets.db",
    }
    config = parse_config(yaml.safe_dump(raw))
    assert config.keys  # keys required: nothing keyless either
    with gateway(config) as gw:
        for key in ("test", "test2", "password", "sha256:" + "0" * 64):
            r = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 401, (key, r.text)


# --- the admin key, its sessions and guesses at it ---

ADMIN_ENV = "NCAP_TEST_HOSTILE_ADMIN_KEY"
ADMIN_KEY = "hostile-suite-admin-key-" + "x" * 12
CLIENT_KEY = "sk-ncap-hostile-client-key"


def _admin_config(upstream: str, tmp: Path, **server: Any) -> Any:
    return gateway_config(
        upstream,
        tmp,
        keys=[{"hash": hash_key(CLIENT_KEY), "workload": "default"}],
        server={"admin_key_env": ADMIN_ENV, **server},
    )


@pytest.fixture
def admin_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(ADMIN_ENV, ADMIN_KEY)
    return ADMIN_KEY


@pytest.mark.parametrize("short", ["k", "admin", "nineteen-characters"])
def test_a_short_admin_key_refuses_the_start(
    short: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ADMIN_ENV, short)
    with pytest.raises(ConfigError) as refused:
        create_app(_admin_config("http://127.0.0.1:9/v1", tmp_path))
    assert f"has {len(short)} characters; at least 20" in str(refused.value)


def test_a_short_admin_key_makes_serve_refuse(tmp_path: Path) -> None:
    path = tmp_path / "ncap.yaml"
    config = _admin_config("http://127.0.0.1:9/v1", tmp_path)
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    env = {**os.environ, ADMIN_ENV: "k"}
    out = subprocess.run(
        [sys.executable, "-m", "ncap.cli.main", "serve", "--config", str(path), "--port", "0"],
        env=env,
        capture_output=True,
        timeout=60,
        text=True,
    )
    assert out.returncode == 2, out.stderr
    assert "refusing to start" in out.stderr and "at least 20" in out.stderr


@pytest.mark.parametrize("path", ["/admin/keys", "/dashboard/report.json", "/dashboard/login"])
def test_failed_admin_attempts_are_throttled(
    path: str, fake: tuple[str, FakeState], tmp_path: Path, admin_env: str
) -> None:
    """300 guesses answered in a few seconds once; now the 11th wrong guess within a
    minute gets 429 with Retry-After, and so does the right key from that address."""
    with gateway(_admin_config(fake[0], tmp_path)) as gw:
        statuses = []
        for i in range(15):
            guess = f"guess-number-{i:04d}-of-the-admin-key"
            if path == "/dashboard/login":
                r = httpx.post(gw.url + path, data={"key": guess})
            else:
                r = httpx.get(gw.url + path, headers={"Authorization": f"Bearer {guess}"})
            statuses.append(r.status_code)
        assert statuses == [403] * 10 + [429] * 5
        assert int(r.headers["Retry-After"]) >= 1
        right = httpx.get(gw.url + "/admin/keys", headers={"Authorization": f"Bearer {admin_env}"})
        assert right.status_code == 429
        assert right.json()["error"]["code"] == "rate_limit_exceeded"
        # the client API is not throttled by failed admin attempts
        models = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {CLIENT_KEY}"})
        assert models.status_code == 200


def _sign_in(url: str, key: str) -> str:
    r = httpx.post(url + "/dashboard/login", data={"key": key})
    assert r.status_code == 303, r.text
    return r.cookies["ncap_dashboard"]


def test_signing_out_ends_the_session_on_every_gateway(
    fake: tuple[str, FakeState], tmp_path: Path, admin_env: str
) -> None:
    config = _admin_config(fake[0], tmp_path)
    with gateway(config) as gw:
        old = _sign_in(gw.url, admin_env)
        kept = _sign_in(gw.url, admin_env)  # another browser of the same admin
        cookies = {"ncap_dashboard": old}
        assert httpx.get(gw.url + "/dashboard/report.json", cookies=cookies).status_code == 200
        r = httpx.post(gw.url + "/dashboard/logout", cookies=cookies)
        assert r.status_code == 303
        for cookie in (old, kept):  # a copy of the cookie kept by an attacker, too
            r = httpx.get(gw.url + "/dashboard/report.json", cookies={"ncap_dashboard": cookie})
            assert r.status_code == 401, r.text
        fresh = _sign_in(gw.url, admin_env)
        r = httpx.get(gw.url + "/dashboard/report.json", cookies={"ncap_dashboard": fresh})
        assert r.status_code == 200
    with gateway(config) as again:  # a restart (or a replica on the same ledger)
        stale = httpx.get(again.url + "/dashboard/report.json", cookies={"ncap_dashboard": old})
        assert stale.status_code == 401
        ok = httpx.get(again.url + "/dashboard/report.json", cookies={"ncap_dashboard": fresh})
        assert ok.status_code == 200
    audit = [e for e in _admin_audit(config, admin_env) if e["kind"] == "session"]
    assert [(e["action"], e["actor"]) for e in audit] == [("revoke", "dashboard")]


def _admin_audit(config: Any, key: str) -> list[dict[str, Any]]:
    with gateway(config) as gw:
        r = httpx.get(gw.url + "/admin/audit", headers={"Authorization": f"Bearer {key}"})
    data: list[dict[str, Any]] = r.json()["data"]
    return data


@pytest.mark.parametrize(("setting", "secure"), [(True, True), (False, False), (None, False)])
def test_the_secure_cookie_flag_is_a_config_switch(
    setting: bool | None, secure: bool, fake: tuple[str, FakeState], tmp_path: Path, admin_env: str
) -> None:
    """Behind a TLS-terminating proxy the gateway sees plain HTTP: ``secure_cookies:
    true`` sets ``Secure`` anyway; unset, it follows the connection (plain here)."""
    with gateway(_admin_config(fake[0], tmp_path, secure_cookies=setting)) as gw:
        r = httpx.post(gw.url + "/dashboard/login", data={"key": admin_env})
    assert r.status_code == 303
    flags = [f.strip().lower() for f in r.headers["set-cookie"].split(";")]
    assert ("secure" in flags) is secure
    assert "httponly" in flags and "samesite=strict" in flags


# --- operational endpoints ---

OPS_ENV = "NCAP_TEST_HOSTILE_OPS_KEY"
OPS_KEY = "hostile-suite-operations-key-" + "y" * 8
OPERATIONAL = ("/metrics", "/readyz", "/openapi.json")


@pytest.mark.parametrize("path", OPERATIONAL)
def test_operational_endpoints_can_require_a_credential(
    path: str,
    fake: tuple[str, FakeState],
    tmp_path: Path,
    admin_env: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(OPS_ENV, OPS_KEY)
    config = _admin_config(fake[0], tmp_path, operations_key_env=OPS_ENV)
    with gateway(config) as gw:
        none = httpx.get(gw.url + path)
        wrong = httpx.get(gw.url + path, headers={"Authorization": f"Bearer {CLIENT_KEY}"})
        ops = httpx.get(gw.url + path, headers={"Authorization": f"Bearer {OPS_KEY}"})
        admin = httpx.get(gw.url + path, headers={"Authorization": f"Bearer {admin_env}"})
        health = httpx.get(gw.url + "/healthz")
    assert (none.status_code, wrong.status_code) == (401, 403)
    assert none.json()["error"]["code"] == "invalid_api_key"
    assert "default" not in none.text and "fake" not in wrong.text  # no workload, no route
    assert (ops.status_code, admin.status_code, health.status_code) == (200, 200, 200)


def test_an_operations_key_named_but_unset_refuses_the_start(tmp_path: Path) -> None:
    config = _admin_config("http://127.0.0.1:9/v1", tmp_path, operations_key_env=OPS_ENV)
    with pytest.raises(ConfigError) as refused:
        create_app(config)
    assert OPS_ENV in str(refused.value)


def test_a_public_bind_without_an_operations_key_is_warned_about() -> None:
    text = yaml.safe_dump(
        {
            "server": {"host": "0.0.0.0"},
            "keys": [{"hash": hash_key(CLIENT_KEY), "workload": "default"}],
        }
    )
    config = parse_config(text)
    (warning,) = warnings_for(config, text, "ncap.yaml", datetime.now(UTC))
    assert warning.startswith("ncap.yaml: server.host (line 5)")
    assert "/metrics, /readyz and /openapi.json" in warning


# --- another key of the same workload and its Idempotency-Keys ---

OTHER_KEY = "sk-ncap-hostile-other-key-same-workload"
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("keep_answers", [False, True])
def test_idempotency_keys_are_scoped_by_api_key(
    keep_answers: bool, fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    """Two keys of one workload: the second reusing the first's ``order-42`` neither
    learns its request id, nor is refused because of it, nor gets its answer."""
    config = gateway_config(
        fake[0],
        tmp_path,
        keys=[
            {"hash": hash_key(CLIENT_KEY), "workload": "default"},
            {"hash": hash_key(OTHER_KEY), "workload": "default"},
        ],
        server={"idempotency_keep_answers": keep_answers},
    )
    with gateway(config) as gw:
        mine = openai.OpenAI(base_url=gw.url + "/v1", api_key=CLIENT_KEY, max_retries=0)
        other = openai.OpenAI(base_url=gw.url + "/v1", api_key=OTHER_KEY, max_retries=0)

        def send(client: openai.OpenAI, key: str, content: str = "hi") -> Any:
            return client.chat.completions.with_raw_response.create(
                model="fake-model",
                messages=[{"role": "user", "content": content}],
                extra_headers={"Idempotency-Key": key},
            )

        first = send(mine, "order-42")
        send(mine, "order-7")
        # the same key and body from the other API key: served afresh (no 409 naming
        # the first request, no replay of its answer)
        same = send(other, "order-42")
        assert "x-ncap-idempotent-replay" not in same.headers
        assert same.headers["x-request-id"] != first.headers["x-request-id"]
        # the same key with another body: served (no 400 naming the first request)
        assert send(other, "order-7", content="another body").parse().choices
        # the key still protects its own API key's requests
        if keep_answers:
            again = send(mine, "order-42")
            assert again.headers["x-ncap-idempotent-replay"] == first.headers["x-request-id"]
        else:
            with pytest.raises(openai.ConflictError):
                send(mine, "order-42")


# --- keyless loopback mode and web pages ---

BODY = b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}'
JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize(
    "headers",
    [
        {"Content-Type": "text/plain"},  # a cross-site "simple" request: no preflight
        {"Content-Type": "application/x-www-form-urlencoded"},
        {"Content-Type": "text/plain; charset=application/json"},  # JSON only in a parameter
        {},  # no content type at all
        {**JSON, "Host": "rebound.attacker.example"},  # DNS rebinding to 127.0.0.1
        {**JSON, "Host": "127.0.0.1.attacker.example:8080"},
        {**JSON, "Origin": "https://attacker.example"},
        {**JSON, "Origin": "null"},  # a sandboxed frame or a file: page
        {**JSON, "Origin": "http://localhost.attacker.example"},
    ],
    ids=[
        "text-plain",
        "form",
        "json-parameter",
        "no-type",
        "rebound-host",
        "lookalike-host",
        "origin",
        "null",
        "lookalike-origin",
    ],
)
def test_keyless_mode_refuses_what_a_web_page_could_send(
    headers: dict[str, str], fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    config = gateway_config(fake[0], tmp_path)  # no keys: keyless loopback mode
    with gateway(config) as gw:
        r = httpx.post(gw.url + "/v1/chat/completions", content=BODY, headers=headers)
        served = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        assert served.chat.completions.create(model="fake-model", messages=MESSAGES).choices
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "forbidden"
    rows = [json.loads(line) for line in _export(config, tmp_path).splitlines()]
    assert len(rows) == 1  # only the SDK's request was served (and billed)


@pytest.mark.parametrize("origin", [None, "http://localhost:{port}", "http://127.0.0.1:{port}"])
def test_keyless_mode_serves_local_programs_and_pages(
    origin: str | None, fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    with gateway(gateway_config(fake[0], tmp_path)) as gw:
        headers = dict(JSON)
        if origin is not None:
            headers["Origin"] = origin.format(port=gw.port)
        r = httpx.post(gw.url + "/v1/chat/completions", content=BODY, headers=headers)
        local = httpx.post(
            f"http://localhost:{gw.port}/v1/chat/completions", content=BODY, headers=JSON
        )
        alias = httpx.post(  # any 127/8 address or [::1] names this machine
            gw.url + "/v1/chat/completions",
            content=BODY,
            headers={**JSON, "Host": f"127.0.0.2:{gw.port}"},
        )
        with_charset = httpx.post(  # a JSON body's media type with parameters, any case
            gw.url + "/v1/chat/completions",
            content=BODY,
            headers={"Content-Type": "Application/JSON; charset=utf-8"},
        )
    statuses = (r.status_code, local.status_code, alias.status_code, with_charset.status_code)
    assert statuses == (200, 200, 200, 200), r.text


def _export(config: Any, tmp: Path) -> str:
    path = tmp / "export.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    out = CliRunner().invoke(cli, ["ledger", "export", "--since", "1d", "--config", str(path)])
    assert out.exit_code == 0, out.output
    return out.stdout


# --- who made an admin change, and the ids an admin or a client names ---


def _admin_client(gw: Any, **headers: str) -> httpx.Client:
    return httpx.Client(
        base_url=gw.url, headers={"Authorization": f"Bearer {ADMIN_KEY}", **headers}, timeout=10
    )


GRANT = {
    "workload": "default",
    "owner": "finops@example.com",
    "max_candidates": 2,
    "expires": "2099-01-01T00:00:00Z",
}


def test_the_audit_actor_is_the_credential_not_a_header(
    fake: tuple[str, FakeState], tmp_path: Path, admin_env: str
) -> None:
    config = _admin_config(fake[0], tmp_path)
    with gateway(config) as gw, _admin_client(gw, **{"X-Ncap-Actor": "ceo@example.com"}) as admin:
        assert admin.post("/admin/exceptions", json={**GRANT, "id": "q1"}).status_code == 201
        audit = admin.get("/admin/audit").json()["data"]
    (row,) = audit
    # the admin key's fingerprint, never the key
    assert row["actor"] == "admin-key:" + hashlib.sha256(ADMIN_KEY.encode()).hexdigest()[:12]
    assert ADMIN_KEY not in json.dumps(audit)
    assert row["detail"]["claimed_actor"] == "ceo@example.com"  # kept, as a claim


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/admin/exceptions", {**GRANT, "id": "x" * 60_000}),  # into metric labels and the ledger
        ("/admin/exceptions", {**GRANT, "id": "q1\nforged-log-line"}),
        ("/admin/exceptions", {**GRANT, "id": "<script>alert(1)</script>"}),
        ("/admin/exceptions", {**GRANT, "id": "q2", "owner": "o" * 60_000}),
        ("/admin/keys", {"workload": "default", "environment": "e" * 60_000}),
        ("/admin/keys", {"workload": "default", "label": "<img src=x onerror=alert(1)>"}),
    ],
    ids=["long-id", "newline-id", "markup-id", "long-owner", "long-environment", "markup-label"],
)
def test_ids_an_admin_names_are_bounded(
    path: str, body: dict[str, Any], fake: tuple[str, FakeState], tmp_path: Path, admin_env: str
) -> None:
    with gateway(_admin_config(fake[0], tmp_path)) as gw, _admin_client(gw) as admin:
        r = admin.post(path, json=body)
        listed = admin.get(path).json()["data"]
    assert r.status_code == 400, r.text[:200]
    assert r.json()["error"]["code"] == "invalid_value" and len(r.content) < 2000
    assert [e for e in listed if e.get("source") == "admin"] == []


def test_a_path_id_is_bounded_and_not_echoed(
    fake: tuple[str, FakeState], tmp_path: Path, admin_env: str
) -> None:
    with gateway(_admin_config(fake[0], tmp_path)) as gw, _admin_client(gw) as admin:
        for path in ("/admin/exceptions/", "/admin/keys/"):
            r = admin.delete(path + "z" * 4000)
            assert r.status_code == 400 and "z" * 100 not in r.text, r.text[:200]
            assert admin.delete(path + "no-such-id").status_code == 404


def test_a_config_exception_id_is_bounded(tmp_path: Path) -> None:
    grant = {**GRANT, "id": "x" * 65}
    with pytest.raises(ConfigError) as refused:
        gateway_config("http://127.0.0.1:9/v1", tmp_path, exceptions=[grant])
    assert any("exceptions.0.id" in p for p in refused.value.problems)


def test_a_client_named_model_is_not_echoed_whole(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    with gateway(gateway_config(fake[0], tmp_path)) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model="m" * 100_000, messages=MESSAGES)
    assert len(missing.value.response.content) < 2000
