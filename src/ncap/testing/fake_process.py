"""The fake upstream in its own process, for benchmarks and multi-process tests.

A separate process keeps the fake's CPU off the measured gateway's core and event
loop. It binds an ephemeral port and announces it on stdout; this module waits for
that line, and stops the process (SIGTERM, then SIGKILL) when the block ends.
"""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["FakeUpstreamProcess", "fake_upstream_process"]

_ANNOUNCE = "listening on "


@dataclass(frozen=True, slots=True)
class FakeUpstreamProcess:
    """A fake upstream running as process ``pid``, reachable at ``base_url``."""

    base_url: str
    pid: int

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self._admin("stats"), timeout=10) as reply:
            result: dict[str, Any] = json.load(reply)
        return result

    def reset(self) -> None:
        request = urllib.request.Request(self._admin("reset"), data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=10):
            pass

    def _admin(self, action: str) -> str:
        return self.base_url.removesuffix("/v1") + "/_fake/" + action


@contextmanager
def fake_upstream_process(
    profile: str | None = None,
    *,
    latency_ms: float = 0.0,
    host: str = "127.0.0.1",
    port: int = 0,
    startup_timeout: float = 20.0,
) -> Iterator[FakeUpstreamProcess]:
    """Run ``python -m ncap.testing.fake_upstream`` for the duration of the block."""
    command = [sys.executable, "-m", "ncap.testing.fake_upstream", "--host", host]
    command += ["--port", str(port), "--latency-ms", str(latency_ms)]
    if profile:
        command += ["--profile", profile]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        yield FakeUpstreamProcess(_await_announce(process, startup_timeout), process.pid)
    finally:
        _stop(process)


def _await_announce(process: subprocess.Popen[str], timeout: float) -> str:
    line = _read_line(process, timeout)
    if _ANNOUNCE not in line:
        raise RuntimeError(f"fake upstream failed to start (exit {process.poll()}): {line!r}")
    return line.split(_ANNOUNCE, 1)[1].strip()


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    """First stdout line, waiting at most ``timeout`` seconds."""
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise RuntimeError(f"fake upstream did not start within {timeout} s")
    return process.stdout.readline()


def _stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stdout is not None:
        process.stdout.close()
