"""The gateway's embedded default (route ``local-smollm2``, alias ``smollm2``) with the
official SDK: n=4 from the real SmolLM2, through policy, reservation and the ledger."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ncap.config import Stores, default_config
from tests.engine._require import require_engine
from tests.http.test_accounting import settled_rows
from tests.support import ServerThread, gateway
from tests.wire import validate_chunk, validate_response

require_engine()
pytestmark = pytest.mark.engine

MESSAGES = [{"role": "user", "content": "Write one short sentence about rain."}]


@pytest.fixture(scope="module")
def local_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Path]]:
    tmp = tmp_path_factory.mktemp("local")
    base = default_config()
    route = base.routes["local-smollm2"].model_copy(update={"threads": 2, "n_ctx": 2048})
    config = base.model_copy(
        update={
            "stores": Stores(ledger=f"sqlite:///{tmp}/ledger.db", budgets=f"sqlite:///{tmp}/b.db"),
            "routes": {"local-smollm2": route},
        }
    )
    with gateway(config) as gw:
        yield gw, tmp


def test_sdk_n4_from_smollm2_through_the_gateway(local_gw: tuple[ServerThread, Path]) -> None:
    gw, tmp = local_gw
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused")
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2", messages=MESSAGES, n=4, temperature=1.0, max_tokens=24, seed=7
    )
    validate_response(raw.http_response.json())
    completion = raw.parse()
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert all(c.message.content for c in completion.choices)
    assert len({c.message.content for c in completion.choices}) > 1
    usage = completion.usage
    assert usage is not None and 0 < usage.completion_tokens <= 4 * 24
    assert raw.headers["x-ncap-candidates-returned"] == "4"
    (event,) = asyncio.run(settled_rows(tmp, raw.headers["x-request-id"]))
    assert (event.state, event.route_id, event.returned_candidate_count) == (
        "settled",
        "local-smollm2",
        4,
    )
    assert (event.input_tokens, event.output_tokens_total) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )


def test_stream_through_the_gateway_matches_non_stream(
    local_gw: tuple[ServerThread, Path],
) -> None:
    gw, _ = local_gw
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused")
    args = {"model": "smollm2", "messages": MESSAGES, "n": 3, "max_tokens": 16, "seed": 11}
    plain = client.chat.completions.create(**args)  # type: ignore[call-overload]
    text: dict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(**args, stream=True):  # type: ignore[call-overload]
        validate_chunk(chunk.model_dump(exclude_unset=True))
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert dict(text) == {c.index: c.message.content for c in plain.choices}
    assert finish == {c.index: c.finish_reason for c in plain.choices}


def test_policy_caps_the_local_demo_at_four(local_gw: tuple[ServerThread, Path]) -> None:
    gw, _ = local_gw
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=MESSAGES, n=5)  # type: ignore[arg-type]
    assert info.value.code == "candidate_count_exceeds_policy"


def test_context_overflow_is_a_400_and_an_attempt_that_cost_nothing(
    local_gw: tuple[ServerThread, Path],
) -> None:
    gw, tmp = local_gw
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    long_text = "rain " * 3000  # well past the route's n_ctx of 2048
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.with_raw_response.create(
            model="smollm2", messages=[{"role": "user", "content": long_text}], max_tokens=8
        )
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "messages"
    request_id = info.value.response.headers["x-request-id"]
    (event,) = asyncio.run(settled_rows(tmp, request_id))
    assert (event.state, event.cost_micros, event.returned_candidate_count) == ("settled", 0, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_local_engine_records_each_choice_tokens(
    local_gw: tuple[ServerThread, Path], stream: bool
) -> None:
    """The engine's per-sequence counts reach the ledger, in index order, summing to
    the total; the wire output is unchanged (usage stays one aggregate)."""
    gw, tmp = local_gw
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused")
    args: dict[str, object] = {"n": 3, "temperature": 1.0, "max_tokens": 12, "seed": 3}
    if stream:
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            **args,  # type: ignore[arg-type]
        )
        chunks = list(raw.parse())
        assert all("output_tokens_per_choice" not in c.model_dump_json() for c in chunks)
    else:
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2",
            messages=MESSAGES,
            **args,  # type: ignore[arg-type]
        )
        assert "per_choice" not in raw.http_response.text
    (event,) = asyncio.run(settled_rows(tmp, raw.headers["x-request-id"]))
    per_choice = event.output_tokens_per_choice
    assert per_choice is not None and len(per_choice) == 3
    assert sum(per_choice) == event.output_tokens_total
    assert all(1 <= t <= 12 for t in per_choice)
