"""Request limits the validator's structs cannot state, as config (``limits``) with sane
defaults and OpenAI-shaped errors.

- header line size and header count: aiohttp's parser enforces them (a 400 before any
  handler runs; ``malformed.ProtocolLog`` keeps that to one log line);
- the body size: ``read_body`` (413 ``request_too_large``);
- the message count: ``protocol.limits.check_message_count`` (400 on ``messages``),
  called by the gateway right after validation, before anything is admitted;
- a streamed answer's wall-clock duration: ``bounded_stream`` ends it with an SSE error
  event, which closes the upstream stream and settles it like a client disconnect.
``n`` is bounded by the policy (``max_candidates_absolute`` and each workload's
``max_candidates``) and JSON nesting by ``protocol.validate.MAX_DEPTH``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.client_exceptions import ClientPayloadError
from aiohttp.http_exceptions import HttpProcessingError

from ncap.config import Limits
from ncap.errors import BodyTooLarge, InvalidRequest

__all__ = ["bounded_stream", "handler_limits", "read_body"]


def handler_limits(limits: Limits) -> dict[str, Any]:
    """aiohttp request-handler arguments for the header limits."""
    return {
        "max_line_size": limits.max_header_bytes,
        "max_field_size": limits.max_header_bytes,
        "max_headers": limits.max_headers,
    }


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, at most ``limit`` bytes; a body cut short is the client's error."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"The request body is larger than {limit} bytes.")
    try:
        raw = await request.content.read(limit + 1)
    except (ClientPayloadError, HttpProcessingError):
        raise InvalidRequest("The request body was incomplete or malformed.") from None
    if len(raw) > limit:
        raise BodyTooLarge(f"The request body is larger than {limit} bytes.")
    return raw


_TIMEOUT_EVENT = (
    b"data: "
    + msgspec.json.encode(
        {
            "error": {
                "message": "The stream exceeded this gateway's maximum duration.",
                "type": "invalid_request_error",
                "param": None,
                "code": "stream_timeout",
            }
        }
    )
    + b"\n\n"
)


async def bounded_stream(stream: AsyncIterator[bytes], max_s: float) -> AsyncIterator[bytes]:
    """The stream's chunks until ``max_s`` has passed, then one error event and the end
    (the caller closes ``stream``, which cancels the upstream and settles it)."""
    deadline = time.monotonic() + max_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            yield _TIMEOUT_EVENT
            return
        try:
            async with asyncio.timeout(remaining):
                chunk = await anext(stream)
        except StopAsyncIteration:
            return
        except TimeoutError:
            yield _TIMEOUT_EVENT
            return
        yield chunk
