"""The bench's server-only kinds answer a chat completion with no upstream behind them."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import benchlib as bl  # noqa: E402


@pytest.mark.parametrize("kind", ["aiohttp+fixed", "aiohttp-server+fixed", "protocol+fixed"])
def test_a_server_only_kind_answers_its_fixed_completion_with_no_upstream(
    kind: str, tmp_path: Path
) -> None:
    port = bl.free_port()
    argv = [sys.executable, str(ROOT / "bench" / "proxies.py"), kind, "--port", str(port)]
    server = bl.start_server(kind, [*argv, "--upstream", "http://127.0.0.1:9/unused"], tmp_path)
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = bl.chat_body("fake-model")
        bl.wait_ready(server, url, body, timeout_s=20)
        request = urllib.request.Request(url, data=body, method="POST")
        with urllib.request.urlopen(request, timeout=5) as resp:
            assert resp.status == 200
            answer = json.loads(resp.read())
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["content"] == "hi"
    finally:
        bl.stop_server(server)
