"""What an answered attempt says about itself, from its body or from its stream: the
report settlement needs (finish reasons counted, usage), in one place for both."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ncap.domain.evidence import Evidence
from ncap.lifecycle.evidence import EvidenceFeed
from ncap.lifecycle.plan import AttemptReport
from ncap.protocol.responses import ResponseSummary, SummaryUsage
from ncap.providers.base import UpstreamResult

__all__ = ["Tally", "answered_report", "stream_report", "summed_usage"]


@dataclass(slots=True)
class Tally:
    """What a relayed stream said about itself, per choice ``index``."""

    provider_request_id: str | None = None
    model: str = ""
    finish: dict[int, str | None] = field(default_factory=dict)
    usage: SummaryUsage | None = None
    done: bool = False
    choice_tokens: tuple[int, ...] | None = None
    # the candidates compared as they pass (set when two or more are expected)
    evidence: EvidenceFeed | None = None

    def add(self, summary: ResponseSummary) -> None:
        if self.provider_request_id is None:
            self.provider_request_id = summary.id
        for choice in summary.choices:
            index = choice.index if choice.index is not None else 0
            if choice.finish_reason is not None or index not in self.finish:
                self.finish[index] = choice.finish_reason
        if summary.usage is not None:
            self.usage = summary.usage

    def add_all(self, summaries: Iterable[ResponseSummary]) -> bool:
        """``add`` for each of a piece's summaries, inlined (it runs for every chunk of
        every stream); True when one of them carried usage."""
        usage_seen = False
        finish = self.finish
        for summary in summaries:
            if self.provider_request_id is None:
                self.provider_request_id = summary.id
            for choice in summary.choices:
                index = choice.index if choice.index is not None else 0
                reason = choice.finish_reason
                if reason is not None or index not in finish:
                    finish[index] = reason
            if summary.usage is not None:
                self.usage = summary.usage
                usage_seen = True
        return usage_seen


def answered_report(result: UpstreamResult, evidence: Evidence | None = None) -> AttemptReport:
    summary = result.summary
    return AttemptReport(
        provider_request_id=result.provider_request_id or summary.id,
        returned=len(summary.choices),
        finish_reasons=_counted(c.finish_reason for c in summary.choices),
        usage=summary.usage,
        stream=False,
        cut=None,
        choice_tokens=result.choice_tokens,
        evidence=evidence,
    )


def stream_report(tally: Tally, cut: str | None, evidence: Evidence | None = None) -> AttemptReport:
    """``evidence`` given (a fan-out's, over all its branches), or the tally's own
    feed's when the stream ended normally."""
    if tally.evidence is not None:
        evidence = tally.evidence.finish(complete=cut is None)
    return AttemptReport(
        provider_request_id=tally.provider_request_id,
        returned=len(tally.finish),
        finish_reasons=_counted(tally.finish.values()),
        usage=tally.usage,
        stream=True,
        cut=cut,
        choice_tokens=tally.choice_tokens,
        evidence=evidence,
    )


def summed_usage(usages: Sequence[SummaryUsage | None]) -> dict[str, Any] | None:
    """The usage of k fan-out branches together (every branch's prompt was paid); None
    unless every branch reported its prompt and completion tokens (the total is unknown).
    Cached prompt tokens are summed too when a branch reported them (a prefix cache
    lets branches after the first reuse the prompt)."""
    prompt = completion = 0
    cached: int | None = None
    written: int | None = None
    for u in usages:
        if u is None or u.prompt_tokens is None or u.completion_tokens is None:
            return None
        prompt += u.prompt_tokens
        completion += u.completion_tokens
        details = u.prompt_tokens_details
        if details is not None and details.cached_tokens is not None:
            cached = (cached or 0) + details.cached_tokens
        if details is not None and details.cache_write_tokens is not None:
            written = (written or 0) + details.cache_write_tokens
    summed: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached is not None or written is not None:
        summed["prompt_tokens_details"] = {"cached_tokens": cached or 0}
        if written is not None:
            summed["prompt_tokens_details"]["cache_write_tokens"] = written
    return summed


def _counted(reasons: Iterable[str | None]) -> dict[str, int]:
    finish: dict[str, int] = {}
    for reason in reasons:
        key = reason or "none"
        finish[key] = finish.get(key, 0) + 1
    return finish
