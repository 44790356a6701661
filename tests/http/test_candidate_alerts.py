"""The "candidates mostly duplicate" alert as it happens: requests through the gateway
whose n candidates are copies of one answer post one alert to the webhook once their
count reaches the threshold's minimum, once per subject and day (a restart does not
post it again); candidates that differ post nothing; and the post carries counts,
never the candidates' text."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from ncap.config import Config
from tests.support import ServerThread, gateway, gateway_config

CANARY = "zebra-canary-7731"


async def _upstream(request: web.Request) -> web.Response:
    """n copies of one answer when the prompt says "same", n different ones otherwise."""
    body = await request.json()
    n = body.get("n") or 1
    same = "same" in body["messages"][-1]["content"]
    texts = [f"{CANARY} answer" if same else f"{CANARY} answer {i}" for i in range(n)]
    choices = [
        {"index": i, "finish_reason": "stop", "message": {"role": "assistant", "content": t}}
        for i, t in enumerate(texts)
    ]
    usage = {"prompt_tokens": 5, "completion_tokens": 4 * n, "total_tokens": 5 + 4 * n}
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
    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.posts.append(await request.json())
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


def _config(upstream: str, hook_url: str, tmp: Path, **alerts: Any) -> Config:
    return gateway_config(
        upstream,
        tmp,
        workloads={"default": {"max_candidates": 1, "output_ceiling": 20}},
        exceptions=[
            {
                "id": "evals",
                "workload": "default",
                "owner": "finops@example.com",
                "max_candidates": 3,
                "budget_usd": 100,
                "expires": "2099-01-01T00:00:00Z",
            }
        ],
        reports={"thresholds": {"candidates_distinct_share": 0.5, "candidates_min_requests": 3}},
        alerts={"webhook_url": hook_url, "backoff_s": 0.05, **alerts},
    )


def _send(url: str, prompt: str, count: int) -> None:
    """``count`` requests at n=3 (the keyless default workload, under its exception)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    for _ in range(count):
        reply = client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": prompt}],
            n=3,
            temperature=1.0,
        )
        assert len(reply.choices) == 3


def _settle(hook: Receiver, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while len(hook.posts) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.4)  # a duplicate post would arrive by now


def test_duplicates_post_once_at_the_minimum_and_not_again_after_a_restart(
    upstream: str, receiver: tuple[Receiver, str], tmp_path: Path
) -> None:
    hook, url = receiver
    config = _config(upstream, url, tmp_path)
    with gateway(config) as gw:
        _send(gw.url, f"same {CANARY}", 2)
        _settle(hook, 1, timeout=0.5)
        assert hook.posts == []  # two requests: below the minimum of three
        _send(gw.url, f"same {CANARY}", 3)
        _settle(hook, 1)
    assert len(hook.posts) == 1
    post = hook.posts[0]
    facts = post["ncap"]
    assert facts["kind"] == "candidates"
    assert facts["workload"] == "default" and facts["exception"] == "evals"
    assert facts["requests"] == 3
    assert facts["distinct_share_mean"] == pytest.approx(1 / 3, abs=1e-6)
    assert facts["threshold"] == 0.5
    assert "candidates mostly duplicate" in post["text"] and "exception evals" in post["text"]
    assert "revoke the exception" in post["text"]
    assert CANARY not in str(post)

    with gateway(config) as gw:  # a restart: today's alert is claimed already
        _send(gw.url, f"same {CANARY}", 3)
        _settle(hook, 2, timeout=1.0)
    assert len(hook.posts) == 1


def test_different_candidates_post_nothing(
    upstream: str, receiver: tuple[Receiver, str], tmp_path: Path
) -> None:
    hook, url = receiver
    with gateway(_config(upstream, url, tmp_path)) as gw:
        _send(gw.url, "differ", 4)
        _settle(hook, 1, timeout=1.0)
    assert hook.posts == []


def test_turned_off_by_config(
    upstream: str, receiver: tuple[Receiver, str], tmp_path: Path
) -> None:
    hook, url = receiver
    with gateway(_config(upstream, url, tmp_path, candidates=False)) as gw:
        _send(gw.url, "same", 4)
        _settle(hook, 1, timeout=1.0)
    assert hook.posts == []
