"""An interleaved n=3 stream as OpenAI sends it, as inline dicts.

Choice 0 answers in prose (two logprob entries), choice 1 calls two tools whose
arguments are split across chunks and interleaved, choice 2 stops first on ``length``;
the last chunk carries only the usage (``choices: []``).
"""

from __future__ import annotations

from typing import Any

BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def chunk(*choices: dict[str, Any], usage: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**BASE, "choices": list(choices), "usage": usage}


def delta(index: int, finish: str | None = None, logprobs: Any = None, **d: Any) -> dict[str, Any]:
    return {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish}


def tool(index: int, *, id: str | None = None, name: str | None = None, args: str = "") -> Any:
    function: dict[str, Any] = {"arguments": args}
    if name is not None:
        function["name"] = name
    call: dict[str, Any] = {"index": index, "function": function}
    if id is not None:
        call.update(id=id, type="function")
    return call


def lp(token: str) -> dict[str, Any]:
    return {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": []}


USAGE = {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42}

INTERLEAVED: list[dict[str, Any]] = [
    chunk(
        delta(0, role="assistant", content=""),
        delta(1, role="assistant", content=None),
        delta(2, role="assistant", content=""),
    ),
    chunk(delta(2, content="The harbour")),
    chunk(delta(0, content="Rain ", logprobs={"content": [lp("Rain ")], "refusal": None})),
    chunk(delta(1, tool_calls=[tool(0, id="call_a", name="get_weather", args="")])),
    chunk(delta(1, tool_calls=[tool(0, args='{"city": ')])),
    chunk(delta(2, content=" lights", finish="length")),
    chunk(delta(1, tool_calls=[tool(1, id="call_b", name="get_time", args='{"tz"')])),
    chunk(delta(0, content="falls.", logprobs={"content": [lp("falls.")], "refusal": None})),
    chunk(delta(1, tool_calls=[tool(0, args='"Oslo"}')])),
    chunk(delta(1, tool_calls=[tool(1, args=': "CET"}')])),
    chunk(delta(0, finish="stop")),
    chunk(delta(1, finish="tool_calls")),
    chunk(usage=USAGE),
]
