"""Candidate evidence on the local engine (the real SmolLM2 through the gateway, the
official SDK): the ledger's counts equal those worked out by hand from the texts the
client received, non-streamed and streamed. Short answers at a low temperature make
duplicates likely; the seeds below give some (asserted, so the check is not vacuous)."""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ncap.config import Stores, default_config
from tests.engine._require import require_engine
from tests.http.test_accounting import settled_rows
from tests.support import ServerThread, gateway

require_engine()
pytestmark = pytest.mark.engine

MESSAGES = [{"role": "user", "content": "Say yes or no."}]
ARGS = {"model": "smollm2", "messages": MESSAGES, "n": 4, "max_tokens": 2, "temperature": 0.3}


@pytest.fixture(scope="module")
def local_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Path]]:
    tmp = tmp_path_factory.mktemp("local-evidence")
    base = default_config()
    route = base.routes["local-smollm2"].model_copy(update={"threads": 2, "n_ctx": 1024})
    config = base.model_copy(
        update={
            "stores": Stores(ledger=f"sqlite:///{tmp}/ledger.db", budgets=f"sqlite:///{tmp}/b.db"),
            "routes": {"local-smollm2": route},
        }
    )
    with gateway(config) as gw:
        yield gw, tmp


def _by_hand(texts: list[str]) -> tuple[int, int, int, int]:
    """(compared, distinct, majority, tool calls) with whitespace runs as one space."""
    groups = Counter(" ".join(t.split()) for t in texts)
    return len(texts), len(groups), max(groups.values()), 0


def _columns(tmp: Path, request_id: str) -> tuple[int | None, ...]:
    (row,) = asyncio.run(settled_rows(tmp, request_id))
    return (
        row.candidates_compared,
        row.candidates_distinct,
        row.candidates_majority,
        row.candidates_tool_calls,
    )


def test_local_evidence_matches_the_texts(local_gw: tuple[ServerThread, Path]) -> None:
    gw, tmp = local_gw
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused")
    duplicates = 0
    for seed in (1, 2, 3):
        raw = client.chat.completions.with_raw_response.create(**ARGS, seed=seed)  # type: ignore[call-overload]
        texts = [c.message.content or "" for c in raw.parse().choices]
        expected = _by_hand(texts)
        assert _columns(tmp, raw.headers["x-request-id"]) == expected
        assert raw.headers["x-ncap-candidates-distinct"] == str(expected[1])
        duplicates += expected[1] < expected[0]

        streamed: dict[int, str] = defaultdict(str)
        with client.chat.completions.with_streaming_response.create(
            **ARGS,
            seed=seed,
            stream=True,  # type: ignore[call-overload]
        ) as response:
            request_id = response.headers["x-request-id"]
            for chunk in response.parse():
                for choice in chunk.choices:
                    streamed[choice.index] += choice.delta.content or ""
        expected = _by_hand([streamed[i] for i in sorted(streamed)])
        assert _columns(tmp, request_id) == expected
        duplicates += expected[1] < expected[0]
    assert duplicates > 0  # some answers had identical candidates: the counts were tested
