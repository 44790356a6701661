"""What a provider's own failure normalization (Gemini's) tells the lifecycle, and the
legacy completions kind on the plan, over scripted providers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from ncap.errors import InvalidRequest, RouteDoesNotSupportCandidates
from ncap.providers.base import AttemptFailed, UpstreamErrorDetail
from ncap.testing.scripted import Answer, Fail, ScriptedProvider, chat_body
from tests.lifecycle.harness import CALLER, harness, route, settled


def _refusal() -> Fail:
    """A provider's refusal of n > 1 (what ``providers.gemini`` reports for Gemini's
    400): the table says not retried, but the route's limit, not the request's fault."""
    return Fail(
        AttemptFailed(
            "status",
            400,
            error=UpstreamErrorDetail(
                "it accepts at most 1", code="route_does_not_support_candidates", param="n"
            ),
            max_candidates=1,
        )
    )


def _client_fault() -> Fail:
    return Fail(
        AttemptFailed(
            "status", 400, error=UpstreamErrorDetail("bad schema", param="response_format")
        )
    )


def _text_body(*texts: str) -> bytes:
    return msgspec.json.encode(
        {
            "id": "cmpl-up",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [
                {"text": t, "index": i, "logprobs": None, "finish_reason": "stop"}
                for i, t in enumerate(texts)
            ],
            "usage": {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13},
        }
    )


async def test_a_candidates_refusal_falls_back_without_retrying(tmp_path: Path) -> None:
    primary = ScriptedProvider([_refusal()])
    fallback = ScriptedProvider([Answer(chat_body("c0", "c1"))])
    h = harness(tmp_path, {"a": (route(), primary), "b": (route(), fallback)})
    reply = await h.chat(n=2, temperature=1.0)
    assert reply.status == 200 and reply.settling
    await settled(h.gateway)
    assert len(primary.sent) == 1 and len(fallback.sent) == 1
    rows = await h.rows()
    assert [(r.route_id, r.state) for r in rows] == [("a", "settled"), ("b", "settled")]
    assert rows[0].cost_micros == 0  # a refusal generated nothing
    assert rows[1].returned_candidate_count == 2


async def test_the_last_refusal_is_the_providers_client_error(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([_refusal()]))})
    with pytest.raises(RouteDoesNotSupportCandidates) as info:
        await h.chat(n=2, temperature=1.0)
    assert (info.value.param, str(info.value)) == ("n", "it accepts at most 1")
    assert await h.outstanding() == []


async def test_a_client_fault_neither_retries_nor_falls_back(tmp_path: Path) -> None:
    fallback = ScriptedProvider([])
    h = harness(
        tmp_path,
        {"a": (route(), ScriptedProvider([_client_fault()])), "b": (route(), fallback)},
    )
    with pytest.raises(InvalidRequest) as info:
        await h.chat()
    assert (info.value.param, info.value.message) == ("response_format", "Upstream: bad schema")
    assert fallback.sent == []
    assert [r.attempt for r in await h.rows()] == [1]


async def test_completions_reach_the_provider_as_the_legacy_kind(tmp_path: Path) -> None:
    provider = ScriptedProvider([Answer(_text_body("a", "b"))])
    h = harness(tmp_path, {"a": (route(), provider)})
    raw = msgspec.json.encode({"model": "m", "prompt": "p", "n": 2, "best_of": 4})
    reply = await h.gateway.completions(raw, CALLER, "req-1")
    assert reply.settling
    await settled(h.gateway)
    assert provider.kinds == ["completions"]
    sent: dict[str, Any] = dict(provider.sent[0])
    assert (sent["n"], sent["best_of"], sent["max_tokens"]) == (2, 4, 16)
    (row,) = await h.rows()
    assert (row.effective_candidate_count, row.returned_candidate_count) == (4, 2)
    assert row.state == "settled"  # two of four returned is what best_of means
    assert row.reserved_output_tokens == 4 * 16


async def test_best_of_above_n_is_refused_on_an_emulated_route(tmp_path: Path) -> None:
    emulate = {"candidates": "emulate", "max_candidates": 8}
    provider = ScriptedProvider([])
    h = harness(tmp_path, {"a": (route(emulate), provider)})
    raw = msgspec.json.encode({"model": "m", "prompt": "p", "n": 2, "best_of": 3})
    with pytest.raises(RouteDoesNotSupportCandidates) as info:
        await h.gateway.completions(raw, CALLER, "req-1")
    assert info.value.param == "best_of"
    (row,) = await h.rows()
    assert row.policy_result == "deny"
    assert provider.sent == []
