"""The bench's server-only kinds answer a chat completion with no upstream behind them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import benchlib as bl  # noqa: E402


def _post(url: str, body: bytes, deadline: float) -> tuple[int, bytes]:
    while True:
        request = urllib.request.Request(url, data=body, method="POST")
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                return resp.status, resp.read()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.parametrize("kind", ["aiohttp+fixed", "aiohttp-server+fixed", "protocol+fixed"])
def test_a_server_only_kind_answers_its_fixed_completion_with_no_upstream(kind: str) -> None:
    port = bl.free_port()
    argv = [sys.executable, str(ROOT / "bench" / "proxies.py"), kind, "--port", str(port)]
    server = subprocess.Popen([*argv, "--upstream", "http://127.0.0.1:9/unused"])
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        status, body = _post(url, bl.chat_body("fake-model"), time.monotonic() + 20)
        assert status == 200
        answer = json.loads(body)
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["content"] == "hi"
    finally:
        server.terminate()
        server.wait(10)
