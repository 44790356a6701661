"""asyncpg's "Failed to restore the pool connection floor" tracebacks, repeated while
PostgreSQL is away, are folded into one warning line per interval."""

from __future__ import annotations

import logging

from ncap.stores.postgres.pool import _PoolFloorFilter


def _record(msg: str = "Failed to restore the pool connection floor") -> logging.LogRecord:
    try:
        raise ConnectionRefusedError("refused")
    except ConnectionRefusedError as exc:
        info = (type(exc), exc, exc.__traceback__)
    return logging.LogRecord("asyncpg.pool", logging.ERROR, __file__, 1, msg, (), info)


def test_repeats_are_folded_into_one_line_without_a_traceback() -> None:
    folder = _PoolFloorFilter(every_s=3600)
    first = _record()
    assert folder.filter(first)
    assert first.exc_info is None and first.levelno == logging.WARNING
    assert first.getMessage() == (
        "PostgreSQL unreachable: cannot restore the pool's idle connections "
        "(ConnectionRefusedError)"
    )
    assert not any(folder.filter(_record()) for _ in range(58))  # the other 58: dropped
    other = _record("something else")
    assert folder.filter(other) and other.exc_info is not None  # other lines untouched


def test_the_next_line_says_how_many_were_folded() -> None:
    folder = _PoolFloorFilter(every_s=0.0)
    assert folder.filter(_record())
    folder._folded = 5  # five dropped since
    nxt = _record()
    assert folder.filter(nxt)
    assert nxt.getMessage().endswith("; 5 such failures since the last line")
