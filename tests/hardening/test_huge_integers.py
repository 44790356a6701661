"""Integers past SQLite's 64-bit range in a request (found by the x5 schemathesis run:
a legacy ``max_tokens`` of 2**63 or more was a 500: its ``output_ceiling`` refusal
records the amount asked in ``denied_amount``, and the SQLite ledger raised
``OverflowError`` writing it; chat's ``max_tokens`` and ``max_completion_tokens`` did the
same). The refusal stands, the row is written with the amount capped at
``LEDGER_INT_MAX``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ncap.domain.events import LedgerEvent
from ncap.stores import SQLiteLedgerStore
from ncap.testing.fake_upstream import FakeState
from tests.support import fake_upstream, gateway, gateway_config

INT64_MAX = 2**63 - 1  # SQLite INTEGER, PostgreSQL BIGINT (``events.LEDGER_INT_MAX``)
HUGE = [INT64_MAX, 2**63, 10**20, 2**200]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, FakeState, Path]]:
    tmp = tmp_path_factory.mktemp("huge")
    with fake_upstream() as (url, state), gateway(gateway_config(url, tmp)) as server:
        yield server.url, state, tmp


def _rows(tmp: Path) -> list[LedgerEvent]:
    async def read() -> list[LedgerEvent]:
        store = SQLiteLedgerStore(tmp / "ledger.db")
        try:
            return [e async for e in store.export()]
        finally:
            await store.close()

    return asyncio.run(read())


@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize(
    ("path", "field", "base"),
    [
        ("/v1/completions", "max_tokens", {"prompt": "Once"}),
        ("/v1/chat/completions", "max_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
        (
            "/v1/chat/completions",
            "max_completion_tokens",
            {"messages": [{"role": "user", "content": "hi"}]},
        ),
    ],
)
def test_huge_output_ceiling_is_a_policy_refusal_not_a_500(
    gw: tuple[str, FakeState, Path], path: str, field: str, base: dict[str, Any], value: int
) -> None:
    url, state, tmp = gw
    before = state.requests
    body = {"model": "fake-model", **base, field: value}
    r = httpx.post(url + path, json=body, headers={"Authorization": "Bearer none"}, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("output_ceiling_exceeds_policy", field), error
    assert state.requests == before  # refused before dispatch
    rid = r.headers["x-request-id"]
    (row,) = [e for e in _rows(tmp) if e.request_id == rid]
    assert row.state == "denied"
    assert (row.denied_by, row.denied_limit) == ("output_ceiling", 256)
    assert row.denied_amount == min(value, INT64_MAX)  # what was asked, as far as it fits


@pytest.mark.parametrize("value", [2**63, 2**64 + 7, 10**30, -(2**63) - 1])
@pytest.mark.parametrize(
    ("path", "field", "base"),
    [
        ("/v1/chat/completions", "n", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/chat/completions", "seed", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/chat/completions", "top_logprobs", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/completions", "best_of", {"prompt": "Once"}),
        ("/v1/completions", "n", {"prompt": "Once"}),
    ],
)
def test_other_huge_integers_are_client_errors(
    gw: tuple[str, FakeState, Path], path: str, field: str, base: dict[str, Any], value: int
) -> None:
    url, _, _ = gw
    body = {"model": "fake-model", **base, field: value}
    r = httpx.post(url + path, json=body, headers={"Authorization": "Bearer none"}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
