"""What a route's contract is, derived from what the route answered to ``ncap probe``.

The probe sends, through the route's own provider (so through the translator of a
``gemini`` route), a minimal request with ``n`` = 2 and a small output ceiling, and the
same request streamed with ``stream_options.include_usage``. Both answers arrive in
OpenAI's wire format; this module turns them into the contract record
(``routes.<id>.contract``). Pure: the instant and the fingerprint are parameters.

- ``candidates``: ``native`` when the answer has exactly the choices 0..n-1 and the
  stream carries the same indexes; a single choice (n *ignored*), any other count, or a
  stream that disagrees is ``unsupported``; a 400 refusing ``n`` is ``unsupported``
  with the maximum it states. ``emulate``, an operator's choice, is kept as it is.
- ``stream_usage``: ``include_usage`` when the stream carried a usage chunk, else ``none``.
- ``output_cap``: only where usage reveals it: every choice stopped at the ceiling and
  the visible output (completion minus reasoning) is above one ceiling → ``per_candidate``;
  choices stopped at the ceiling and the output fits in one ceiling, with no reasoning
  tokens (which may have spent each candidate's budget) → ``shared``; otherwise the
  previous value stays.
- Anything else (429, 5xx, a refused credential) proves nothing: ``ProbeInconclusive``,
  and no record is written.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from ncap.config import Contract, Fingerprint

__all__ = [
    "EMULATE_MAX_CANDIDATES",
    "CandidatesFinding",
    "ProbeFindings",
    "ProbeInconclusive",
    "ProbeReply",
    "StreamReply",
    "cache_probe_request",
    "derive_contract",
    "derive_emulated_contract",
    "probe_requests",
    "stated_maximum",
]

CandidatesFinding = Literal[
    "native", "ignored", "refused", "mismatched", "stream_mismatched", "no_native_n"
]
EMULATE_MAX_CANDIDATES = 8
"""The fan-out width recorded for a provider without ``n`` when the route had none: the
workload's policy still bounds every request."""


class ProbeInconclusive(Exception):
    """The route's answer proves nothing about its contract (an outage, a quota, a bad
    credential): the probe writes nothing."""


@dataclass(frozen=True, slots=True)
class ProbeReply:
    """The non-streamed probe's answer: a chat.completion (200) or an error envelope."""

    status: int
    body: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class StreamReply:
    """The streamed probe's answer: the decoded chunks (``[DONE]`` left out) on 200,
    else the error envelope in ``error``."""

    status: int
    chunks: Sequence[Mapping[str, Any]] = ()
    error: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ProbeFindings:
    """The derived record and what led to it (printed by ``ncap probe``)."""

    contract: Contract
    candidates: CandidatesFinding
    returned: int  # choices in the non-streamed answer (0 when refused)
    stream_indexes: int  # distinct choice indexes in the stream
    stated_maximum: int | None  # what a refusal said the provider accepts
    reported_model: str | None  # the model the answer names
    notes: list[str] = field(default_factory=list)


_MAXIMUM = re.compile(
    r"(?:at most|<=|up to|maximum(?: value)?(?: of| is)?)\s*(\d+)"
    r"|to (\d+) \(exclusive\)"
    r"|must be (\d+)",
    re.IGNORECASE,
)


def stated_maximum(message: str) -> int | None:
    """The largest candidate count a refusal's message states, if it states one: "at most
    4 candidate(s)" (ncap's Gemini translator), "Expected a value <= 4", "to 5
    (exclusive)", "must be 1"."""
    match = _MAXIMUM.search(message)
    if match is None:
        return None
    at_most, exclusive, must_be = match.groups()
    if exclusive is not None:
        return max(1, int(exclusive) - 1)
    return int(at_most or must_be)


