# Inline wire JSON and case tables stay one case per line.
# ruff: noqa: E501

"""Deriving a route's contract record from its probe answers: honour n, ignore n, refuse
n, omit stream usage; output-cap semantics where usage reveals them; and the policy then
acting on the record. Canned answers inline, then the same through the fake Gemini and
the real translator."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import msgspec
import pytest

from ncap.config import Contract, Fingerprint
from ncap.domain.contracts import check_route
from ncap.domain.probe import (
    ProbeInconclusive,
    ProbeReply,
    StreamReply,
    derive_contract,
    probe_requests,
    stated_maximum,
)
from ncap.errors import RouteDoesNotSupportCandidates
from ncap.providers.gemini_errors import GeminiError, translate_error
from ncap.providers.gemini_response import decode_response, to_chat_completion
from ncap.providers.gemini_stream import GeminiStream, decode_stream_event
from ncap.testing.fake_gemini import FakeGemini, running_fake_gemini

NOW = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
PRINT = Fingerprint(provider="gemini", upstream_model="gemini-2.5-flash", gateway_version="0.1.0")
CEILING = 8


def _choice(index: int, finish: str = "stop") -> dict[str, Any]:
    message = {"role": "assistant", "content": "x", "refusal": None}
    return {"index": index, "finish_reason": finish, "message": message, "logprobs": None}


def _completion(
    *choices: dict[str, Any], completion: int = 6, reasoning: int = 0
) -> dict[str, Any]:
    return {
        "id": "chatcmpl-p",
        "object": "chat.completion",
        "created": 0,
        "model": "gemini-2.5-flash",
        "choices": list(choices),
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": completion,
            "total_tokens": 5 + completion,
            "completion_tokens_details": {"reasoning_tokens": reasoning},
        },
    }


def _chunk(index: int | None, usage: bool = False) -> dict[str, Any]:
    choices = (
        []
        if index is None
        else [{"index": index, "delta": {"content": "x"}, "finish_reason": None}]
    )
    chunk: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk", "choices": choices}
    if usage:
        chunk["usage"] = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    return chunk


def _refusal(
    message: str, code: str | None = "route_does_not_support_candidates"
) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": "n", "code": code}
    }


STREAM_N2_USAGE = StreamReply(200, [_chunk(0), _chunk(1), _chunk(0), _chunk(None, usage=True)])
STREAM_N1_NO_USAGE = StreamReply(200, [_chunk(0), _chunk(0)])

CASES: list[tuple[str, ProbeReply, StreamReply, dict[str, Any]]] = [
    (
        "honours n, stream with usage",
        ProbeReply(200, _completion(_choice(1), _choice(0))),
        STREAM_N2_USAGE,
        {
            "finding": "native",
            "candidates": "native",
            "max_candidates": 2,
            "stream_usage": "include_usage",
        },
    ),
    (
        "ignores n (one choice back): unsupported",
        ProbeReply(200, _completion(_choice(0))),
        STREAM_N1_NO_USAGE,
        {
            "finding": "ignored",
            "candidates": "unsupported",
            "max_candidates": 1,
            "stream_usage": "none",
        },
    ),
    (
        "refuses n with Gemini 3's 400 (as the translator relays it)",
        ProbeReply(
            400,
            _refusal(
                "The route's provider refused n > 1 (Upstream: Multiple candidates is not enabled "
                "for this model); it accepts at most 1 candidate(s). Send n <= 1."
            ),
        ),
        StreamReply(200, [_chunk(0), _chunk(None, usage=True)]),
        {
            "finding": "refused",
            "candidates": "unsupported",
            "max_candidates": 1,
            "stream_usage": "include_usage",
            "stated": 1,
        },
    ),
    (
        "refuses n with an OpenAI-style 400 on param n",
        ProbeReply(
            400,
            _refusal(
                "Invalid 'n': integer above maximum value. Expected a value <= 1.",
                code="invalid_value",
            ),
        ),
        STREAM_N1_NO_USAGE,
        {
            "finding": "refused",
            "candidates": "unsupported",
            "max_candidates": 1,
            "stream_usage": "none",
            "stated": 1,
        },
    ),
    (
        "honours n but omits stream usage",
        ProbeReply(200, _completion(_choice(0), _choice(1))),
        StreamReply(200, [_chunk(0), _chunk(1)]),
        {"finding": "native", "candidates": "native", "max_candidates": 2, "stream_usage": "none"},
    ),
    (
        "honours n without a stream but the stream ignores it: not trusted",
        ProbeReply(200, _completion(_choice(0), _choice(1))),
        StreamReply(200, [_chunk(0), _chunk(None, usage=True)]),
        {
            "finding": "stream_mismatched",
            "candidates": "unsupported",
            "max_candidates": 1,
            "stream_usage": "include_usage",
        },
    ),
    (
        "returns three choices for n=2: mismatched, unsupported",
        ProbeReply(200, _completion(_choice(0), _choice(1), _choice(2))),
        STREAM_N2_USAGE,
        {"finding": "mismatched", "candidates": "unsupported", "max_candidates": 1},
    ),
    (
        "two choices both at index 0: mismatched",
        ProbeReply(200, _completion(_choice(0), _choice(0))),
        STREAM_N2_USAGE,
        {"finding": "mismatched", "candidates": "unsupported"},
    ),
]


@pytest.mark.parametrize(
    ("reply", "stream", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_derivation(reply: ProbeReply, stream: StreamReply, expected: dict[str, Any]) -> None:
    findings = derive_contract(
        reply,
        stream,
        requested_n=2,
        ceiling=CEILING,
        previous=Contract(),
        fingerprint=PRINT,
        now=NOW,
    )
    contract = findings.contract
    assert findings.candidates == expected["finding"]
    assert contract.candidates == expected["candidates"]
    for key in ("max_candidates", "stream_usage"):
        if key in expected:
            assert getattr(contract, key) == expected[key]
    assert findings.stated_maximum == expected.get("stated")
    assert (contract.verified_at, contract.fingerprint) == (NOW, PRINT)


@pytest.mark.parametrize(
    ("choices", "completion", "reasoning", "previous", "cap"),
    [
        ([_choice(0, "length"), _choice(1, "length")], 16, 0, "shared", "per_candidate"),
        ([_choice(0, "length"), _choice(1, "stop")], 8, 0, "per_candidate", "shared"),
        # reasoning is not visible output: 24 visible of 40 are above one ceiling
        ([_choice(0, "length"), _choice(1, "length")], 40, 16, "shared", "per_candidate"),
        # little visible output with reasoning proves nothing (thoughts spend the budget)
        ([_choice(0, "length"), _choice(1, "length")], 40, 32, "per_candidate", "per_candidate"),
        # nothing reached the ceiling: not revealed, the previous value stays
        ([_choice(0), _choice(1)], 6, 0, "shared", "shared"),
    ],
)
def test_output_cap_where_usage_reveals_it(
    choices: list[dict[str, Any]], completion: int, reasoning: int, previous: str, cap: str
) -> None:
    findings = derive_contract(
        ProbeReply(200, _completion(*choices, completion=completion, reasoning=reasoning)),
        STREAM_N2_USAGE,
        requested_n=2,
        ceiling=CEILING,
        previous=Contract(output_cap=previous),  # type: ignore[arg-type]
        fingerprint=PRINT,
        now=NOW,
    )
    assert findings.contract.output_cap == cap


def test_previous_record_keeps_max_age_emulate_and_a_larger_native_maximum() -> None:
    honour = ProbeReply(200, _completion(_choice(0), _choice(1)))
    kept = derive_contract(
        honour,
        STREAM_N2_USAGE,
        requested_n=2,
        ceiling=CEILING,
        previous=Contract(candidates="native", max_candidates=8, max_age="30d"),
        fingerprint=PRINT,
        now=NOW,
    )
    assert (kept.contract.max_candidates, kept.contract.max_age) == (8, "30d")
    emulated = derive_contract(
        ProbeReply(200, _completion(_choice(0))),
        STREAM_N1_NO_USAGE,
        requested_n=2,
        ceiling=CEILING,
        previous=Contract(candidates="emulate", max_candidates=4),
        fingerprint=PRINT,
        now=NOW,
    )
    assert (emulated.contract.candidates, emulated.contract.max_candidates) == ("emulate", 4)


@pytest.mark.parametrize(
    ("reply", "stream"),
    [
        (
            ProbeReply(429, {"error": {"code": "rate_limit_exceeded", "message": "quota"}}),
            STREAM_N2_USAGE,
        ),
        (
            ProbeReply(502, {"error": {"code": "upstream_error", "message": "credential"}}),
            STREAM_N2_USAGE,
        ),
        (
            ProbeReply(
                400, {"error": {"code": "invalid_value", "param": "temperature", "message": "x"}}
            ),
            STREAM_N2_USAGE,
        ),
        (
            ProbeReply(200, _completion(_choice(0), _choice(1))),
            StreamReply(503, error={"error": {"code": "server_is_overloaded"}}),
        ),
    ],
    ids=["429", "502", "400 about another field", "stream 503"],
)
def test_failures_that_prove_nothing_are_inconclusive(
    reply: ProbeReply, stream: StreamReply
) -> None:
    with pytest.raises(ProbeInconclusive):
        derive_contract(
            reply,
            stream,
            requested_n=2,
            ceiling=CEILING,
            previous=Contract(),
            fingerprint=PRINT,
            now=NOW,
        )


@pytest.mark.parametrize(
    ("message", "maximum"),
    [
        ("it accepts at most 4 candidate(s). Send n <= 4.", 4),
        ("Expected a value <= 8.", 8),
        ("supported range is from 1 (inclusive) to 9 (exclusive)", 8),
        ("candidateCount must be 1 but the entered value was 3", 1),
        ("n is not supported with this model", None),
    ],
)
def test_stated_maximum(message: str, maximum: int | None) -> None:
    assert stated_maximum(message) == maximum


# --- through the fake Gemini and the real translator; the policy acts on the record ---


@pytest.fixture
async def fake() -> AsyncIterator[FakeGemini]:
    async with running_fake_gemini() as running:
        yield running


async def _probe_replies(fake: FakeGemini, fault: str) -> tuple[ProbeReply, StreamReply]:
    """What the gemini provider would hand the probe: the translator's OpenAI answers."""
    body = {
        "contents": [{"role": "user", "parts": [{"text": "Say hi."}]}],
        "generationConfig": {"candidateCount": 2, "maxOutputTokens": CEILING},
    }
    url = f"{fake.base_url}/models/gemini-2.5-flash"
    headers = {"x-fake-fault": fault, "x-goog-api-key": "k"}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.post(f"{url}:generateContent", json=body) as r:
            status, raw = r.status, await r.read()
        if status == 200:
            completion = to_chat_completion(
                decode_response(raw), completion_id="p", created=0, model="m"
            )
            reply = ProbeReply(200, msgspec.to_builtins(completion))
        else:
            error = translate_error(status, raw)
            reply = ProbeReply(error.status, error.as_ncap_error().envelope())
        if status != 200:
            body["generationConfig"] = {"maxOutputTokens": CEILING}  # the stream probe at n=1
        async with http.post(f"{url}:streamGenerateContent", params={"alt": "sse"}, json=body) as r:
            events = (await r.read()).split(b"\r\n\r\n")[:-1]
    stream = GeminiStream(completion_id="p", created=0, model="m")
    chunks = [
        c for e in events for c in stream.feed(decode_stream_event(e.removeprefix(b"data: ")))
    ]
    return reply, StreamReply(200, [msgspec.to_builtins(c) for c in chunks + stream.close()])


