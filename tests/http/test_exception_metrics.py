"""The ``ncap_exception_*`` gauges cover the admin API's exceptions as well as the
config's, and a revoked exception reads ``ncap_exception_active 0`` (its spend stays,
so the "exception budget nearly gone" rule still sees what it used)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ncap.testing.fake_upstream import FakeState
from tests.http.test_operator_metrics import sample, scrape
from tests.support import ServerThread, gateway, gateway_config

ADMIN_ENV = "NCAP_TEST_ADMIN_KEY_METRICS"
ADMIN_KEY = "admin-secret-for-metrics"
MESSAGES: list[Any] = [{"role": "user", "content": "Say something."}]
GRANT = {
    "id": "made-by-api",
    "workload": "default",
    "owner": "finops@example.com",
    "max_candidates": 3,
    "output_ceiling": 64,
    "budget_usd": 5.0,
    "expires": "2099-01-01T00:00:00Z",
}
CONFIGURED = {**GRANT, "id": "from-config", "max_candidates": 2}


@pytest.fixture
def server(
    fake: tuple[str, FakeState], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ServerThread]:
    fake[1].reset()
    monkeypatch.setenv(ADMIN_ENV, ADMIN_KEY)
    config = gateway_config(
        fake[0],
        tmp_path,
        server={"admin_key_env": ADMIN_ENV, "metrics_cache_s": 0},
        workloads={"default": {"max_candidates": 1, "output_ceiling": 64}},
        exceptions=[CONFIGURED],
    )
    with gateway(config) as gw:
        yield gw


def test_admin_exceptions_have_series_and_revoked_ones_read_inactive(server: ServerThread) -> None:
    admin = httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
    )
    assert admin.post("/admin/exceptions", json=GRANT).status_code == 201
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(model="fake-model", messages=MESSAGES, n=3)
    labels = {"exception": "made-by-api", "workload": "default"}
    text = scrape(server.url)
    assert sample(text, "ncap_exception_active", **labels) == 1
    assert (sample(text, "ncap_exception_budget_spent_micros", **labels) or 0) > 0
    assert sample(text, "ncap_exception_budget_limit_micros", **labels) == 5_000_000

    assert admin.delete("/admin/exceptions/made-by-api").status_code == 200
    assert admin.delete("/admin/exceptions/from-config").status_code == 200
    text = scrape(server.url)
    assert sample(text, "ncap_exception_active", **labels) == 0
    assert (sample(text, "ncap_exception_budget_spent_micros", **labels) or 0) > 0
    configured = {"exception": "from-config", "workload": "default"}
    assert sample(text, "ncap_exception_active", **configured) == 0
