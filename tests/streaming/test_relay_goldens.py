"""Golden streams: recorded upstream streams (OpenAI-compatible, Gemini translated, the
local engine's, a fan-out's k branches, the legacy completions endpoint) relayed
through the real provider plumbing and lifecycle; the client's bytes and the settlement
must equal what was recorded in ``relay_goldens.json``.

The goldens were recorded from the event-at-a-time relay, before the relay went to work
per socket read: the bytes a client receives did not change with it. Re-record (only
when a change of output is intended) with ``NCAP_RECORD_GOLDENS=1``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ncap.providers.http1 import PayloadError
from tests.streaming.recorded import (
    Conductor,
    RecordedEngine,
    RecordedTransport,
    gateway,
    gemini_provider,
    openai_provider,
    play,
)

GOLDENS = Path(__file__).with_name("relay_goldens.json")
_enc = msgspec.json.Encoder().encode
MESSAGES = [{"role": "user", "content": "hi"}]
WORDS = ["Hello", " there", ",", " how", " are", " you", "? ", 'é ✓ \\" \n end']


def _chunk(index: int | None, content: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = []
    if index is not None:
        delta = {} if content is None else {"content": content}
        choices = [{"index": index, "delta": delta, "finish_reason": extra.pop("finish", None)}]
    return {
        "id": "chatcmpl-up",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "up-model",
        "system_fingerprint": "fp_1",
        "choices": choices,
        **extra,
    }


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _sse(chunks: Sequence[dict[str, Any]], done: bool = True, eol: bytes = b"\n") -> bytes:
    out = b"".join(b"data: " + _enc(c) + eol + eol for c in chunks)
    return out + (b"data: [DONE]" + eol + eol if done else b"")


def _openai_chunks(n: int, usage: bool = True, usage_on_last: bool = False) -> list[dict[str, Any]]:
    chunks = [_chunk(i, "", role="x") for i in range(n)]
    for i in range(n):
        chunks[i]["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    for word in WORDS:
        chunks += [_chunk(i, f"{word}{i}") for i in range(n)]
    chunks += [_chunk(i, finish="stop" if i % 2 == 0 else "length") for i in range(n)]
    if usage and usage_on_last:
        chunks[-1]["usage"] = _usage(11, 9 * n)
    elif usage:
        chunks.append(_chunk(None, usage=_usage(11, 9 * n)))
    return chunks


def _pieces(text: bytes, sizes: Sequence[int]) -> list[bytes]:
    """``text`` cut into reads of the given sizes, cycling."""
    out, at, i = [], 0, 0
    while at < len(text):
        size = sizes[i % len(sizes)]
        out.append(text[at : at + size])
        at += size
        i += 1
    return out


def _events(text: bytes) -> list[bytes]:
    parts = text.split(b"\n\n")
    return [p + b"\n\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _gemini_event(
    texts: Sequence[str | None], finish: str | None = None, usage: bool = False
) -> bytes:
    candidates = []
    for i, text in enumerate(texts):
        if text is None:
            continue
        cand: dict[str, Any] = {"content": {"role": "model", "parts": [{"text": text}]}, "index": i}
        if finish:
            cand["finishReason"] = finish
        candidates.append(cand)
    event: dict[str, Any] = {
        "candidates": candidates,
        "modelVersion": "gemini-2.5-flash",
        "responseId": "g-resp-1",
    }
    if usage:
        event["usageMetadata"] = {
            "promptTokenCount": 8,
            "candidatesTokenCount": 12,
            "totalTokenCount": 20,
        }
    return b"data: " + _enc(event) + b"\r\n\r\n"


def _gemini_stream(n: int, finished: bool = True) -> bytes:
    events = [_gemini_event([w + str(i) for i in range(n)]) for w in WORDS[:5]]
    if finished:
        events.append(_gemini_event(["." for _ in range(n)], finish="STOP", usage=True))
    return b"".join(events)


def _engine_chunks(n: int) -> list[dict[str, Any]]:
    def c(choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        chunk = {
            "id": "chatcmpl-engine",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": "smollm2",
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    chunks = [
        c([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        for i in range(n)
    ]
    for word in WORDS[:4]:
        chunks += [
            c([{"index": i, "delta": {"content": word}, "finish_reason": None}]) for i in range(n)
        ]
    chunks += [
        c([{"index": i, "delta": {}, "finish_reason": "length" if i else "stop"}]) for i in range(n)
    ]
    chunks.append(c([], _usage(6, 4 * n)))
    return chunks


def _completion_chunks(n: int) -> list[dict[str, Any]]:
    def c(
        i: int | None, text: str = "", finish: str | None = None, usage: Any = None
    ) -> dict[str, Any]:
        choices = (
            []
            if i is None
            else [{"text": text, "index": i, "logprobs": None, "finish_reason": finish}]
        )
        chunk = {
            "id": "cmpl-up",
            "object": "text_completion",
            "created": 1700000000,
            "model": "up-model",
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    chunks = [c(i, w) for w in WORDS[:5] for i in range(n)]
    chunks += [c(i, "", "stop") for i in range(n)]
    chunks.append(c(None, usage=_usage(5, 5 * n)))
    return chunks


Case = Callable[[Path], Any]
CASES: dict[str, Case] = {}


def case(fn: Case) -> Case:
    CASES[fn.__name__] = fn
    return fn


def _one_read_per_event(text: bytes) -> list[bytes]:
    return _events(text)


@case
async def openai_n1_no_usage_asked(tmp: Path) -> Any:
    text = _sse(_openai_chunks(1))
    h = gateway(tmp, openai_provider(RecordedTransport([(_one_read_per_event(text), None)])))
    return await play(h, {"messages": MESSAGES, "stream": True})


@case
async def openai_n1_usage_asked(tmp: Path) -> Any:
    text = _sse(_openai_chunks(1))
    h = gateway(tmp, openai_provider(RecordedTransport([(_pieces(text, [7, 300, 41]), None)])))
    body = {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    return await play(h, body)


@case
async def openai_n4_interleaved_big_reads(tmp: Path) -> Any:
    text = _sse(_openai_chunks(4))
    h = gateway(tmp, openai_provider(RecordedTransport([(_pieces(text, [1000, 3, 2500]), None)])))
    return await play(h, {"messages": MESSAGES, "stream": True, "n": 4})


@case
async def openai_n4_usage_asked_one_read(tmp: Path) -> Any:
    text = _sse(_openai_chunks(4))
    h = gateway(tmp, openai_provider(RecordedTransport([([text], None)])))
    body = {"messages": MESSAGES, "stream": True, "n": 4, "stream_options": {"include_usage": True}}
    return await play(h, body)


@case
async def openai_usage_on_last_choice_chunk(tmp: Path) -> Any:
    text = _sse(_openai_chunks(2, usage_on_last=True))
    h = gateway(tmp, openai_provider(RecordedTransport([(_pieces(text, [200]), None)])))
    return await play(h, {"messages": MESSAGES, "stream": True, "n": 2})


@case
async def openai_crlf_comments_keepalives(tmp: Path) -> Any:
    chunks = _openai_chunks(2)
    parts = [b": keep-alive\r\n\r\n"]
    for i, c in enumerate(chunks):
        parts.append(b"event: chunk\r\ndata: " + _enc(c) + b"\r\n\r\n")
        if i % 3 == 0:
            parts.append(b": ping\r\n\r\n\r\n")
    parts.append(b"data: [DONE]\r\n\r\n")
    text = b"".join(parts)
    h = gateway(tmp, openai_provider(RecordedTransport([(_pieces(text, [13, 97, 5]), None)])))
    return await play(h, {"messages": MESSAGES, "stream": True, "n": 2})


@case
async def openai_multiline_data_and_no_space(tmp: Path) -> Any:
    chunks = _openai_chunks(1)
    parts = []
    for c in chunks:
        encoded = json.dumps(c, indent=1).encode()  # spaces, newlines: one data line each
        parts.append(b"".join(b"data:" + line + b"\n" for line in encoded.split(b"\n")) + b"\n")
    parts.append(b"data:[DONE]\n\n")
    h = gateway(tmp, openai_provider(RecordedTransport([(_pieces(b"".join(parts), [64]), None)])))
    return await play(h, {"messages": MESSAGES, "stream": True})


@case
async def openai_truncated(tmp: Path) -> Any:
    text = _sse(_openai_chunks(2)[:9], done=False)
    h = gateway(tmp, openai_provider(RecordedTransport([(_pieces(text, [150]), None)])))
    return await play(h, {"messages": MESSAGES, "stream": True, "n": 2})


@case
async def openai_last_event_unterminated(tmp: Path) -> Any:
    text = _sse(_openai_chunks(1), done=False) + b"data: [DONE]"
    h = gateway(tmp, openai_provider(RecordedTransport([(_events(text), None)])))
    return await play(h, {"messages": MESSAGES, "stream": True})


@case
async def openai_malformed_mid_stream(tmp: Path) -> Any:
    chunks = _sse(_openai_chunks(1)[:4], done=False)
    text = chunks + b"data: {not json\n\n" + _sse(_openai_chunks(1)[4:])
    h = gateway(tmp, openai_provider(RecordedTransport([([text[:30], text[30:]], None)])))
    return await play(h, {"messages": MESSAGES, "stream": True})


@case
async def openai_cut_by_upstream(tmp: Path) -> Any:
    text = _sse(_openai_chunks(2)[:7], done=False)
    cut = PayloadError("the upstream's body was cut")
    h = gateway(tmp, openai_provider(RecordedTransport([(_pieces(text, [333]), cut)])))
    return await play(h, {"messages": MESSAGES, "stream": True, "n": 2})


@case
async def openai_bytes_after_done(tmp: Path) -> Any:
    text = _sse(_openai_chunks(1)) + b"data: " + _enc(_chunk(0, "late")) + b"\n\n"
    h = gateway(tmp, openai_provider(RecordedTransport([([text], None)])))
    return await play(h, {"messages": MESSAGES, "stream": True})


@case
async def completions_n2(tmp: Path) -> Any:
    text = _sse(_completion_chunks(2))
    h = gateway(tmp, openai_provider(RecordedTransport([(_pieces(text, [90, 1]), None)])))
    return await play(h, {"prompt": "Say hi", "stream": True, "n": 2}, kind="completions")


@case
async def completions_best_of_usage_asked(tmp: Path) -> Any:
    text = _sse(_completion_chunks(1))
    h = gateway(tmp, openai_provider(RecordedTransport([(_events(text), None)])))
    body = {"prompt": "Say hi", "stream": True, "stream_options": {"include_usage": True}}
    return await play(h, body, kind="completions")


@case
async def gemini_n1(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    text = _gemini_stream(1)
    provider = gemini_provider(RecordedTransport([(_pieces(text, [50, 400]), None)]))
    h = gateway(tmp, provider, gemini=True)
    return await play(h, {"messages": MESSAGES, "stream": True})


@case
async def gemini_n2_usage_asked(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    text = _gemini_stream(2)
    provider = gemini_provider(RecordedTransport([(_pieces(text, [2000]), None)]))
    h = gateway(tmp, provider, gemini=True)
    body = {"messages": MESSAGES, "stream": True, "n": 2, "stream_options": {"include_usage": True}}
    return await play(h, body)


@case
async def gemini_cut_between_events(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    text = _gemini_stream(1, finished=False)
    provider = gemini_provider(RecordedTransport([(_pieces(text, [120]), None)]))
    h = gateway(tmp, provider, gemini=True)
    return await play(h, {"messages": MESSAGES, "stream": True})


@case
async def engine_n2(tmp: Path) -> Any:
    h = gateway(tmp, RecordedEngine(_engine_chunks(2), (4, 4)))
    return await play(h, {"messages": MESSAGES, "stream": True, "n": 2})


@case
async def engine_n1_usage_asked(tmp: Path) -> Any:
    h = gateway(tmp, RecordedEngine(_engine_chunks(1), (4,)))
    body = {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    return await play(h, body)


def _fan_out_recordings(
    k: int, sizes: Sequence[int]
) -> tuple[list[tuple[list[bytes], None]], Conductor]:
    recordings = []
    for b in range(k):
        chunks = _openai_chunks(1)
        for c in chunks:
            c["id"] = f"chatcmpl-branch{b}"
            for choice in c["choices"]:
                choice["delta"] = {
                    **choice["delta"],
                    **(
                        {"content": choice["delta"]["content"] + f"/b{b}"}
                        if "content" in choice["delta"]
                        else {}
                    ),
                }
        recordings.append((_pieces(_sse(chunks), sizes), None))
    order = []
    longest = max(len(r) for r, _ in recordings)
    for number in range(longest):
        for b, (reads, _) in enumerate(recordings):
            if number < len(reads):
                order.append((b, number))
    return recordings, Conductor(order)


@case
async def fan_out_k3(tmp: Path) -> Any:
    recordings, conductor = _fan_out_recordings(3, [180])
    transport = RecordedTransport(recordings, conductor)  # type: ignore[arg-type]
    h = gateway(tmp, openai_provider(transport), emulate=True)
    return await play(h, {"messages": MESSAGES, "stream": True, "n": 3}, conductor=conductor)


@case
async def fan_out_k2_usage_asked_big_reads(tmp: Path) -> Any:
    recordings, conductor = _fan_out_recordings(2, [700, 20])
    transport = RecordedTransport(recordings, conductor)  # type: ignore[arg-type]
    h = gateway(tmp, openai_provider(transport), emulate=True)
    body = {"messages": MESSAGES, "stream": True, "n": 2, "stream_options": {"include_usage": True}}
    return await play(h, body, conductor=conductor)


@case
async def fan_out_k2_one_truncated(tmp: Path) -> Any:
    recordings, conductor = _fan_out_recordings(2, [150])
    reads = recordings[1][0]
    recordings[1] = (reads[: len(reads) // 2], None)
    conductor.order = [t for t in conductor.order if t[0] == 0 or t[1] < len(reads) // 2]
    transport = RecordedTransport(recordings, conductor)  # type: ignore[arg-type]
    h = gateway(tmp, openai_provider(transport), emulate=True)
    return await play(h, {"messages": MESSAGES, "stream": True, "n": 2}, conductor=conductor)


def _goldens() -> dict[str, Any]:
    return json.loads(GOLDENS.read_text()) if GOLDENS.exists() else {}


@pytest.mark.parametrize("name", list(CASES))
async def test_golden_stream(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("time.time", lambda: 1700000123.0)
    fn = CASES[name]
    args: list[Any] = [tmp_path]
    if fn.__code__.co_argcount == 2:
        args.append(monkeypatch)
    got = await fn(*args)
    if os.environ.get("NCAP_RECORD_GOLDENS") == "1":
        goldens = _goldens()
        goldens[name] = got
        GOLDENS.write_text(json.dumps(goldens, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
        return
    want = _goldens()[name]
    assert got["out"] == want["out"]
    assert got == want
