"""The access log's stdout handler: lines are batched into one write each interval,
in order, none lost at close, and a broken stream does not raise into the loop."""

from __future__ import annotations

import io
import logging
import threading
import time

from ncap.http.signals import BatchedStreamHandler


class _CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.writer_threads: set[str] = set()

    def write(self, s: str) -> int:
        self.writes += 1
        self.writer_threads.add(threading.current_thread().name)
        return super().write(s)


def _logger(handler: logging.Handler, name: str) -> logging.Logger:
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(name)
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


def test_lines_are_written_in_one_batch_off_the_calling_thread() -> None:
    stream = _CountingStream()
    handler = BatchedStreamHandler(stream, interval_s=0.05)
    log = _logger(handler, "ncap.test.batch1")
    for i in range(200):
        log.info("line %d", i)
    assert stream.writes == 0  # nothing written on the logging thread
    deadline = time.monotonic() + 2
    while stream.getvalue().count("\n") < 200 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stream.getvalue().splitlines() == [f"line {i}" for i in range(200)]
    assert stream.writes <= 2  # one batch (two if the flusher ticked mid-loop)
    assert stream.writer_threads == {"ncap-access-log"}
    handler.close()


def test_close_writes_what_is_pending_and_a_full_buffer_is_written_at_once() -> None:
    stream = _CountingStream()
    handler = BatchedStreamHandler(stream, interval_s=60, max_pending=10)
    log = _logger(handler, "ncap.test.batch2")
    for i in range(25):
        log.info("l%d", i)
    assert stream.getvalue().count("\n") == 20  # two full buffers, written when full
    handler.close()
    assert stream.getvalue().splitlines() == [f"l{i}" for i in range(25)]


def test_a_broken_stream_does_not_raise() -> None:
    stream = io.StringIO()
    handler = BatchedStreamHandler(stream, interval_s=60)
    log = _logger(handler, "ncap.test.batch3")
    log.info("before")
    stream.close()
    handler.flush_now()  # ValueError from the closed stream is swallowed
    log.info("after")
    handler.close()


def test_the_plain_stdout_handler_takes_lines_directly_and_others_get_records() -> None:
    from ncap.http.signals import RequestSignals

    stream = _CountingStream()
    plain = BatchedStreamHandler(stream, interval_s=60, plain=True)
    logger = logging.getLogger("ncap.access")
    saved = logger.handlers[:], logger.level, logger.propagate
    logger.handlers[:] = [plain]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        assert plain.takes_lines(logger)
        signals = RequestSignals(access_log=True)
        signals.begin("req-1")
        signals.responded("req-1", 200)
        signals.end("req-1")
        plain.flush_now()
        assert '"request_id":"req-1"' in stream.getvalue()
        # an operator's filter (or a second handler) means the full logging path
        plain.addFilter(lambda record: False)
        assert not plain.takes_lines(logger)
        signals.begin("req-2")
        signals.end("req-2")
        plain.flush_now()
        assert "req-2" not in stream.getvalue()
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
        plain.close()
