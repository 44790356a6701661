"""Legacy ``/v1/completions`` through the gateway to the local engine (the embedded
default's SmolLM2): ``best_of`` ranked by the engine, whole and streamed, with ledger
rows."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ncap.config import Stores, default_config
from tests.http.test_accounting import settled_rows
from tests.support import ServerThread, gateway

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.engine

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def local_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Path]]:
    tmp = tmp_path_factory.mktemp("local-legacy")
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


def _client(gw: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def test_best_of_from_the_engine(local_gw: tuple[ServerThread, Path]) -> None:
    gw, tmp = local_gw
    raw = _client(gw).completions.with_raw_response.create(
        model="smollm2", prompt=PROMPT, n=2, best_of=3, max_tokens=6, temperature=1.0, seed=3
    )
    completion = raw.parse()
    assert completion.object == "text_completion"
    assert [c.index for c in completion.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in completion.choices)
    assert raw.headers["x-ncap-candidates-effective"] == "3"
    assert raw.headers["x-ncap-candidates-returned"] == "2"
    usage = completion.usage
    assert usage is not None and 0 < usage.completion_tokens <= 3 * 6
    (row,) = asyncio.run(settled_rows(tmp, raw.headers["x-request-id"]))
    assert (row.state, row.route_id) == ("settled", "local-smollm2")
    assert (row.effective_candidate_count, row.returned_candidate_count) == (3, 2)
    assert (row.input_tokens, row.output_tokens_total) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    assert row.reserved_output_tokens == 3 * 6


def test_stream_from_the_engine(local_gw: tuple[ServerThread, Path]) -> None:
    gw, tmp = local_gw
    raw = _client(gw).completions.with_raw_response.create(
        model="smollm2",
        prompt=PROMPT,
        n=2,
        max_tokens=6,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usages = []
    for chunk in raw.parse():
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1] and sorted(finish) == [0, 1]
    (usage,) = usages
    (row,) = asyncio.run(settled_rows(tmp, raw.headers["x-request-id"]))
    assert (row.state, row.stream_mode, row.returned_candidate_count) == ("settled", True, 2)
    assert row.output_tokens_total == usage.completion_tokens
