"""The fan-out merge rewrites a branch chunk's id and choice index in its bytes when the
chunk is in OpenAI's form, and decodes and re-encodes it otherwise: for a chunk in the
encoder's own form both give the same bytes, and a form the splice cannot rewrite
exactly is left to the decoder."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from ncap.lifecycle.attempt_report import Tally
from ncap.lifecycle.fanout import _rebase, _recoded, _spliced, _spliced_piece
from ncap.streaming.sse import EventSplitter, StreamPiece, choice_chunks, encode_event

MERGED_ID = msgspec.json.encode("chatcmpl-req-1")


def _chunk(choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-up",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "up-model",
        "choices": [choice],
        **extra,
    }


SPLICED = {
    "text": _chunk({"index": 0, "delta": {"content": "Hello"}, "finish_reason": None}),
    "escapes and non-ASCII": _chunk(
        {"index": 0, "delta": {"content": 'é ✓ \\" \n end'}, "finish_reason": None}
    ),
    "usage null at the end": _chunk(
        {"index": 0, "delta": {"content": "x"}, "finish_reason": None}, usage=None
    ),
    "index and usage named inside a string": _chunk(
        {"index": 7, "delta": {"content": '"index":3, "usage":null}'}, "finish_reason": None}
    ),
    "a two-digit index": _chunk({"index": 12, "delta": {}, "finish_reason": "stop"}),
}

DECODED = {
    "usage with counts": _chunk(
        {"index": 0, "delta": {}, "finish_reason": "stop"}, usage={"prompt_tokens": 3}
    ),
    "usage not last": {"id": "up", "usage": None, "choices": [{"index": 0, "delta": {}}]},
    "a tool call's index": _chunk(
        {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1"}]}}
    ),
    "index not first in the choice": _chunk({"text": "hi", "index": 0, "finish_reason": None}),
    "id not first": {"model": "m", "id": "up", "choices": [{"index": 0, "delta": {}}]},
    "an escape in the id": {"id": 'a\\"b', "choices": [{"index": 0, "delta": {}}]},
    "two choices": {"id": "up", "choices": [{"index": 0}, {"index": 1}]},
}


@pytest.mark.parametrize("name", list(SPLICED))
def test_a_chunk_in_openais_form_is_spliced_to_the_re_encoded_bytes(name: str) -> None:
    data = msgspec.json.encode(SPLICED[name])
    spliced = _spliced(data, b"3", MERGED_ID)
    assert spliced is not None
    assert spliced == _recoded(data, 3, MERGED_ID)
    chunk = msgspec.json.decode(spliced)
    assert chunk["id"] == "chatcmpl-req-1" and chunk["choices"][0]["index"] == 3
    assert "usage" not in chunk


@pytest.mark.parametrize("name", list(DECODED))
def test_a_chunk_the_splice_cannot_rewrite_exactly_is_left_to_the_decoder(name: str) -> None:
    data = msgspec.json.encode(DECODED[name])
    assert _spliced(data, b"3", MERGED_ID) is None
    chunk = msgspec.json.decode(_recoded(data, 3, MERGED_ID))
    assert chunk["id"] == "chatcmpl-req-1" and "usage" not in chunk
    assert {c["index"] for c in chunk["choices"]} == {3}


def test_spaces_the_upstream_wrote_are_kept_by_the_splice() -> None:
    data = b'{"id":"up","choices":[{"index":0,"delta": {"content": "a"}}],"usage":null}'
    assert _spliced(data, b"2", MERGED_ID) == (
        b'{"id":"chatcmpl-req-1","choices":[{"index":2,"delta": {"content": "a"}}]}'
    )


def _piece(chunks: list[bytes], tail: bytes = b"") -> StreamPiece:
    piece = EventSplitter().feed(b"".join(b"data: " + c + b"\n\n" for c in chunks) + tail)
    assert piece is not None
    return piece


def _event_by_event(piece: StreamPiece, index: int) -> bytes:
    at = str(index).encode()
    return b"".join(
        encode_event(_spliced(d, at, MERGED_ID) or _recoded(d, index, MERGED_ID))
        for d in choice_chunks(piece)
    )


PLAIN = [
    msgspec.json.encode(SPLICED["text"]),
    msgspec.json.encode(SPLICED["escapes and non-ASCII"]),
]


@pytest.mark.parametrize(
    ("chunks", "tail", "whole"),
    [
        (PLAIN, b"", True),  # a branch's usual read
        ([msgspec.json.encode(SPLICED["usage null at the end"])] * 3, b"", True),
        (PLAIN * 5, b"", True),
        (PLAIN, b"data: [DONE]\n\n", False),
        (PLAIN, b": keep-alive\n\n", False),
        ([*PLAIN, msgspec.json.encode(DECODED["usage with counts"])], b"", False),
        ([*PLAIN, msgspec.json.encode(DECODED["a tool call's index"])], b"", False),
        ([msgspec.json.encode(SPLICED["a two-digit index"])], b"", False),
        ([*PLAIN, msgspec.json.encode({**SPLICED["text"], "id": "another"})], b"", False),
        ([b'{"id":"up","choices":[{"index": 0,"delta":{}}]}'], b"", False),
    ],
)
def test_a_whole_piece_is_rewritten_as_event_by_event(
    chunks: list[bytes], tail: bytes, whole: bool
) -> None:
    """The merge rewrites a branch's piece in three replacements when every event is a
    one-line chunk of one upstream id; the bytes are those of the event-by-event path,
    and any other piece takes that path."""
    piece = _piece(chunks, tail)
    assert (_spliced_piece(piece, b"3", MERGED_ID) is not None) is whole
    rebased = _rebase(piece, Tally(model="up-model"), 3, MERGED_ID)
    assert rebased == _event_by_event(piece, 3)
