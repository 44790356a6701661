from __future__ import annotations

import subprocess
import sys

import ncap.client

EXPORTED = {
    "DEFAULT_BACKOFF_S",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT_S",
    "ChoiceBuffer",
    "Demuxed",
    "PriceSpec",
    "StreamError",
    "ToolCall",
    "Vote",
    "ademux",
    "answer_text",
    "async_retrying_client",
    "cost",
    "demux",
    "retrying_client",
    "saving",
    "tool_call_agreement",
    "vote",
}


def test_public_names_are_pinned() -> None:
    assert set(ncap.client.__all__) == EXPORTED
    assert len(ncap.client.__all__) == len(EXPORTED)
    for name in EXPORTED:
        assert hasattr(ncap.client, name), name


def test_importing_the_helpers_pulls_no_server_machinery() -> None:
    """Applications import ncap.client without aiohttp, llama.cpp or even openai."""
    code = (
        "import sys, ncap.client\n"
        "heavy = {'aiohttp', 'llama_cpp', 'openai', 'ncap.lifecycle', 'ncap.http', 'ncap.engine'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
