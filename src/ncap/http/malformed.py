"""Malformed HTTP: a 400 and one log line, never a traceback or the offending bytes.

aiohttp's protocol handler answers a request it cannot parse (a NUL or a control byte
in a header, a broken request line, an over-long header) with a 400 by itself, but logs
it through ``logger.exception``: a stack trace whose message quotes the client's bytes
(a header value can be a credential). The gateway hands aiohttp this logger instead
(``web.Application(handler_args=protocol_handler_args())``): every record becomes one
line with the peer, the parser's exception class and the status, nothing else.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["ProtocolLog", "protocol_handler_args"]


class ProtocolLog:
    """The subset of ``logging.Logger`` aiohttp's ``RequestHandler`` calls."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log

    def exception(self, msg: str, *args: Any, exc_info: Any = None, **_: Any) -> None:
        self._one_line(logging.WARNING, msg, args, exc_info)

    def error(self, msg: str, *args: Any, exc_info: Any = None, **_: Any) -> None:
        self._one_line(logging.ERROR, msg, args, exc_info)

    def warning(self, msg: str, *args: Any, exc_info: Any = None, **_: Any) -> None:
        self._one_line(logging.WARNING, msg, args, exc_info)

    def info(self, msg: str, *args: Any, exc_info: Any = None, **_: Any) -> None:
        self._one_line(logging.INFO, msg, args, exc_info)

    def debug(self, msg: str, *args: Any, exc_info: Any = None, **_: Any) -> None:
        self._one_line(logging.DEBUG, msg, args, exc_info)

    def isEnabledFor(self, level: int) -> bool:
        return self._log.isEnabledFor(level)

    def _one_line(self, level: int, msg: str, args: tuple[Any, ...], exc_info: Any) -> None:
        if not self._log.isEnabledFor(level):
            return
        # aiohttp's messages are constant ("Error handling request from %s") and the only
        # argument is the peer address; the exception is reduced to its class and status
        what = _describe(exc_info)
        line = (msg % args) if args else msg
        self._log.log(level, "%s%s", line, f": {what}" if what else "")


def _describe(exc_info: Any) -> str:
    exc = exc_info[1] if isinstance(exc_info, tuple) else exc_info
    if not isinstance(exc, BaseException):
        return ""
    status = getattr(exc, "code", None)
    return f"{type(exc).__name__} ({status})" if isinstance(status, int) else type(exc).__name__


def protocol_handler_args() -> dict[str, Any]:
    """Keyword arguments for aiohttp's request handler (``Application(handler_args=…)``)."""
    return {"logger": ProtocolLog(logging.getLogger("ncap.http.protocol"))}
