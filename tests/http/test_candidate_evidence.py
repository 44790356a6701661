"""How different the candidates were, through the real gateway with the official SDK:
the fakes return candidates duplicated at set rates (``x-fake-candidates``), and the
ledger's ``candidates_*`` columns and the answer's headers are exact, on a native
route, an emulated (fan-out) route and a Gemini route, non-streamed and streamed."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from typer.testing import CliRunner

from ncap.cli.main import app as cli
from ncap.domain.events import LedgerEvent
from ncap.stores import SQLiteLedgerStore
from ncap.testing.fake_gemini import create_gemini_app
from ncap.testing.fake_upstream import create_app as create_fake_app
from tests.http.test_accounting import settled_rows
from tests.support import ServerThread, gateway, gateway_config

GEMINI_KEY_ENV = "NCAP_TEST_EVIDENCE_GEMINI_KEY"
MESSAGES: list[Any] = [{"role": "user", "content": "Which city?"}]
# pattern -> (compared, distinct, majority, tool_calls)
CASES = {
    "a,a,a,b,c": (5, 3, 3, 0),
    "a,tool:f,tool:f,tool:g,a": (5, 3, 2, 3),
    "a,b": (2, 2, 1, 0),
    "a,a,a,a": (4, 1, 4, 0),
}
ROUTES = ("native", "emulated", "gem")
USAGE = {"stream_usage": "include_usage"}


@pytest.fixture(scope="module")
def upstreams() -> Iterator[tuple[str, str]]:
    fake = ServerThread(lambda: create_fake_app(None)).start()
    gem = ServerThread(lambda: create_gemini_app(api_key="k")).start()
    try:
        assert fake.app is not None and gem.app is not None
        yield fake.url + "/v1", gem.url + "/v1beta"
    finally:
        fake.stop()
        gem.stop()


def _config(upstreams: tuple[str, str], tmp: Path, pattern: str) -> Any:
    fake_url, gem_url = upstreams
    headers = {"x-fake-candidates": pattern}
    openai_route = {
        "provider": "openai",
        "base_url": fake_url,
        "upstream_model": "fake-model",
        "headers": headers,
        "pricing": {"input_per_mtok": 0.15, "output_per_mtok": 0.6},
    }
    return gateway_config(
        fake_url,
        tmp,
        workloads={"default": {"max_candidates": 8, "output_ceiling": 256}},
        models={"native": ["native"], "emulated": ["emulated"], "gem": ["gem"]},
        routes={
            "native": {
                **openai_route,
                "contract": {"candidates": "native", "max_candidates": 8, **USAGE},
            },
            "emulated": {
                **openai_route,
                "contract": {"candidates": "emulate", "max_candidates": 8, **USAGE},
            },
            "gem": {
                "provider": "gemini",
                "base_url": gem_url,
                "upstream_model": "gemini-2.5-flash",
                "api_key_env": GEMINI_KEY_ENV,
                "headers": headers,
                "pricing": {"input_per_mtok": 0.3, "output_per_mtok": 2.5},
                "contract": {
                    "candidates": "native",
                    "max_candidates": 8,
                    "stream_usage": "include_usage",
                },
            },
        },
    )


def _columns(row: LedgerEvent) -> tuple[int | None, ...]:
    return (
        row.candidates_compared,
        row.candidates_distinct,
        row.candidates_majority,
        row.candidates_tool_calls,
    )


def _check_rows(rows: list[LedgerEvent], route: str, expected: tuple[int, ...]) -> None:
    """The evidence on the row that returned the candidates (an emulated fan-out's
    first branch), null on the others; every row settled."""
    assert all(r.state == "settled" for r in rows), rows
    if route == "emulated":
        assert len(rows) == expected[0]  # one branch per candidate
        assert _columns(rows[0]) == expected
        assert all(_columns(r) == (None,) * 4 for r in rows[1:])
    else:
        (row,) = rows
        assert _columns(row) == expected
        assert row.returned_candidate_count == expected[0]


@pytest.mark.parametrize("pattern", list(CASES))
def test_non_streamed_evidence_is_exact(
    upstreams: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pattern: str
) -> None:
    monkeypatch.setenv(GEMINI_KEY_ENV, "k")
    expected = CASES[pattern]
    n = expected[0]
    with gateway(_config(upstreams, tmp_path, pattern)) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        for route in ROUTES:
            raw = client.chat.completions.with_raw_response.create(
                model=route, messages=MESSAGES, n=n, temperature=1.0
            )
            answer = raw.parse()
            assert len(answer.choices) == n
            assert raw.headers["x-ncap-candidates-distinct"] == str(expected[1])
            assert raw.headers["x-ncap-candidates-agreement"] == f"{expected[2] / n:.3f}"
            rows = asyncio.run(settled_rows(tmp_path, raw.headers["x-request-id"], _rows(route, n)))
            _check_rows(rows, route, expected)


def _rows(route: str, n: int) -> int:
    return n if route == "emulated" else 1


def test_one_candidate_has_no_evidence(
    upstreams: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(GEMINI_KEY_ENV, "k")
    with gateway(_config(upstreams, tmp_path, "solo")) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        for route in ("native", "gem"):
            raw = client.chat.completions.with_raw_response.create(model=route, messages=MESSAGES)
            assert "x-ncap-candidates-distinct" not in raw.headers
            assert "x-ncap-candidates-agreement" not in raw.headers
            (row,) = asyncio.run(settled_rows(tmp_path, raw.headers["x-request-id"]))
            assert _columns(row) == (None,) * 4


@pytest.mark.parametrize("pattern", list(CASES))
def test_streamed_evidence_is_exact(
    upstreams: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pattern: str
) -> None:
    """The same counts from the chunks, fed per ``index`` as they pass (a tool call's
    arguments arrive in fragments on the OpenAI fake)."""
    monkeypatch.setenv(GEMINI_KEY_ENV, "k")
    expected = CASES[pattern]
    n = expected[0]
    with gateway(_config(upstreams, tmp_path, pattern)) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        for route in ROUTES:
            with client.chat.completions.with_streaming_response.create(
                model=route, messages=MESSAGES, n=n, temperature=1.0, stream=True
            ) as response:
                request_id = response.headers["x-request-id"]
                assert "x-ncap-candidates-distinct" not in response.headers
                indexes = {c.index for chunk in response.parse() for c in chunk.choices}
            assert indexes == set(range(n))
            rows = asyncio.run(settled_rows(tmp_path, request_id, _rows(route, n)))
            _check_rows(rows, route, expected)


def test_a_cut_stream_records_no_evidence(
    upstreams: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not every candidate arrived: nothing is compared (the row stays pending)."""
    monkeypatch.setenv(GEMINI_KEY_ENV, "k")
    config = _config(upstreams, tmp_path, "a,a,b")
    config.routes["native"].headers["x-fake-fault"] = "truncated_stream=6"
    with gateway(config) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        with client.chat.completions.with_streaming_response.create(
            model="native", messages=MESSAGES, n=3, temperature=1.0, stream=True
        ) as response:
            request_id = response.headers["x-request-id"]
            with pytest.raises(openai.APIError):
                for _ in response.parse():
                    pass
        (row,) = asyncio.run(settled_rows(tmp_path, request_id))
    assert row.state == "pending"
    assert _columns(row) == (None,) * 4


