"""Whatever fails, and whatever no route takes, is answered in OpenAI's error envelope:
unknown paths 404, known paths under another method 405, a handler's own bug a 500
that names nothing the client sent, never a traceback."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ncap.http.signals import RequestSignals
from ncap.lifecycle import Gateway
from ncap.testing.fake_upstream import FakeState
from tests.support import ServerThread, gateway, gateway_config

ENVELOPE_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def gw(
    fake: tuple[str, FakeState], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    tmp: Path = tmp_path_factory.mktemp("envelope")
    with gateway(gateway_config(fake[0], tmp)) as server:
        yield server


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/nope", 404, "not_found"),
        ("GET", "/", 404, "not_found"),
        ("POST", "/v1/chat/completion", 404, "not_found"),
        ("DELETE", "/v1/models/x", 404, "not_found"),
        ("GET", "/v1/chat/completions", 405, "invalid_request"),
        ("PUT", "/v1/chat/completions", 405, "invalid_request"),
        ("OPTIONS", "/v1/completions", 405, "invalid_request"),
        ("POST", "/healthz", 405, "invalid_request"),
        ("DELETE", "/metrics", 405, "invalid_request"),
        ("PATCH", "/openapi.json", 405, "invalid_request"),
        ("PUT", "/dashboard/login", 405, "invalid_request"),
    ],
)
def test_an_unrouted_request_gets_the_envelope(
    gw: ServerThread, method: str, path: str, status: int, code: str
) -> None:
    r = httpx.request(method, gw.url + path, timeout=10)
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == ENVELOPE_KEYS
    assert error["code"] == code and error["type"] == "invalid_request_error"


def test_head_of_a_get_route_is_still_served(gw: ServerThread) -> None:
    assert httpx.head(gw.url + "/healthz", timeout=10).status_code == 200
    assert httpx.head(gw.url + "/v1/chat/completions", timeout=10).status_code == 405


def test_routed_requests_are_unchanged(gw: ServerThread) -> None:
    assert httpx.get(gw.url + "/healthz", timeout=10).json() == {"status": "ok"}
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    # a refusal a handler raises keeps its own status and code
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "fake-model"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_a_handlers_bug_is_a_500_envelope_without_the_request(
    gw: ServerThread, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(self: Gateway, raw: bytes, *args: object, **kwargs: object) -> None:
        raise RuntimeError(raw.decode())  # the body in the exception's own text

    monkeypatch.setattr(Gateway, "chat", broken)
    secret = "do-not-log-this-prompt"
    with caplog.at_level(logging.ERROR, logger="ncap.http"):
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json={"model": "fake-model", "messages": [{"role": "user", "content": secret}]},
            timeout=10,
        )
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "The gateway had an internal error."
    assert set(r.json()["error"]) == ENVELOPE_KEYS
    assert r.headers["x-request-id"].startswith("req-")
    assert secret not in r.text and "Traceback" not in r.text
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "ncap.http"]
    assert any("RuntimeError" in line for line in logged), logged
    assert all(secret not in line for line in logged)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("step", ["begin", "responded"])
def test_a_bug_in_the_request_record_is_a_500_envelope(
    gw: ServerThread, monkeypatch: pytest.MonkeyPatch, path: str, step: str
) -> None:
    """The completion routes answer their own errors (no separate guard): a failure of
    the request's record, when it opens or while an error is being answered, is still
    the 500 envelope with the request's id."""

    def broken(self: RequestSignals, *args: object, **kwargs: object) -> None:
        raise RuntimeError("the record failed")

    monkeypatch.setattr(RequestSignals, step, broken)
    r = httpx.post(gw.url + path, json={"model": "fake-model"}, timeout=10)  # a 400 body
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "The gateway had an internal error."
    assert set(r.json()["error"]) == ENVELOPE_KEYS
    assert r.headers["x-request-id"].startswith("req-")
