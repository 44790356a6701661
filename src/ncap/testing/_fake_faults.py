"""Fault profiles of the fake upstream: parsing, per-request parameters, error replies.

A profile list is ``name[=value][,name[=value]...]``, from the process (``--profile``)
or from the ``x-fake-fault`` request header, which replaces the process list for that
request (``x-fake-fault: none`` turns every fault off). ``value`` is the profile's main
parameter; the ``x-fake-*`` header in brackets overrides it.

    latency=MS               wait before answering [x-fake-latency-ms, alone it implies latency]
    rate_limit=S, slow_down  429 slow_down with Retry-After S (default 1) [x-fake-retry-after]
    rate_limit_exceeded=S    429 rate_limit_exceeded with Retry-After
    overloaded[=S]           503 server_is_overloaded (Retry-After only when given)
    timeout=S                hang S seconds (default 3600), then 504 [x-fake-timeout-s]
    error_500, bad_gateway_html, server_error_400 (param n) [x-fake-error-param]
    malformed_json           invalid JSON body; in a stream, one invalid chunk
    extra_choices, fewer_choices   n+1 / n-1 choices
    missing_usage, stream_no_usage no usage (body / stream); usage_with_choices: usage
                             rides on the last choice chunk instead of its own chunk
    reset_mid_stream=K       K events (default: role chunks + 2) then a TCP abort; a
                             non-stream body is cut in half [x-fake-after-chunks]
    truncated_stream=K       K events then a clean end: no finish, usage or [DONE]
    slow_chunks=MS           delay between events (default 50) [x-fake-chunk-delay-ms]
    first_chunk_then_pause=MS  pause after the first event (default 1000) [x-fake-pause-ms]
    fragmented_stream=B      write events in B-byte pieces (default 7) [x-fake-fragment-bytes]
    ignore_candidates        one choice whatever n says (a provider that ignores n)
    refuse_candidates=MAX    n > MAX (default 1) is a 400 invalid_value on param n,
                             "number must be at most MAX" [x-fake-max-candidates]
    prompt_cache=S           cache prompts of 1024+ tokens as OpenAI does (automatic,
                             128-token steps), readable once the writing request's first
                             byte went out and for S seconds (default 300)
                             [x-fake-cache-ttl-s]

Other headers: ``x-fake-error-code`` (replace an error's code), ``x-fake-completion-tokens``
(exact tokens per choice before the ceiling), ``x-fake-cached-tokens``,
``x-fake-reasoning-tokens`` (usage details; reasoning adds to completion_tokens), and
``x-fake-fail-times: K`` + ``x-fake-fail-key`` (faults only for the key's first K requests),
``x-fake-candidates: a,a,a,b,tool:f`` (candidates duplicated at set rates: one label per
candidate, the same label the same candidate, ``tool:NAME`` a call of tool NAME; a
request for n candidates takes the pattern's next n labels, so k single-candidate
requests share one pattern as one request for k does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from ncap.errors import InvalidValue, NcapError, Overloaded, RateLimitExceeded, SlowDown
from ncap.testing._fake_content import parse_pattern

__all__ = [
    "PROFILES",
    "ErrorReply",
    "Faults",
    "Plan",
    "candidates_refusal",
    "error_reply",
    "parse_faults",
    "resolve_plan",
]

# profile -> the plan field its "=value" sets
_VALUE_OF: dict[str, str] = {
    "latency": "latency_ms",
    "rate_limit": "retry_after",
    "slow_down": "retry_after",
    "rate_limit_exceeded": "retry_after",
    "overloaded": "retry_after",
    "timeout": "timeout_s",
    "reset_mid_stream": "after_chunks",
    "truncated_stream": "after_chunks",
    "slow_chunks": "chunk_delay_ms",
    "first_chunk_then_pause": "pause_ms",
    "fragmented_stream": "fragment_bytes",
    "refuse_candidates": "max_candidates",
    "prompt_cache": "cache_ttl_s",
}
PROFILES = frozenset(
    {
        *_VALUE_OF,
        "none",
        "malformed_json",
        "extra_choices",
        "fewer_choices",
        "missing_usage",
        "stream_no_usage",
        "usage_with_choices",
        "error_500",
        "bad_gateway_html",
        "server_error_400",
        "ignore_candidates",
    }
)
# header that overrides a plan field
_HEADER_OF: dict[str, str] = {
    "latency_ms": "x-fake-latency-ms",
    "retry_after": "x-fake-retry-after",
    "timeout_s": "x-fake-timeout-s",
    "after_chunks": "x-fake-after-chunks",
    "chunk_delay_ms": "x-fake-chunk-delay-ms",
    "pause_ms": "x-fake-pause-ms",
    "fragment_bytes": "x-fake-fragment-bytes",
    "max_candidates": "x-fake-max-candidates",
    "cache_ttl_s": "x-fake-cache-ttl-s",
}
_RATE_LIMITS = ("rate_limit", "slow_down", "rate_limit_exceeded")
_HTML_502 = (
    b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
    b"<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n"
    b"</body>\r\n</html>\r\n"
)
_ERROR_500 = msgspec.json.encode(
    {
        "error": {
            "message": "The server had an error while processing your request. Sorry about that!",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
)


@dataclass(frozen=True, slots=True)
class Faults:
    """A parsed profile list: the active names and their ``=value`` parameters."""

    names: frozenset[str] = frozenset()
    values: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything one request's faults need, resolved from profiles and headers."""

    names: frozenset[str]
    latency_ms: float = 0.0
    retry_after: str | None = None
    timeout_s: float = 3600.0
    after_chunks: int | None = None
    chunk_delay_ms: float = 50.0
    pause_ms: float = 1000.0
    fragment_bytes: int = 7
    error_code: str | None = None
    error_param: str = "n"
    completion_tokens: int | None = None
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    max_candidates: int = 1  # refuse_candidates: the most n accepted
    # x-fake-candidates: one label per candidate (same label, same candidate)
    candidates: tuple[str, ...] = ()
    cache_ttl_s: float = 300.0  # prompt_cache: how long an entry lives


