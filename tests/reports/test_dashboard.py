"""/dashboard over HTTP: who may see it, and that what it shows is escaped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .dashboard_support import CANARY, WORKLOAD_KEY, Dashboard, dashboard_gateway


@pytest.fixture(scope="module")
def dash(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dashboard]:
    with dashboard_gateway(Path(tmp_path_factory.mktemp("dash"))) as d:
        yield d


def test_without_a_key_it_asks_to_sign_in(dash: Dashboard) -> None:
    r = httpx.get(dash.url, timeout=30)
    assert r.status_code == 401
    assert 'name="key"' in r.text and "<svg" not in r.text
    assert "default-src 'none'" in r.headers["content-security-policy"]


@pytest.mark.parametrize("key", [WORKLOAD_KEY, "nonsense"])
def test_a_key_that_is_not_the_admin_key_is_refused(dash: Dashboard, key: str) -> None:
    r = httpx.get(dash.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 403 and "<svg" not in r.text
    r = httpx.post(dash.url + "/login", data={"key": key}, timeout=30)
    assert r.status_code == 403 and "set-cookie" not in r.headers
    r = httpx.get(dash.url + "/report.json", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"


def test_the_admin_key_sees_the_report_with_the_canary_escaped(dash: Dashboard) -> None:
    r = httpx.get(dash.url, headers={"Authorization": f"Bearer {dash.admin_key}"}, timeout=30)
    assert r.status_code == 200
    assert "<script" not in r.text
    assert "&lt;script&gt;window.__canary = 1&lt;/script&gt;&#34;&amp;" in r.text
    assert r.text.count("<svg") >= 5
    for section in ("distribution", "output", "exceptions", "denials", "pending", "spend"):
        assert f'id="{section}"' in r.text


def test_sign_in_sets_a_session_cookie_that_is_not_the_key(dash: Dashboard) -> None:
    with httpx.Client(base_url=dash.server.url, timeout=30) as client:
        r = client.post("/dashboard/login", data={"key": dash.admin_key})
        assert r.status_code == 303 and r.headers["location"] == "/dashboard"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert dash.admin_key not in cookie
        assert client.get("/dashboard").status_code == 200
        client.post("/dashboard/logout")
        assert client.get("/dashboard").status_code == 401
        client.cookies.set("ncap_dashboard", "9999999999.forged", path="/dashboard")
        assert client.get("/dashboard").status_code == 401


def test_report_json_matches_the_page(dash: Dashboard) -> None:
    auth = {"Authorization": f"Bearer {dash.admin_key}"}
    data = httpx.get(dash.url + "/report.json?since=7d", headers=auth, timeout=30).json()
    workloads = {row["key"] for row in data["spend_by_workload"]}
    assert CANARY in workloads
    assert data["totals"]["requests"] > 0
    assert {e["id"] for e in data["exceptions"]} == {"eval-q4", "brainstorm-3", "ranker-3"}


def test_the_gateway_gives_its_sqlite_ledger_the_report_index(tmp_path: Path) -> None:
    import sqlite3

    from ncap.stores.sqlite.report_indexes import EXCEPTION_INDEX
    from tests.support import gateway, gateway_config

    config = gateway_config("http://127.0.0.1:9/v1", tmp_path)  # never called
    with gateway(config):
        names = {
            row[0]
            for row in sqlite3.connect(tmp_path / "ledger.db").execute(
                "SELECT name FROM sqlite_master WHERE type = 'index'"
            )
        }
    assert EXCEPTION_INDEX in names
