"""Budget alerts end to end: requests through the gateway spend a day, month and
exception budget; a webhook receiver (an aiohttp server) gets each threshold exactly
once, a failed delivery is retried, a restart does not fire again, and the report
lists the alerts (source ``budget``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from ncap.config import Config, parse_duration, utcnow
from ncap.errors import ConfigError
from ncap.http.app import ALERTER
from ncap.reports import build_report, since_window, source_from_url
from tests.support import ServerThread, gateway, gateway_config

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


async def _upstream(request: web.Request) -> web.Response:
    """Every choice costs exactly 20 output tokens (USD 0.02 at the test's price), the
    ceiling the reservation holds, so a request spends what it reserved."""
    body = await request.json()
    n = body.get("n") or 1
    choices = [
        {"index": i, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}
        for i in range(n)
    ]
    usage = {"prompt_tokens": 5, "completion_tokens": 20 * n, "total_tokens": 5 + 20 * n}
    return web.json_response(
        {
            "id": "c1",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": choices,
            "usage": usage,
        }
    )


class Receiver:
    """The webhook: refuses its very first post with a 503, accepts the rest."""

    def __init__(self) -> None:
        self.accepted: list[dict[str, Any]] = []
        self.refused = 0

    async def handle(self, request: web.Request) -> web.Response:
        payload = await request.json()
        if self.refused == 0:
            self.refused += 1
            return web.Response(status=503)
        self.accepted.append(payload)
        return web.json_response({"ok": True})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/hook", self.handle)
        return app


@pytest.fixture
def upstream() -> Iterator[str]:
    def app() -> web.Application:
        a = web.Application()
        a.router.add_post("/v1/chat/completions", _upstream)
        return a

    server = ServerThread(app).start()
    try:
        yield server.url + "/v1"
    finally:
        server.stop()


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    hook = Receiver()
    server = ServerThread(hook.app).start()
    try:
        yield hook, server.url + "/hook"
    finally:
        server.stop()


def _config(upstream: str, hook_url: str, tmp: Path) -> Config:
    return gateway_config(
        upstream,
        tmp,
        workloads={
            "default": {
                "max_candidates": 1,
                "output_ceiling": 20,
                "usd_per_day": 0.12,
                "usd_per_month": 0.24,
            }
        },
        exceptions=[
            {
                "id": "eval",
                "workload": "default",
                "owner": "finops@example.com",
                "max_candidates": 2,
                "budget_usd": 0.12,
                "expires": "2099-01-01T00:00:00Z",
            }
        ],
        routes={"fake": {"pricing": {"input_per_mtok": 0, "output_per_mtok": 1000}}},
        alerts={"webhook_url": hook_url, "thresholds": [50, 80, 100], "backoff_s": 0.05},
    )


def _key(payload: dict[str, Any]) -> tuple[str, str, int]:
    facts = payload["ncap"]
    return facts["subject"], facts["window"], facts["threshold_pct"]


def _wait_for(hook: Receiver, count: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while len(hook.accepted) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def test_each_threshold_posted_exactly_once(
    upstream: str, receiver: tuple[Receiver, str], tmp_path: Path
) -> None:
    hook, url = receiver
    config = _config(upstream, url, tmp_path)
    expected = {
        ("default", "day", 50),
        ("default", "day", 80),
        ("default", "day", 100),
        ("eval", "exception", 50),
        ("eval", "exception", 80),
        ("eval", "exception", 100),
        ("default", "month", 50),
    }
    with gateway(config) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
        for _ in range(3):  # 3 x USD 0.04 on the exception: 100% of day and exception
            reply = client.chat.completions.create(model="fake-model", messages=MESSAGES, n=2)
            assert len(reply.choices) == 2
        with pytest.raises(openai.RateLimitError) as spent:
            client.chat.completions.create(model="fake-model", messages=MESSAGES, n=2)
        assert spent.value.code == "budget_exhausted"
        _wait_for(hook, len(expected))
        time.sleep(0.5)  # any duplicate would arrive by now
        assert hook.refused == 1  # the first delivery failed and was retried
        keys = [_key(p) for p in hook.accepted]
        assert sorted(keys) == sorted(expected)
        assert len(keys) == len(set(keys))
        first = next(p for p in hook.accepted if _key(p) == ("default", "day", 100))
        assert "100%" in first["text"] and "workload default" in first["text"]
        assert first["ncap"]["spent_usd"] == pytest.approx(0.12)
    with gateway(config) as gw:  # a restart: the budgets are still spent, nothing fires
        assert gw.app is not None
        assert gw.call(gw.app[ALERTER].check("default", "eval")) == []
        assert gw.call(gw.app[ALERTER].check("default", None)) == []
    assert sorted(_key(p) for p in hook.accepted) == sorted(expected)

    source = source_from_url(config.stores.ledger)
    try:
        report = build_report(source, since_window(parse_duration("1d"), utcnow()))
    finally:
        source.close()
    budget = [a for a in report.alerts if a.source == "budget"]
    assert sorted(a.code for a in budget) == sorted(f"budget_{w}_{p}" for _, w, p in expected)
    assert {a.severity for a in budget if a.code.endswith("_100")} == {"critical"}
    assert all("not delivered" not in a.message for a in budget)


@pytest.mark.parametrize(
    "alerts",
    [{"thresholds": [0]}, {"thresholds": [5000]}, {"webhook_url": "ftp://x"}, {"scopes": ["week"]}],
)
def test_bad_alert_config_is_refused(alerts: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        gateway_config("http://127.0.0.1:9/v1", tmp_path, alerts=alerts)


def test_a_budget_refusing_requests_fires_its_critical_alert(
    upstream: str, receiver: tuple[Receiver, str], tmp_path: Path
) -> None:
    """USD 0.13 a day at USD 0.02 a request: six requests spend 92 %, the seventh would
    pass the limit and is refused, so spend never reaches 100 %; the refusal itself
    fires the 100 % alert, saying that the budget refuses requests."""
    hook, url = receiver
    config = _config(upstream, url, tmp_path)
    config = config.model_copy(
        update={
            "workloads": {
                "default": config.workloads["default"].model_copy(
                    update={"usd_per_day": 0.13, "usd_per_month": None}
                )
            },
            "exceptions": [],
        }
    )
    with gateway(config) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
        for _ in range(6):
            client.chat.completions.create(model="fake-model", messages=MESSAGES)
        _wait_for(hook, 2)
        time.sleep(0.3)
        assert sorted(_key(p) for p in hook.accepted) == [
            ("default", "day", 50),
            ("default", "day", 80),
        ]
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model="fake-model", messages=MESSAGES)
        assert refused.value.code == "budget_exhausted"
        _wait_for(hook, 3)
    critical = [p for p in hook.accepted if _key(p) == ("default", "day", 100)]
    assert len(critical) == 1
    assert "refuses requests" in critical[0]["text"]
    assert "$0.120000 of $0.130000" in critical[0]["text"]
    assert critical[0]["ncap"]["spent_usd"] == pytest.approx(0.12)
