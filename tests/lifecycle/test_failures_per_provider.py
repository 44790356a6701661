"""Every provider's translated errors go through the one failure table: each provider
reports facts only (status, OpenAI code, message), and the table alone decides the
ledger outcome, the client's error, the retry and the fallback. The same upstream
situation ends the same way whichever provider's words it came in."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from ncap.lifecycle.failures import classify, client_error, ledger_outcome, may_fall_back, retryable
from ncap.protocol.anthropic import AnthropicErrorBody
from ncap.providers.anthropic_errors import anthropic_failure, stream_failure
from ncap.providers.base import AttemptFailed
from ncap.providers.gemini_errors import GeminiError, as_attempt_failed, gemini_failure
from ncap.providers.openai_passthrough import azure_failure, openai_failure

FailureOf = Callable[[int, Mapping[str, str], bytes], AttemptFailed]


def _openai(message: str, code: str | None = None, param: str | None = None) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return json.dumps({"error": error}).encode()


def _azure(message: str, code: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": message}}).encode()


def _anthropic(kind: str, message: str) -> bytes:
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


def _gemini(status: int, grpc: str, message: str) -> bytes:
    return json.dumps({"error": {"code": status, "status": grpc, "message": message}}).encode()


# provider, failure_of, status, body, headers → class, client (status, code), retry, fallback
CASES: list[tuple[str, FailureOf, int, bytes, dict[str, str], str, tuple[int, str | None],
                  bool, bool]] = [
    # a rate limit, in each provider's words
    ("openai", openai_failure, 429, _openai("Rate limit", "rate_limit_exceeded"),
     {"retry-after": "2"}, "rate_limited", (429, "rate_limit_exceeded"), True, True),
    ("azure", azure_failure, 429, _azure("Requests exceeded the rate limit", "429"),
     {"retry-after-ms": "2000"}, "rate_limited", (429, "rate_limit_exceeded"), True, True),
    ("anthropic", anthropic_failure, 429, _anthropic("rate_limit_error", "slow down"),
     {"retry-after": "2"}, "rate_limited", (429, "rate_limit_exceeded"), True, True),
    ("gemini", gemini_failure, 429, _gemini(429, "RESOURCE_EXHAUSTED", "quota"),
     {"retry-after": "2"}, "rate_limited", (429, "rate_limit_exceeded"), True, True),
    # overloaded
    ("openai", openai_failure, 503, _openai("overloaded"), {}, "overloaded",
     (503, "server_is_overloaded"), True, True),
    ("anthropic", anthropic_failure, 529, _anthropic("overloaded_error", "Overloaded"), {},
     "overloaded", (503, "server_is_overloaded"), True, True),
    ("gemini", gemini_failure, 503, _gemini(503, "UNAVAILABLE", "overloaded"), {},
     "overloaded", (503, "server_is_overloaded"), True, True),
    # the request's own fault: relayed, neither retried nor sent elsewhere
    ("openai", openai_failure, 400, _openai("bad value", "invalid_value", "top_p"), {},
     "request_rejected", (400, "invalid_value"), False, False),
    ("azure", azure_failure, 400, _azure("filtered by the content policy", "content_filter"),
     {}, "request_rejected", (400, "content_filter"), False, False),
    ("anthropic", anthropic_failure, 400, _anthropic("invalid_request_error", "bad block"), {},
     "request_rejected", (400, "invalid_value"), False, False),
    ("anthropic", anthropic_failure, 400,
     _anthropic("invalid_request_error", "prompt is too long: 300000 tokens > 200000"), {},
     "request_rejected", (400, "context_length_exceeded"), False, False),
    ("gemini", gemini_failure, 400, _gemini(400, "INVALID_ARGUMENT", "bad schema"), {},
     "request_rejected", (400, "invalid_value"), False, False),
    # the route's credential: not the request's fault, another route may serve
    ("openai", openai_failure, 401, _openai("bad key", "invalid_api_key"), {},
     "credential_refused", (502, "upstream_error"), False, True),
    ("azure", azure_failure, 401, _azure("Access denied", "401"), {},
     "credential_refused", (502, "upstream_error"), False, True),
    ("anthropic", anthropic_failure, 401, _anthropic("authentication_error", "bad key"), {},
     "credential_refused", (502, "upstream_error"), False, True),
    ("gemini", gemini_failure, 403, _gemini(403, "PERMISSION_DENIED", "denied"), {},
     "credential_refused", (502, "upstream_error"), False, True),
    # a refusal of n > 1: the route's limit
    ("gemini", gemini_failure, 400,
     _gemini(400, "INVALID_ARGUMENT", "Multiple candidates is not enabled for this model"), {},
     "candidates_refused", (400, "route_does_not_support_candidates"), False, True),
    # server errors: retried; an envelope makes it an error answer on unbilled routes
    ("openai", openai_failure, 500, _openai("server error"), {}, "other_status",
     (502, "upstream_error"), True, True),
    ("anthropic", anthropic_failure, 500, _anthropic("api_error", "Internal"), {},
     "other_status", (502, "upstream_error"), True, True),
    ("gemini", gemini_failure, 500, _gemini(500, "INTERNAL", "internal"), {}, "other_status",
     (502, "upstream_error"), True, True),
    ("azure", azure_failure, 502, b"<html>bad gateway</html>", {}, "other_status",
     (502, "upstream_error"), True, True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("provider", "failure_of", "status", "body", "headers", "cls", "client", "retry", "fallback"),
    CASES,
    ids=[f"{c[0]}-{c[2]}-{c[5]}" for c in CASES],
)
def test_each_providers_errors_through_the_one_table(
    provider: str,
    failure_of: FailureOf,
    status: int,
    body: bytes,
    headers: dict[str, str],
    cls: str,
    client: tuple[int, str | None],
    retry: bool,
    fallback: bool,
) -> None:
    failure = failure_of(status, headers, body)
    assert classify(failure) == cls
    error = client_error(failure)
    assert (error.status, error.code) == client
    assert (retryable(failure), may_fall_back(failure)) == (retry, fallback)
    assert ledger_outcome(failure) in ("rejected", "upstream_error")
    if retry and status == 429:
        assert error.retry_after == 2.0


def test_a_failure_carries_facts_only() -> None:
    """No field of ``AttemptFailed`` decides anything: the table does."""
    names = {f.name for f in dataclasses.fields(AttemptFailed)}
    assert names == {
        "kind", "status", "retry_after", "error", "provider_request_id", "detail", "partial",
        "dispatched", "usage", "max_candidates", "cancelled",
    }  # fmt: skip


def test_stream_and_translator_failures_go_through_the_table() -> None:
    """Failures raised mid-answer: Anthropic's ``error`` event and Gemini's blocked
    prompt (a 200 whose prompt was refused) are classified like their status twins."""
    overloaded = stream_failure(AnthropicErrorBody(type="overloaded_error", message="busy"))
    assert classify(overloaded) == "overloaded" and retryable(overloaded)
    blocked = as_attempt_failed(
        GeminiError("blocked", 200, "The prompt was blocked (SAFETY).", param="messages")
    )
    assert classify(blocked) == "request_rejected" and not may_fall_back(blocked)
    assert client_error(blocked).code == "content_filter"
    partial: Any = dataclasses.replace(overloaded, partial=True)
    assert not retryable(partial)  # part of it was relayed: never again