@pytest.mark.parametrize(
    ("fault", "candidates", "stream_usage", "n3_refused"),
    [
        ("none", "native", "include_usage", False),
        ("ignore_candidates", "unsupported", "include_usage", True),
        ("refuse_candidates", "unsupported", "include_usage", True),
        ("stream_no_usage", "native", "none", False),
    ],
)
async def test_probe_of_the_fake_gemini_and_the_policy_acting_on_it(
    fake: FakeGemini, fault: str, candidates: str, stream_usage: str, n3_refused: bool
) -> None:
    reply, stream = await _probe_replies(fake, fault)
    findings = derive_contract(
        reply,
        stream,
        requested_n=2,
        ceiling=CEILING,
        previous=Contract(max_age="30d"),
        fingerprint=PRINT,
        now=NOW,
    )
    contract = findings.contract
    assert (contract.candidates, contract.stream_usage) == (candidates, stream_usage)
    if candidates == "native":  # both candidates stop at the ceiling: usage reveals the cap
        assert contract.output_cap == "per_candidate"
    later = NOW + timedelta(days=1)
    check_route(contract, "gem", 1, now=later, expected_fingerprint=PRINT)  # n=1 always served
    if n3_refused:
        with pytest.raises(RouteDoesNotSupportCandidates) as caught:
            check_route(contract, "gem", 2, now=later, expected_fingerprint=PRINT)
        assert (caught.value.code, caught.value.param) == ("route_does_not_support_candidates", "n")
    else:
        check_route(contract, "gem", 2, now=later, expected_fingerprint=PRINT)
        with pytest.raises(RouteDoesNotSupportCandidates):  # verified for 2, not 3
            check_route(contract, "gem", 3, now=later, expected_fingerprint=PRINT)


