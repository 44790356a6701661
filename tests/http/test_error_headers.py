"""Error answers once the gateway decided the request's candidate count carry the
same ``x-ncap-*`` headers as answers: a policy denial, a budget refusal, an upstream
failure after retries (the route named is the last one tried)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from ncap.testing.fake_upstream import FakeState
from tests.support import UPSTREAM_KEY_ENV, gateway, gateway_config

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


def _headers(exc: openai.APIStatusError) -> dict[str, str]:
    return {k: v for k, v in exc.response.headers.items() if k.startswith("x-")}


def test_errors_after_the_decision_carry_the_ncap_headers(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    fake[1].reset()
    config = gateway_config(
        fake[0],
        tmp_path,
        workloads={"default": {"max_candidates": 2, "output_ceiling": 64, "usd_per_day": 0.00015}},
        models={"fake-model": ["fake"], "down-model": ["down"]},
        routes={
            "fake": {"retries": 0, "pricing": {"input_per_mtok": 0, "output_per_mtok": 1}},
            "down": {
                "provider": "openai",
                "base_url": fake[0],
                "upstream_model": "fake-model",
                "api_key_env": UPSTREAM_KEY_ENV,
                "retries": 1,
                "backoff_s": 0.01,
                "headers": {"x-fake-fault": "bad_gateway_html"},
                "pricing": {"input_per_mtok": 0, "output_per_mtok": 1},
            },
        },
    )
    with gateway(config) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.BadRequestError) as denied:
            client.chat.completions.create(model="fake-model", messages=MESSAGES, n=5)
        h = _headers(denied.value)
        assert h["x-ncap-candidates-requested"] == "5" and h["x-ncap-route"] == "fake"
        assert "x-request-id" in h and "x-ncap-candidates-effective" in h

        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(model="down-model", messages=MESSAGES, n=1)
        assert failed.value.status_code == 502
        h = _headers(failed.value)
        assert h["x-ncap-route"] == "down"
        assert h["x-ncap-candidates-requested"] == "1"
        assert h["x-ncap-candidates-effective"] == "1"
        assert int(h["x-ncap-reserved-tokens"]) > 0

        # USD 1/Mtok: the two failed attempts still hold their 64-token reservations
        # (their usage is unknown), so a third one does not fit the day's 150 micro-USD
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model="fake-model", messages=MESSAGES)
        assert refused.value.code == "budget_exhausted"
        h = _headers(refused.value)
        assert h["x-ncap-candidates-requested"] == "omitted" and h["x-should-retry"] == "false"
