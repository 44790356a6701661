"""The dashboard's time views in headless Chromium (Debian's, driven by Playwright) on a
generated ledger with three planted facts: ``support-draft``'s traffic halves on one
day, the exception ``eval-q4`` was revoked through the admin API, and ``support-eval``'s
day budget is refusing requests. The page must show each of them, offline, under the
strict Content-Security-Policy; a screenshot of every view is written to
``tests/artifacts/`` (git-ignored) for a person to look at.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from ncap.config import parse_config
from ncap.domain.events import LedgerEvent
from ncap.http.app import create_app
from ncap.stores import SQLiteLedgerStore
from ncap.stores.ports import AdminChange
from ncap.stores.sqlite.admin import SQLiteAdminStore
from ncap.testing.ledger_gen import LedgerSpec, generate_ledger, synthetic_config
from tests.support import ServerThread

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
VIEWS = (
    "changes",
    "trend-requests",
    "trend-spend",
    "trend-denials",
    "budgets",
    "by-candidates",
    "pending-by-route",
    "exceptions",
    "denials",
    "multi",
    "spend",
)

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
if shutil.which(CHROMIUM) is None:
    if os.environ.get("CI") == "true":
        raise RuntimeError(f"{CHROMIUM} is missing in CI (apt-get install -y chromium)")
    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)", allow_module_level=True)


@dataclass
class Planted:
    server: ServerThread
    admin_key: str
    dip: date

    @property
    def url(self) -> str:
        return self.server.url + "/dashboard?since=7d"


def _revoke(ledger: Path, exception_id: str, at: datetime) -> None:
    async def revoke() -> None:
        store = SQLiteAdminStore(ledger)
        try:
            await store.record(AdminChange("finops", "revoke", "exception", exception_id), at)
        finally:
            await store.close()

    asyncio.run(revoke())


def _refused(ledger: Path, workload: str, at: datetime, count: int) -> None:
    """The denial rows a gateway writes when ``workload``'s day budget refuses: written
    minutes ago, so they fall in the current day at any hour the test runs."""

    async def deny() -> None:
        store = SQLiteLedgerStore(ledger)
        try:
            for i in range(count):
                await store.append(
                    LedgerEvent(
                        timestamp=at + timedelta(seconds=i),
                        request_id=f"req-refused-{i}",
                        attempt=0,
                        workload_id=workload,
                        environment="production",
                        route_id="primary-chat",
                        policy_result="deny",
                        policy_reason="budget_exhausted",
                        state="denied",
                        denied_by="usd_micros_day",
                        denied_limit=10_000,
                        denied_amount=2_000,
                    )
                )
        finally:
            await store.close()

    asyncio.run(deny())


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Planted]:
    tmp = tmp_path_factory.mktemp("dash-time")
    now = datetime.now(UTC)
    dip = (now - timedelta(days=3)).date()
    # rows over the 15 days up to the end of today: this week against the one before
    end = now.replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(days=1)
    spec = LedgerSpec(rows=30_000, days=15, end=end, seed=21, dips={"support-draft": dip})
    ledger = tmp / "ledger.db"
    generate_ledger(ledger, spec)
    _revoke(ledger, "eval-q4", now - timedelta(days=2))
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    _refused(ledger, "support-eval", max(now - timedelta(minutes=3), today), 3)
    raw = synthetic_config(spec, ledger)
    raw["routes"].pop("local-smollm2")  # no model to load: the dashboard only reads
    raw["models"].pop("smollm2")
    raw["workloads"]["support-eval"]["usd_per_day"] = 0.01  # far below a day's spend
    env = f"NCAP_TEST_ADMIN_{uuid.uuid4().hex[:8].upper()}"
    raw["server"] = {"admin_key_env": env}
    digest = hashlib.sha256(b"a-workload-key").hexdigest()
    raw["keys"] = [{"hash": f"sha256:{digest}", "workload": "support-draft"}]
    config = parse_config(yaml.safe_dump(raw))
    admin_key = "ncap-admin-" + uuid.uuid4().hex
    os.environ[env] = admin_key
    try:
        server = ServerThread(lambda: create_app(config, instance_id="dash-time")).start()
    finally:
        del os.environ[env]
    try:
        yield Planted(server, admin_key, dip)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def page(planted: Planted) -> Iterator[tuple[Any, list[str], Any]]:
    """One signed-in page on the 7-day window, every off-gateway request aborted."""
    blocked: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        context = browser.new_context(viewport={"width": 1500, "height": 1100})

        def guard(route: Any) -> None:
            if urlsplit(route.request.url).hostname in ("127.0.0.1", "localhost"):
                route.continue_()
            else:
                blocked.append(route.request.url)
                route.abort()

        context.route("**/*", guard)
        pg = context.new_page()
        pg.goto(planted.server.url + "/dashboard")
        pg.fill("input[name=key]", planted.admin_key)
        with pg.expect_navigation():
            pg.click("button[type=submit]")
        response = pg.goto(planted.url)
        assert response is not None and response.status == 200
        try:
            yield pg, blocked, response
        finally:
            browser.close()


def test_every_view_is_drawn_offline_and_screenshotted(
    page: tuple[Any, list[str], Any],
) -> None:
    pg, blocked, response = page
    csp = response.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script" not in csp
    assert pg.locator("script").count() == 0
    ARTIFACTS.mkdir(exist_ok=True)
    for view in VIEWS:
        section = pg.locator(f"section#{view}")
        assert section.count() == 1, view
        box = section.bounding_box()
        assert box is not None and box["height"] > 40, view
        section.screenshot(path=str(ARTIFACTS / f"dashboard-7d-{view}.png"))
    pg.screenshot(path=str(ARTIFACTS / "dashboard-7d.png"), full_page=True)
    columns = pg.eval_on_selector_all(
        "#trend-requests svg.series g.col rect", "els => els.map(e => e.getBBox().height)"
    )
    assert len(columns) >= 7 * 4 and max(columns) > 50  # drawn, not only present
    assert blocked == []


def test_the_halved_day_is_flagged(page: tuple[Any, list[str], Any], planted: Planted) -> None:
    pg, blocked, _ = page
    day = planted.dip.isoformat()
    row = pg.locator(
        f'#flagged tr[data-workload="support-draft"][data-metric="requests"][data-bucket="{day}"]'
    )
    assert row.count() == 1, pg.inner_text("#changes")
    change = row.locator("td").nth(5).inner_text()
    assert change.startswith("-") and 35 <= int(change.strip("-%")) <= 65, change
    column = pg.locator(
        f'#trend-requests .small[data-workload="support-draft"] g.col[data-bucket="{day}"]'
    )
    assert column.get_attribute("data-flag") == "true"
    assert "flag" in (column.get_attribute("class") or "")
    value = float(column.get_attribute("data-value") or 0)
    previous = float(column.get_attribute("data-previous") or 0)
    assert previous > 100 and 0.35 < value / previous < 0.65
    # the same workload's other days are not flagged for requests
    others = pg.locator(
        '#trend-requests .small[data-workload="support-draft"] g.col[data-flag="true"]'
    )
    assert others.count() == 1
    assert blocked == []


def test_the_revoked_exception_and_the_refusing_budget_are_shown(
    page: tuple[Any, list[str], Any],
) -> None:
    pg, blocked, _ = page
    row = pg.locator("#exceptions tr", has_text="eval-q4")
    assert "revoked" in row.inner_text()
    budget = pg.locator('#budgets tr[data-workload="support-eval"]').first
    assert budget.get_attribute("data-status") == "refusing"
    bars = pg.locator('#chart-budgets g.budget[data-status="refusing"]')
    assert bars.count() >= 1
    assert "support-eval" in (bars.first.get_attribute("data-label") or "")
    limit_line = pg.locator("#budgets .small svg line.limit")
    assert limit_line.count() >= 1  # daily spend drawn against the day limit
    assert blocked == []


def test_spend_by_n_pending_by_route_and_the_fixed_tables(
    page: tuple[Any, list[str], Any],
) -> None:
    pg, blocked, _ = page
    labels = pg.eval_on_selector_all(
        "#chart-by-candidates g.pair", "els => els.map(e => e.dataset.label)"
    )
    assert {"n=omitted", "n=1", "n=2", "n=4"} <= set(labels)
    pending = pg.eval_on_selector_all(
        "#chart-pending-by-route g.bar", "els => els.map(e => e.dataset.label)"
    )
    assert pending and all(" · " in label for label in pending)
    # the n > 1 table lists only n > 1
    requested = pg.eval_on_selector_all(
        "#multi table tr td:nth-child(3)", "els => els.map(e => e.textContent)"
    )
    assert requested and all(r not in ("omitted", "1") for r in requested)
    # denial reasons are written whole
    reasons = pg.eval_on_selector_all(
        "#chart-denials g.bar text:first-of-type", "els => els.map(e => e.textContent)"
    )
    assert "candidate_count_exceeds_policy" in reasons
    assert not any(r.endswith("…") for r in reasons)
    # a fallback route shows the requests it answered
    answered = pg.locator("#spend-route tr", has_text="secondary-chat").locator("td").nth(2)
    assert int(answered.inner_text().replace(",", "")) > 0
    assert blocked == []


def test_report_json_has_the_time_views(planted: Planted) -> None:
    reply = httpx.get(
        planted.server.url + "/dashboard/report.json?since=7d",
        headers={"Authorization": f"Bearer {planted.admin_key}"},
        timeout=60,
    )
    assert reply.status_code == 200
    timeline = reply.json()["timeline"]
    assert timeline["granularity"] == "day"
    flagged = {(c["workload_id"], c["metric"], c["bucket"]) for c in timeline["changes"]}
    assert ("support-draft", "requests", planted.dip.isoformat()) in flagged
    statuses = {(b["workload_id"], b["window"]): b["status"] for b in timeline["budgets"]}
    assert statuses[("support-eval", "day")] == "refusing"


def test_a_short_window_is_drawn_by_hour(page: tuple[Any, list[str], Any]) -> None:
    """Last in the file: it moves the shared page to the 24-hour window."""
    pg, blocked, _ = page
    response = pg.goto(pg.url.split("?")[0] + "?since=24h")
    assert response is not None and response.status == 200
    assert "by hour" in pg.inner_text("#changes h2")
    buckets = pg.eval_on_selector_all(
        "#trend-requests svg.series g.col", "els => els.map(e => e.dataset.bucket)"
    )
    assert buckets and all("T" in b for b in buckets)  # 2026-12-01T14: hourly buckets
    for view in ("changes", "trend-requests", "budgets"):
        pg.locator(f"section#{view}").screenshot(path=str(ARTIFACTS / f"dashboard-24h-{view}.png"))
    assert blocked == []