def test_gemini_error_is_what_a_lifecycle_failure_wraps() -> None:
    """The probe's refusal input comes from GeminiError.as_ncap_error(): pin the bridge."""
    error = translate_error(
        400,
        b'{"error": {"code": 400, "message": "Multiple candidates is not enabled for this model", "status": "INVALID_ARGUMENT"}}',
    )
    assert isinstance(error, GeminiError)
    envelope = error.as_ncap_error().envelope()
    findings = derive_contract(
        ProbeReply(error.status, envelope),
        STREAM_N1_NO_USAGE,
        requested_n=2,
        ceiling=CEILING,
        previous=Contract(),
        fingerprint=PRINT,
        now=NOW,
    )
    assert (findings.candidates, findings.stated_maximum) == ("refused", 1)


def test_probe_requests_validate_and_ask_for_stream_usage() -> None:
    from ncap.protocol.validate import parse_chat_request

    plain, streamed = probe_requests("gem-alias", ceiling=CEILING)
    for body in (plain, streamed):
        _, request = parse_chat_request(msgspec.json.encode(body))
        assert (request.n, request.max_completion_tokens, request.model) == (
            2,
            CEILING,
            "gem-alias",
        )
    assert streamed["stream"] is True and streamed["stream_options"] == {"include_usage": True}
    assert "stream" not in plain