def derive_contract(
    reply: ProbeReply,
    stream: StreamReply,
    *,
    requested_n: int,
    ceiling: int,
    previous: Contract,
    fingerprint: Fingerprint,
    now: datetime,
    prompt_cache: bool = False,
) -> ProbeFindings:
    """The contract record for a route from its two probe answers (see the module doc).

    ``previous`` supplies what the probe does not decide: ``max_age``, an operator's
    ``emulate``, a verified native maximum above ``requested_n``, and the output cap
    when usage does not reveal it. ``prompt_cache``: a repeated long prompt came back
    with cached tokens."""
    if requested_n < 2:
        raise ValueError("the probe needs n >= 2 to tell native from ignored")
    candidates, maximum, notes = _candidates(reply, requested_n)
    stream_indexes, stream_usage = _stream(stream)
    if candidates == "native" and stream_indexes != requested_n:
        candidates = "stream_mismatched"
        notes.append(
            f"the stream carried {stream_indexes} choice index(es) for n={requested_n}; "
            "n > 1 is not trusted on this route"
        )
    output_cap = _output_cap(reply, requested_n, ceiling) if candidates == "native" else None
    contract = Contract(
        candidates=_mode(candidates, previous),
        max_candidates=_max_candidates(candidates, maximum, requested_n, previous),
        output_cap=output_cap or previous.output_cap,
        stream_usage=stream_usage,
        verified_at=now,
        max_age=previous.max_age,
        fingerprint=fingerprint,
        prompt_cache=prompt_cache,
    )
    return ProbeFindings(
        contract=contract,
        candidates=candidates,
        returned=len(_choices(reply.body)) if reply.status == 200 else 0,
        stream_indexes=stream_indexes,
        stated_maximum=maximum,
        reported_model=_model(reply.body),
        notes=notes,
    )


def derive_emulated_contract(
    reply: ProbeReply,
    stream: StreamReply,
    *,
    previous: Contract,
    fingerprint: Fingerprint,
    now: datetime,
    prompt_cache: bool = False,
) -> ProbeFindings:
    """The record for a route whose provider has no ``n`` (Anthropic): the probe sent
    one candidate, whole and streamed; n > 1 is a fan-out (``emulate``), each branch its
    own request with its own ceiling (``per_candidate``)."""
    if reply.status != 200:
        error = _error(reply.body)
        raise ProbeInconclusive(
            f"the probe failed with HTTP {reply.status} "
            f"({error.get('code') or 'no code'}): {error.get('message') or 'no message'}"
        )
    stream_indexes, stream_usage = _stream(stream)
    kept = previous.candidates == "emulate"
    contract = Contract(
        candidates="emulate",
        max_candidates=previous.max_candidates if kept else EMULATE_MAX_CANDIDATES,
        output_cap="per_candidate",
        stream_usage=stream_usage,
        verified_at=now,
        max_age=previous.max_age,
        fingerprint=fingerprint,
        prompt_cache=prompt_cache,
    )
    return ProbeFindings(
        contract=contract,
        candidates="no_native_n",
        returned=len(_choices(reply.body)),
        stream_indexes=stream_indexes,
        stated_maximum=None,
        reported_model=_model(reply.body),
        notes=["the provider has no n: n > 1 is served by fan-out (candidates: emulate)"],
    )


