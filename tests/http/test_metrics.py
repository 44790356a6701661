"""/metrics exposes what docs/operations.md lists, with bounded labels only."""

from __future__ import annotations

import httpx

from tests.support import ServerThread

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def test_metrics_after_an_allowed_and_a_denied_request(gw: ServerThread) -> None:
    url = gw.url + "/v1/chat/completions"
    assert httpx.post(url, json={**BODY, "n": 2}, timeout=10).status_code == 200
    assert httpx.post(url, json={**BODY, "n": 9}, timeout=10).status_code == 400
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    for line in [
        'ncap_requests_total{policy_result="allow",reason="within_default",workload="default"} 1.0',
        'ncap_requests_total{policy_result="deny",reason="candidate_count_exceeds_policy",'
        'workload="default"} 1.0',
        'ncap_candidates_requested_bucket{le="2.0",workload="default"} 1.0',
        'ncap_upstream_attempts_total{outcome="completed",route="fake"} 1.0',
        "ncap_upstream_latency_seconds_count",
        'ncap_tokens_total{direction="out",route="fake"}',
        "ncap_reservations_outstanding",
        "ncap_pending_reconciliation",
        "ncap_engine_queue_depth",
    ]:
        assert line in text, line


def test_readyz_reports_the_stores(gw: ServerThread) -> None:
    r = httpx.get(gw.url + "/readyz", timeout=10)
    stores = {
        "ledger": {"backend": "sqlite", "ready": True},
        "budgets": {"backend": "sqlite", "ready": True},
    }
    assert r.status_code == 200
    assert r.json() == {"ready": True, "problems": [], "stores": stores}
    assert httpx.get(gw.url + "/healthz", timeout=10).json() == {"status": "ok"}
