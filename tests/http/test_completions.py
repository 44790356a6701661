"""Legacy ``POST /v1/completions`` through the real gateway to the fake upstream, with the
official SDK: ``n`` and ``best_of``, whole and streamed, the
ncap headers and the ledger rows."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest

from ncap.testing.fake_upstream import FakeState
from tests.http.test_accounting import settled_rows
from tests.support import ServerThread, fake_upstream, gateway, gateway_config

PROMPT = "Once upon a time"


@pytest.fixture
def legacy(tmp_path: Path) -> Iterator[tuple[openai.OpenAI, FakeState, Path]]:
    with fake_upstream() as (url, state):
        gemini = {"provider": "gemini", "upstream_model": "gemini-2.5-flash"}
        config = gateway_config(url, tmp_path, models={"gem": ["g"]}, routes={"g": gemini})
        with gateway(config) as gw:
            yield _client(gw), state, tmp_path


def _client(gw: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)


def _last_body(state: FakeState) -> dict[str, Any]:
    body: dict[str, Any] = msgspec.json.decode(state.recent_bodies[-1])
    return body


def test_best_of_whole(legacy: tuple[openai.OpenAI, FakeState, Path]) -> None:
    client, state, tmp = legacy
    raw = client.completions.with_raw_response.create(
        model="fake-model", prompt=PROMPT, n=2, best_of=3, max_tokens=8
    )
    completion = raw.parse()
    assert completion.object == "text_completion"
    assert [c.index for c in completion.choices] == [0, 1]
    assert all(c.text for c in completion.choices)
    # best_of is the candidate count the policy saw and the reservation sized
    assert raw.headers["x-ncap-candidates-requested"] == "3"
    assert raw.headers["x-ncap-candidates-effective"] == "3"
    assert raw.headers["x-ncap-candidates-returned"] == "2"
    reserved = int(raw.headers["x-ncap-reserved-tokens"])
    sent = _last_body(state)
    assert (sent["n"], sent["best_of"], sent["max_tokens"]) == (2, 3, 8)
    assert sent["model"] == "fake-model"
    (row,) = asyncio.run(settled_rows(tmp, raw.headers["x-request-id"]))
    assert row.state == "settled"
    assert (row.requested_candidate_count, row.effective_candidate_count) == (3, 3)
    assert row.returned_candidate_count == 2
    assert row.reserved_output_tokens == 3 * 8
    assert row.reserved_input_tokens + row.reserved_output_tokens == reserved
    usage = completion.usage
    assert usage is not None
    # every candidate generated is billed, the unreturned one too
    per_choice = usage.completion_tokens / 3
    assert per_choice == int(per_choice)
    assert (row.input_tokens, row.output_tokens_total) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    assert row.stream_mode is False


def test_stream_demultiplexes_into_the_whole_answer(
    legacy: tuple[openai.OpenAI, FakeState, Path],
) -> None:
    client, _, tmp = legacy
    args: dict[str, Any] = {"model": "fake-model", "prompt": PROMPT, "n": 2, "max_tokens": 8}
    whole = client.completions.create(**args, best_of=2)
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usages = []
    raw = client.completions.with_raw_response.create(
        **args, best_of=2, stream=True, stream_options={"include_usage": True}
    )
    request_id = raw.headers["x-request-id"]
    assert raw.headers["x-ncap-candidates-effective"] == "2"
    for chunk in raw.parse():
        assert chunk.object == "text_completion"
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert len(usages) == 1 and whole.usage is not None
    assert usages[0].total_tokens == whole.usage.total_tokens
    (row,) = asyncio.run(settled_rows(tmp, request_id))
    assert (row.state, row.stream_mode, row.returned_candidate_count) == ("settled", True, 2)
    assert row.output_tokens_total == whole.usage.completion_tokens


def test_stream_without_include_usage_gets_no_usage_chunk(
    legacy: tuple[openai.OpenAI, FakeState, Path],
) -> None:
    client, state, tmp = legacy
    raw = client.completions.with_raw_response.create(
        model="fake-model", prompt=PROMPT, stream=True
    )
    chunks = list(raw.parse())
    assert chunks and all(c.usage is None for c in chunks)
    # the gateway asked for usage on its own behalf (the route's contract has it)
    assert _last_body(state)["stream_options"] == {"include_usage": True}
    assert _last_body(state)["max_tokens"] == 16  # OpenAI's legacy default, sent explicitly
    (row,) = asyncio.run(settled_rows(tmp, raw.headers["x-request-id"]))
    assert row.state == "settled"  # from the usage the client did not see
    assert row.reserved_output_tokens == 16  # reserved for what was sent


def test_max_tokens_zero_is_served(legacy: tuple[openai.OpenAI, FakeState, Path]) -> None:
    """The reference allows ``max_tokens: 0`` on the legacy endpoint (an echo of the
    prompt): found by the schemathesis run, it was a 500 (a reservation with a ceiling
    of 0); it is served, reserving one token a candidate."""
    client, state, tmp = legacy
    raw = client.completions.with_raw_response.create(
        model="fake-model", prompt=PROMPT, max_tokens=0, echo=True, n=2
    )
    assert raw.http_response.status_code == 200
    assert _last_body(state)["max_tokens"] == 0  # sent as asked
    (row,) = asyncio.run(settled_rows(tmp, raw.headers["x-request-id"]))
    assert row.reserved_output_tokens == 2


@pytest.mark.parametrize(
    ("args", "code", "param"),
    [
        ({"n": 3, "best_of": 2}, "invalid_value", "best_of"),
        ({"n": 1, "best_of": 2, "stream": True}, "invalid_value", "best_of"),
        # the count came from best_of: the refusal names it (param and message)
        ({"best_of": 5}, "candidate_count_exceeds_policy", "best_of"),
        ({"n": 5, "best_of": 5}, "candidate_count_exceeds_policy", "best_of"),
        ({"n": 5}, "candidate_count_exceeds_policy", "n"),
        ({"best_of": 2, "temperature": 0}, "candidates_with_greedy_sampling", "best_of"),
        ({"prompt": ["one", "two"]}, "invalid_value", "prompt"),
        ({"model": "gem"}, "invalid_value", "model"),
        ({"max_tokens": 9999}, "output_ceiling_exceeds_policy", "max_tokens"),
        ({"extra_body": {"messages": []}}, "unknown_parameter", "messages"),
    ],
)
def test_refusals_before_dispatch(
    legacy: tuple[openai.OpenAI, FakeState, Path], args: dict[str, Any], code: str, param: str
) -> None:
    client, state, _ = legacy
    body = {"model": "fake-model", "prompt": PROMPT, **args}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**body)
    error = info.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"]) == (code, param)
    if code == "candidate_count_exceeds_policy":
        assert error["message"].startswith(f"{param}=5 exceeds"), error["message"]
        assert f"Send {param} <= " in error["message"], error["message"]
    if code == "candidates_with_greedy_sampling":
        assert error["message"].startswith(f"{param}=2 with temperature 0"), error["message"]
    assert state.requests == 0