def _choices(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    choices = body.get("choices")
    return [c for c in choices if isinstance(c, Mapping)] if isinstance(choices, list) else []


def _model(body: Mapping[str, Any]) -> str | None:
    model = body.get("model")
    return model if isinstance(model, str) else None


def _error(body: Mapping[str, Any] | None) -> Mapping[str, Any]:
    error = body.get("error") if body is not None else None
    return error if isinstance(error, Mapping) else {}


def _candidates(reply: ProbeReply, n: int) -> tuple[CandidatesFinding, int | None, list[str]]:
    """(finding, stated maximum, notes) from the non-streamed answer."""
    if reply.status == 400:
        error = _error(reply.body)
        refused = (
            error.get("code") == "route_does_not_support_candidates" or error.get("param") == "n"
        )
        if refused:
            maximum = stated_maximum(str(error.get("message") or ""))
            return "refused", maximum, [f"n={n} was refused: {error.get('message') or ''}".strip()]
    if reply.status != 200:
        error = _error(reply.body)
        raise ProbeInconclusive(
            f"the n={n} probe failed with HTTP {reply.status} "
            f"({error.get('code') or 'no code'}): {error.get('message') or 'no message'}"
        )
    choices = _choices(reply.body)
    indexes = sorted(i for c in choices if isinstance(i := c.get("index"), int))
    if len(choices) == n and indexes == list(range(n)):
        return "native", None, []
    if len(choices) == 1:
        return "ignored", None, [f"n={n} was ignored: one choice came back"]
    return "mismatched", None, [f"n={n} returned choice indexes {indexes}"]


def _stream(stream: StreamReply) -> tuple[int, Literal["include_usage", "none"]]:
    """(distinct choice indexes, stream usage) of the streamed answer."""
    if stream.status != 200:
        error = _error(stream.error)
        raise ProbeInconclusive(
            f"the streamed probe failed with HTTP {stream.status} "
            f"({error.get('code') or 'no code'}): {error.get('message') or 'no message'}"
        )
    indexes: set[int] = set()
    usage = False
    for chunk in stream.chunks:
        for choice in _choices(chunk):
            if isinstance(choice.get("index"), int):
                indexes.add(choice["index"])
        reported = chunk.get("usage")
        if isinstance(reported, Mapping) and isinstance(reported.get("completion_tokens"), int):
            usage = True
    return len(indexes), ("include_usage" if usage else "none")


def _output_cap(
    reply: ProbeReply, n: int, ceiling: int
) -> Literal["per_candidate", "shared"] | None:
    choices = _choices(reply.body)
    usage = reply.body.get("usage")
    if not isinstance(usage, Mapping) or not isinstance(usage.get("completion_tokens"), int):
        return None
    details = usage.get("completion_tokens_details")
    reasoning = details.get("reasoning_tokens") if isinstance(details, Mapping) else None
    thought = reasoning if isinstance(reasoning, int) else 0
    visible = usage["completion_tokens"] - thought
    at_ceiling = [c for c in choices if c.get("finish_reason") == "length"]
    if len(at_ceiling) == n and visible > ceiling:
        return "per_candidate"
    # Reasoning may have spent a candidate's own budget (Gemini counts thoughts in
    # maxOutputTokens), so little visible output proves "shared" only without it.
    if at_ceiling and visible <= ceiling and thought == 0:
        return "shared"
    return None


def probe_requests(
    model: str, *, n: int = 2, ceiling: int = 16
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The probe's two bodies (non-streamed, streamed), sent to the route as ``model``.

    The prompt asks for more than ``ceiling`` tokens, so that every choice stops at the
    ceiling and the usage can reveal the output-cap semantics; ``temperature`` 1 keeps
    ``n`` > 1 clear of greedy-sampling rules. When the first is refused, stream with
    ``n`` = 1 (``stream_usage`` is then all the stream can tell)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Count from 1 to 200, one number per line."}],
        "n": n,
        "max_completion_tokens": ceiling,
        "temperature": 1.0,
    }
    return body, {**body, "stream": True, "stream_options": {"include_usage": True}}


CACHE_PROBE_WORDS = 1400
"""The cache probe's prompt length in words: above the 1,024 tokens providers cache."""


def cache_probe_request(model: str, *, explicit: bool) -> dict[str, Any]:
    """A prompt long enough to be cached, the same every time; ``explicit`` marks its
    last part with a cache breakpoint (a provider that caches only what is marked)."""
    text = " ".join(f"line {i}: the harbour wall is old." for i in range(CACHE_PROBE_WORDS // 6))
    part: dict[str, Any] = {"type": "text", "text": text}
    if explicit:
        part["prompt_cache_breakpoint"] = {"mode": "explicit"}
    return {
        "model": model,
        "messages": [{"role": "user", "content": [part]}],
        "max_completion_tokens": 1,
    }


def _mode(
    finding: CandidatesFinding, previous: Contract
) -> Literal["native", "emulate", "unsupported"]:
    if previous.candidates == "emulate":
        return "emulate"  # fan-out works whatever the provider does with n
    return "native" if finding == "native" else "unsupported"


def _max_candidates(
    finding: CandidatesFinding, stated: int | None, n: int, previous: Contract
) -> int:
    if previous.candidates == "emulate":
        return previous.max_candidates
    if finding == "native":
        kept = previous.max_candidates if previous.candidates == "native" else 1
        return max(n, kept)
    if finding == "refused" and stated is not None:
        return max(1, min(stated, n - 1))
    return 1
