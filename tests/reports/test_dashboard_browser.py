"""/dashboard in headless Chromium (Debian's, driven by Playwright) with the network cut.

Every request the page makes is routed through a handler that lets only the gateway
(127.0.0.1) through and aborts, and records, anything else: the test asserts nothing
else was even attempted. The screenshot is kept in ``tests/artifacts/`` (git-ignored).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from .dashboard_support import CANARY, WORKLOAD_KEY, Dashboard, dashboard_gateway

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
if shutil.which(CHROMIUM) is None:
    if os.environ.get("CI") == "true":  # .ci/run installs it: a missing browser is a failure
        raise RuntimeError(f"{CHROMIUM} is missing in CI (apt-get install -y chromium)")
    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def dash(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dashboard]:
    with dashboard_gateway(Path(tmp_path_factory.mktemp("dash-browser"))) as d:
        yield d


@pytest.fixture
def page() -> Iterator[tuple[Any, list[str]]]:
    blocked: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})

        def guard(route: Any) -> None:
            if urlsplit(route.request.url).hostname in ("127.0.0.1", "localhost"):
                route.continue_()
            else:
                blocked.append(route.request.url)
                route.abort()

        context.route("**/*", guard)
        try:
            yield context.new_page(), blocked
        finally:
            browser.close()


def _sign_in(pg: Any, dash: Dashboard, key: str) -> Any:
    pg.goto(dash.url)
    pg.fill("input[name=key]", key)
    with pg.expect_navigation():
        pg.click("button[type=submit]")
    return pg


def test_dashboard_renders_offline_with_charts(
    page: tuple[Any, list[str]], dash: Dashboard
) -> None:
    pg, blocked = page
    _sign_in(pg, dash, dash.admin_key)
    assert pg.title().startswith("ncap audit")
    charts = pg.locator("svg.chart")
    assert charts.count() >= 5
    values = [
        float(v)
        for v in pg.eval_on_selector_all(
            "svg.chart [data-value]", "els => els.map(e => e.getAttribute('data-value'))"
        )
    ]
    assert len(values) >= 10 and sum(v > 0 for v in values) >= 10
    widths = pg.eval_on_selector_all("#chart-spend rect", "els => els.map(e => e.getBBox().width)")
    assert max(widths) > 100  # the bars are drawn, not only present
    ARTIFACTS.mkdir(exist_ok=True)
    pg.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    assert blocked == []


def test_canary_workload_name_is_shown_as_text(
    page: tuple[Any, list[str]], dash: Dashboard
) -> None:
    pg, blocked = page
    _sign_in(pg, dash, dash.admin_key)
    assert pg.evaluate("typeof window.__canary") == "undefined"
    assert pg.locator("script").count() == 0
    assert CANARY in pg.inner_text("#spend")
    labels = pg.eval_on_selector_all("#chart-spend g.bar", "els => els.map(e => e.dataset.label)")
    assert CANARY in labels
    assert blocked == []


def test_a_workload_key_is_refused(page: tuple[Any, list[str]], dash: Dashboard) -> None:
    pg, blocked = page
    response = pg.goto(dash.url)
    assert response is not None and response.status == 401
    pg.fill("input[name=key]", WORKLOAD_KEY)
    with pg.expect_navigation() as nav:
        pg.click("button[type=submit]")
    assert nav.value is not None and nav.value.status == 403
    assert "not the admin key" in pg.inner_text("#message")
    assert pg.locator("svg").count() == 0
    assert pg.context.cookies() == []
    assert blocked == []
