"""The route's timeout bounds every gap between a stream's reads (one timer per stream,
not one per read): a gap longer than it cuts the stream (the client gets the error
event, the attempt is held as a cut stream); a gap shorter than it does not."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from ncap.testing.fake_upstream import FakeState
from tests.support import gateway, gateway_config

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
TIMEOUT_S = 0.6


def _config(fake: tuple[str, FakeState], tmp: Path, pause_s: float) -> object:
    headers = {"x-fake-fault": "first_chunk_then_pause", "x-fake-pause-ms": str(pause_s * 1000)}
    return gateway_config(
        fake[0], tmp, routes={"fake": {"headers": headers, "timeout_s": TIMEOUT_S, "retries": 0}}
    )


@pytest.mark.parametrize(("pause_s", "cut"), [(2.5, True), (0.35, False)])
def test_a_gap_between_reads_is_bounded_by_the_route_timeout(
    fake: tuple[str, FakeState], tmp_path: Path, pause_s: float, cut: bool
) -> None:
    with gateway(_config(fake, tmp_path, pause_s)) as gw:  # type: ignore[arg-type]
        start = time.monotonic()
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=BODY, timeout=10) as r:
            text = b"".join(r.iter_bytes())
        elapsed = time.monotonic() - start
    assert r.status_code == 200
    if cut:
        last = text.split(b"\n\n")[-2]
        assert b"failed mid-way" in last and b'"code":"upstream_error"' in last, text[-300:]
        # caught between one and one and a half times the timeout (plus slack)
        assert TIMEOUT_S <= elapsed < pause_s, elapsed
    else:
        assert text.endswith(b"data: [DONE]\n\n")
