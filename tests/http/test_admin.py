"""The admin API through the real server: exceptions and keys created, used by the
official openai SDK and revoked without a restart, each change in the audit table."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ncap.config import Config
from ncap.http.admin import admin_actor
from ncap.testing.fake_upstream import FakeState
from tests.support import ServerThread, gateway, gateway_config

ADMIN_ENV = "NCAP_TEST_ADMIN_KEY"
ADMIN_KEY = "admin-secret-for-tests"
MESSAGES: list[Any] = [{"role": "user", "content": "Say something."}]
GRANT = {
    "id": "eval-q4",
    "workload": "default",
    "owner": "finops@example.com",
    "max_candidates": 4,
    "output_ceiling": 128,
    "budget_usd": 5.0,
    "expires": "2099-01-01T00:00:00Z",
    "reason": "self-consistency evaluation",
}


def _config(fake: tuple[str, FakeState], tmp: Path) -> Config:
    return gateway_config(
        fake[0],
        tmp,
        server={"admin_key_env": ADMIN_ENV},
        workloads={"default": {"max_candidates": 1, "output_ceiling": 256}},
    )


@pytest.fixture
def admin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_ENV, ADMIN_KEY)


@pytest.fixture
def server(fake: tuple[str, FakeState], tmp_path: Path, admin_env: None) -> Iterator[ServerThread]:
    fake[1].reset()
    with gateway(_config(fake, tmp_path)) as gw:
        yield gw


def _admin(gw: ServerThread, key: str | None = ADMIN_KEY, actor: str = "ops@example.com") -> Any:
    headers = {"X-Ncap-Actor": actor}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.Client(base_url=gw.url, headers=headers, timeout=10)


def _sdk(gw: ServerThread, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def _n3(client: openai.OpenAI) -> Any:
    return client.chat.completions.create(model="fake-model", messages=MESSAGES, n=3)


def _audit_rows(tmp: Path) -> list[tuple[str, str, str, str, dict[str, Any]]]:
    with sqlite3.connect(tmp / "ledger.db") as conn:
        rows = conn.execute(
            "SELECT actor, action, kind, target, detail, at FROM admin_audit ORDER BY seq"
        ).fetchall()
    for row in rows:
        assert row[5].endswith("Z")  # when: a UTC timestamp
    return [(a, act, k, t, json.loads(d)) for a, act, k, t, d, _ in rows]


def test_exception_created_used_revoked_without_restart(
    server: ServerThread, tmp_path: Path
) -> None:
    client, admin = _sdk(server), _admin(server)
    with pytest.raises(openai.BadRequestError) as refused:
        _n3(client)
    assert refused.value.code == "candidate_count_exceeds_policy"

    created = admin.post("/admin/exceptions", json=GRANT)
    assert created.status_code == 201, created.text
    assert created.json()["source"] == "admin" and created.json()["status"] == "active"
    raw = client.chat.completions.with_raw_response.create(
        model="fake-model", messages=MESSAGES, n=3
    )
    assert len(raw.parse().choices) == 3
    rid = raw.headers["x-request-id"]
    listed = admin.get("/admin/exceptions").json()["data"]
    assert [e["id"] for e in listed] == ["eval-q4"]

    revoked = admin.delete("/admin/exceptions/eval-q4")
    assert revoked.status_code == 200, revoked.text
    with pytest.raises(openai.BadRequestError) as again:
        _n3(client)
    assert again.value.code == "candidate_count_exceeds_policy"
    assert admin.get("/admin/exceptions").json()["data"] == []

    # the admitted request's row names the exception it used
    with sqlite3.connect(tmp_path / "ledger.db") as conn:
        used = conn.execute(
            "SELECT exception_id, effective_candidate_count FROM ledger_events"
            " WHERE request_id = ?",
            (rid,),
        ).fetchall()
    assert used == [("eval-q4", 3)]
    rows = _audit_rows(tmp_path)
    # the actor is the admin credential's fingerprint; the header's name is only a claim
    actor = admin_actor(ADMIN_KEY)
    assert [(a, act, k, t) for a, act, k, t, _ in rows] == [
        (actor, "create", "exception", "eval-q4"),
        (actor, "revoke", "exception", "eval-q4"),
    ]
    assert [r[4]["claimed_actor"] for r in rows] == ["ops@example.com"] * 2
    assert rows[0][4]["max_candidates"] == 4 and rows[0][4]["owner"] == "finops@example.com"
    assert admin.get("/admin/audit").json()["data"][1]["action"] == "revoke"


def test_key_created_used_revoked_without_restart(server: ServerThread, tmp_path: Path) -> None:
    admin = _admin(server)
    made = admin.post("/admin/keys", json={"workload": "default", "label": "ci"})
    assert made.status_code == 201, made.text
    key, kid = made.json()["key"], made.json()["id"]
    assert key.startswith("ncap-") and kid.startswith("sha256:")
    reply = _sdk(server, key).chat.completions.create(model="fake-model", messages=MESSAGES)
    assert len(reply.choices) == 1
    # a key now exists, so a request without a (valid) one is refused
    with pytest.raises(openai.AuthenticationError):
        _sdk(server, "ncap-wrong").chat.completions.create(model="fake-model", messages=MESSAGES)
    assert [k["label"] for k in admin.get("/admin/keys").json()["data"]] == ["ci"]

    assert admin.delete("/admin/keys/ci").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        _sdk(server, key).chat.completions.create(model="fake-model", messages=MESSAGES)
    rows = _audit_rows(tmp_path)
    assert [(act, k, t) for _, act, k, t, _ in rows] == [
        ("create", "key", kid),
        ("revoke", "key", kid),
    ]
    assert key not in json.dumps(rows)  # the key itself is never stored
    assert rows[0][4]["hash"] == kid[:7] + rows[0][4]["hash"][7:] and "key" not in rows[0][4]


def test_changes_survive_a_restart(
    fake: tuple[str, FakeState], tmp_path: Path, admin_env: None
) -> None:
    config = _config(fake, tmp_path)
    with gateway(config) as gw:
        assert _admin(gw).post("/admin/exceptions", json=GRANT).status_code == 201
        assert (
            _admin(gw).post("/admin/exceptions", json={**GRANT, "id": "other"}).status_code == 201
        )
        assert _admin(gw).delete("/admin/exceptions/other").status_code == 200
    with gateway(config) as gw:
        assert len(_n3(_sdk(gw)).choices) == 3  # the exception is still in force
        ids = [e["id"] for e in _admin(gw).get("/admin/exceptions").json()["data"]]
        assert ids == ["eval-q4"]
        assert (
            _admin(gw).post("/admin/exceptions", json={**GRANT, "id": "other"}).status_code == 400
        )


def test_config_exception_revoked_and_kept_revoked(
    fake: tuple[str, FakeState], tmp_path: Path, admin_env: None
) -> None:
    config = gateway_config(
        fake[0],
        tmp_path,
        server={"admin_key_env": ADMIN_ENV},
        workloads={"default": {"max_candidates": 1, "output_ceiling": 256}},
        exceptions=[GRANT],
    )
    with gateway(config) as gw:
        assert len(_n3(_sdk(gw)).choices) == 3
        listed = _admin(gw).get("/admin/exceptions").json()["data"]
        assert listed[0]["source"] == "config"
        assert _admin(gw).delete("/admin/exceptions/eval-q4").status_code == 200
        with pytest.raises(openai.BadRequestError):
            _n3(_sdk(gw))
    with gateway(config) as gw, pytest.raises(openai.BadRequestError):
        _n3(_sdk(gw))


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({**GRANT, "max_candidates": 0}, 400, "max_candidates", "invalid_value"),
        ({**GRANT, "max_candidates": 99}, 400, "max_candidates", "invalid_value"),
        ({**GRANT, "workload": "nope"}, 400, "workload", "invalid_value"),
        (
            {k: v for k, v in GRANT.items() if k != "owner"},
            400,
            "owner",
            "missing_required_parameter",
        ),
        ({**GRANT, "colour": "red"}, 400, "colour", "unknown_parameter"),
        ({**GRANT, "expires": "soon"}, 400, "expires", "invalid_value"),
        # already expired: it would never apply and its id could never be reused
        ({**GRANT, "expires": "2020-01-01T00:00:00Z"}, 400, "expires", "invalid_value"),
    ],
)
def test_bad_exception_is_an_openai_400(
    server: ServerThread, body: dict[str, Any], status: int, param: str, code: str
) -> None:
    reply = _admin(server).post("/admin/exceptions", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == "invalid_request_error"


def test_bad_bodies_and_ids(server: ServerThread, tmp_path: Path) -> None:
    admin = _admin(server)
    not_json = admin.post("/admin/exceptions", content=b"{nope")
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"
    listed = admin.post("/admin/keys", json=["workload"])
    assert listed.status_code == 400 and listed.json()["error"]["code"] == "invalid_type"
    missing = admin.delete("/admin/exceptions/never")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "id"
    assert admin.post("/admin/exceptions", json=GRANT).status_code == 201
    dup = admin.post("/admin/exceptions", json=GRANT)
    assert dup.status_code == 400 and dup.json()["error"]["param"] == "id"
    bad_actor = _admin(server, actor="x\u0007y").get("/admin/keys")
    assert bad_actor.status_code == 400
    assert len(_audit_rows(tmp_path)) == 1  # refused changes leave no audit row


def test_missing_or_wrong_key(server: ServerThread, tmp_path: Path) -> None:
    assert _admin(server, key=None).get("/admin/exceptions").status_code == 401
    assert _admin(server, key="wrong").post("/admin/exceptions", json=GRANT).status_code == 403
    # a workload's own key is not the admin key
    key = _admin(server).post("/admin/keys", json={"workload": "default"}).json()["key"]
    refused = _admin(server, key=key).delete("/admin/keys/" + key)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "forbidden"
    assert len(_audit_rows(tmp_path)) == 1


def test_admin_api_off_without_admin_key(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    with gateway(_config(fake, tmp_path)) as gw:
        reply = _admin(gw).get("/admin/exceptions")
    assert reply.status_code == 403
    assert ADMIN_ENV in reply.json()["error"]["message"]
