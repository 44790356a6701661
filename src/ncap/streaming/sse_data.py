"""Server-sent events, bytes to data payloads, for upstreams whose events are not
OpenAI chunks (Gemini's ``streamGenerateContent?alt=sse``): the provider translates each
payload itself, so nothing here decodes JSON. ``ncap.streaming.sse`` is the OpenAI side.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

__all__ = ["iter_data"]


async def iter_data(lines: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """Each event's ``data`` (its ``data:`` lines joined by a newline), in order. A blank
    line (LF or CRLF) ends an event; comments and events without data are skipped; an
    event cut off by the end of the stream is still yielded."""
    data: list[bytes] = []
    async for line in lines:
        stripped = line.rstrip(b"\r\n")
        if not stripped:
            if data:
                yield b"\n".join(data)
                data = []
        elif stripped.startswith(b"data:"):
            data.append(stripped[5:].removeprefix(b" "))
    if data:
        yield b"\n".join(data)
