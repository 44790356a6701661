"""Logging an unexpected exception without what the client sent.

A traceback's messages can quote request content (a value, a key, a prompt fragment), so
internal errors are logged as the exception's type and the chain of code locations only.
"""

from __future__ import annotations

import logging
import traceback

__all__ = ["log_internal_error"]


def log_internal_error(log: logging.Logger, what: str, exc: BaseException) -> None:
    frames = traceback.extract_tb(exc.__traceback__)[-5:]
    where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(frames))
    log.error("%s: %s at %s", what, type(exc).__name__, where or "?")
