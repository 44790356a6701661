"""``openai`` clients with the reference's retry defaults (seed ``002``: up to 2 retries,
500 ms backoff, 30 s timeout).

The SDK does the retrying itself: on connection errors, 408, 409, 429 and 5xx it
waits ``min(0.5 s × 2^attempt, 8 s)`` less up to 25 % jitter — so the first backoff is
the reference's 500 ms — unless the answer carries ``retry-after-ms``/``retry-after``,
which it honours. What it does not share with the reference is the timeout: the SDK
waits 600 s by default, these clients 30 s (per connect, read, write and pool wait,
so on a stream it bounds each gap between chunks, not the whole stream). Policy
denials from ncap are 400s and are never retried; ``budget_exhausted`` 429s carry
``x-should-retry: false``, which the SDK respects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from openai import AsyncOpenAI, OpenAI

__all__ = [
    "DEFAULT_BACKOFF_S",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT_S",
    "async_retrying_client",
    "retrying_client",
]

DEFAULT_MAX_RETRIES = 2
DEFAULT_TIMEOUT_S = 30.0
# the SDK's own initial backoff (not configurable there); recorded for reference
DEFAULT_BACKOFF_S = 0.5


def retrying_client(**kwargs: Any) -> OpenAI:
    """``openai.OpenAI(**kwargs)``, with ``max_retries=2`` and ``timeout=30`` unless given."""
    from openai import OpenAI

    return OpenAI(**_with_defaults(kwargs))


def async_retrying_client(**kwargs: Any) -> AsyncOpenAI:
    """``openai.AsyncOpenAI(**kwargs)`` with the same defaults."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(**_with_defaults(kwargs))


def _with_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {"max_retries": DEFAULT_MAX_RETRIES, "timeout": DEFAULT_TIMEOUT_S, **kwargs}
