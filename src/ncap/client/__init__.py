"""Helpers for applications that call ncap (or any OpenAI-compatible API) with ``n > 1``.

- ``demux`` / ``ademux``: n per-choice buffers from an interleaved chunk stream;
- ``vote`` and ``tool_call_agreement``: self-consistency over the n choices;
- ``cost`` and ``saving``: the price of one n-request, in integer micro-USD;
- ``retrying_client`` / ``async_retrying_client``: ``openai`` clients with the
  reference's retry defaults.

Needs only ncap itself and, for the clients, the ``openai`` package (imported lazily);
none of the gateway's server-side machinery is imported.
"""

from ncap.client._cost import PriceSpec, cost, saving
from ncap.client._demux import ChoiceBuffer, Demuxed, StreamError, ToolCall, ademux, demux
from ncap.client._retry import (
    DEFAULT_BACKOFF_S,
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT_S,
    async_retrying_client,
    retrying_client,
)
from ncap.client._vote import Vote, answer_text, tool_call_agreement, vote

__all__ = [
    "DEFAULT_BACKOFF_S",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT_S",
    "ChoiceBuffer",
    "Demuxed",
    "PriceSpec",
    "StreamError",
    "ToolCall",
    "Vote",
    "ademux",
    "answer_text",
    "async_retrying_client",
    "cost",
    "demux",
    "retrying_client",
    "saving",
    "tool_call_agreement",
    "vote",
]