CANARY = "CANARY-ev-9d2c"


def test_canaries_never_reach_ledger_exports_metrics_or_logs(
    upstreams: tuple[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Prompts and completions (text and tool calls) carrying a canary, non-streamed
    and streamed, on every kind of route: the canary is in no ledger file, no export
    (JSONL, CSV, the audit's JSON), no metric and no log record; the evidence columns
    hold small integers."""
    monkeypatch.setenv(GEMINI_KEY_ENV, "k")
    caplog.set_level(logging.DEBUG)
    tool = f"tool:{CANARY}"
    config = _config(upstreams, tmp_path, f"{tool},{tool},a")
    messages = [
        {"role": "system", "content": f"system {CANARY}"},
        {"role": "user", "content": f"user {CANARY}"},
    ]
    with gateway(config) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        seen = []
        for route in ROUTES:
            whole = client.chat.completions.create(model=route, messages=messages, n=3)
            seen.append(json.dumps(whole.model_dump()))
            stream = client.chat.completions.create(
                model=route, messages=messages, n=3, stream=True
            )
            seen.extend(json.dumps(chunk.model_dump()) for chunk in stream)
        assert sum(CANARY in text for text in seen) > 6  # the answers did carry it
        metrics = httpx.get(gw.url + "/metrics").text
        assert "ncap_candidates_distinct_share_count" in metrics
    rows = asyncio.run(_all_rows(tmp_path))
    evidence = [_columns(r) for r in rows if r.candidates_compared is not None]
    assert evidence == [(3, 2, 2, 2)] * 6  # every answer compared, as small integers
    cfg = tmp_path / "ncap.yaml"
    cfg.write_text(yaml.safe_dump(_plain(config)))
    outputs = [metrics]
    for args in (
        ["ledger", "export", "--format", "jsonl"],
        ["ledger", "export", "--format", "csv"],
        ["audit", "--format", "json"],
        ["report", "candidates", "--format", "json"],
    ):
        result = CliRunner().invoke(cli, [*args, "--config", str(cfg)])
        assert result.exit_code == 0, result.output
        outputs.append(result.stdout)
    assert '"candidates_distinct": 2' in outputs[1]
    files = b"".join(p.read_bytes() for p in tmp_path.glob("ledger.db*"))
    records = [r.getMessage() + str(r.args) for r in caplog.records]
    assert records  # the gateway did log (access lines, requests)
    for text in [*outputs, *records, files.decode("latin-1")]:
        assert CANARY not in text
        assert CANARY.lower() not in text.lower()


async def _all_rows(tmp: Path) -> list[LedgerEvent]:
    store = SQLiteLedgerStore(tmp / "ledger.db")
    try:
        return [e async for e in store.export()]
    finally:
        await store.close()


def _plain(config: Any) -> dict[str, Any]:
    """The config's stores and workloads as YAML-ready data (for the CLI)."""
    return {
        "stores": {"ledger": config.stores.ledger, "budgets": "memory://"},
        "workloads": {"default": {"max_candidates": 8}},
    }