@dataclass(frozen=True, slots=True)
class ErrorReply:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)


def parse_faults(spec: str | None) -> Faults:
    """Parse ``name[=value],...``; raises ValueError naming an unknown profile."""
    names: set[str] = set()
    values: dict[str, str] = {}
    for item in (spec or "").split(","):
        name, _, value = item.strip().partition("=")
        if not name:
            continue
        if name not in PROFILES:
            raise ValueError(f"unknown fake fault profile {name!r}; known: {sorted(PROFILES)}")
        names.add(name)
        if value:
            values[name] = value.strip()
    names.discard("none")
    return Faults(frozenset(names), values)


def _number(raw: str | None, what: str) -> float | None:
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{what} must be a number, got {raw!r}") from None


def _param(field_name: str, faults: Faults, headers: Mapping[str, str]) -> str | None:
    raw = headers.get(_HEADER_OF[field_name])
    if raw is not None:
        return raw
    for name in faults.names:
        if _VALUE_OF.get(name) == field_name and name in faults.values:
            return faults.values[name]
    return None


def _int_header(headers: Mapping[str, str], header: str) -> int | None:
    value = _number(headers.get(header), header)
    return None if value is None else int(value)


def resolve_plan(faults: Faults, headers: Mapping[str, str], base_latency_ms: float) -> Plan:
    """Combine the active faults with the ``x-fake-*`` headers; ValueError on bad values."""

    def num(field_name: str, default: float) -> float:
        value = _number(_param(field_name, faults, headers), _HEADER_OF[field_name])
        return default if value is None else value

    retry_after = _param("retry_after", faults, headers)
    num("retry_after", 0.0)  # validates it
    after_chunks = _param("after_chunks", faults, headers)
    latency = num("latency_ms", 100.0) if "latency" in faults.names else 0.0
    return Plan(
        names=faults.names,
        latency_ms=base_latency_ms + latency,
        retry_after=retry_after,
        timeout_s=num("timeout_s", 3600.0),
        after_chunks=None if after_chunks is None else int(num("after_chunks", 0.0)),
        chunk_delay_ms=num("chunk_delay_ms", 50.0),
        pause_ms=num("pause_ms", 1000.0),
        fragment_bytes=max(1, int(num("fragment_bytes", 7.0))),
        error_code=headers.get("x-fake-error-code"),
        error_param=headers.get("x-fake-error-param", "n"),
        completion_tokens=_int_header(headers, "x-fake-completion-tokens"),
        cached_tokens=_int_header(headers, "x-fake-cached-tokens") or 0,
        reasoning_tokens=_int_header(headers, "x-fake-reasoning-tokens") or 0,
        max_candidates=max(1, int(num("max_candidates", 1.0))),
        candidates=parse_pattern(headers.get("x-fake-candidates")),
        cache_ttl_s=num("cache_ttl_s", 300.0),
    )


def _envelope_reply(error: NcapError, retry_after: str | None) -> ErrorReply:
    headers: dict[str, str] = {}
    if retry_after is not None:
        headers["retry-after"] = retry_after
        headers["retry-after-ms"] = str(int(float(retry_after) * 1000))
    return ErrorReply(error.status, msgspec.json.encode(error.envelope()), headers=headers)


def candidates_refusal(n: int, plan: Plan) -> ErrorReply | None:
    """``refuse_candidates``: n above the plan's maximum is refused the way
    OpenAI-compatible servers that lack n do (400 on param ``n``)."""
    if "refuse_candidates" not in plan.names or n <= plan.max_candidates:
        return None
    error = InvalidValue(f"'n' : number must be at most {plan.max_candidates}", param="n")
    return _envelope_reply(error, None)


def error_reply(plan: Plan) -> ErrorReply | None:
    """The error the plan answers with instead of a completion, if any."""
    names, code = plan.names, plan.error_code
    if names.isdisjoint(_ERROR_PROFILES):
        return None
    if "rate_limit_exceeded" in names:
        error: NcapError = RateLimitExceeded(
            "Rate limit reached for requests. Please try again later.", code=code
        )
        return _envelope_reply(error, plan.retry_after or "1")
    if not names.isdisjoint(_RATE_LIMITS):
        error = SlowDown(
            "Your request rate increased too quickly. Please reduce the request rate and "
            "gradually increase it again.",
            code=code,
        )
        return _envelope_reply(error, plan.retry_after or "1")
    if "overloaded" in names:
        error = Overloaded(
            "The model is temporarily overloaded. Please retry your request after a brief delay.",
            code=code,
        )
        return _envelope_reply(error, plan.retry_after)
    if "server_error_400" in names:
        message = f"Invalid '{plan.error_param}': this value is not supported with this model."
        return _envelope_reply(InvalidValue(message, param=plan.error_param, code=code), None)
    if "error_500" in names:
        return ErrorReply(500, _ERROR_500)
    return ErrorReply(502, _HTML_502, content_type="text/html")


_ERROR_PROFILES = frozenset(
    {*_RATE_LIMITS, "overloaded", "server_error_400", "error_500", "bad_gateway_html"}
)
