"""A stream's candidates read in batches give the same evidence as the same answer
whole: whatever the batch size, the interleaving of the choices, text beside tool
calls, and the events a fan-out places at its branch's index."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

import ncap.lifecycle.evidence as feed_module
from ncap.domain.evidence import Evidence
from ncap.lifecycle.evidence import EvidenceFeed
from ncap.protocol.candidates import CandidateSummary
from ncap.protocol.responses import ResponseSummary
from ncap.streaming.sse import EventSplitter

TEXTS = [
    "The answer is  42.\nIt always was.",
    "The answer is 42. It always was.",  # the same once whitespace is normalized
    "Forty-two, said the machine, after a long while of thinking it over.",
    "",  # no text: a tool call alone
]
CALL = {"name": "lookup", "arguments": '{"q": "meaning of life", "n": 3}'}


def _deltas(index: int, rng: random.Random) -> list[dict[str, Any]]:
    """Choice ``index``'s stream: its text cut at random points, then (for the last
    two choices) a tool call whose arguments come in pieces, text again after it."""
    text, out = TEXTS[index], [{"role": "assistant", "content": ""}]
    cuts = sorted(rng.sample(range(1, len(text)), min(6, max(len(text) - 1, 0))))
    bounds = zip([0, *cuts], [*cuts, len(text)], strict=True)
    out += [{"content": text[a:b]} for a, b in bounds if a < b]
    if index >= 2:
        args = CALL["arguments"]
        head = {"index": 0, "id": "call_1", "type": "function"}
        out.append({"tool_calls": [{**head, "function": {"name": CALL["name"], "arguments": ""}}]})
        out += [
            {"tool_calls": [{"index": 0, "function": {"arguments": args[i : i + 5]}}]}
            for i in range(0, len(args), 5)
        ]
        out.append({"content": " (done)", "tool_calls": [{"index": 0, "function": {}}]})
    return out


def _stream(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    queues = {i: _deltas(i, rng) for i in range(len(TEXTS))}
    events = []
    while queues:
        i = rng.choice(sorted(queues))
        delta = queues[i].pop(0)
        events.append(json.dumps({"choices": [{"index": i, "delta": delta}]}).encode())
        if not queues[i]:
            events.append(
                json.dumps(
                    {"choices": [{"index": i, "delta": {}, "finish_reason": "stop"}]}
                ).encode()
            )
            del queues[i]
    return events


def _whole(seed: int) -> bytes:
    """The same answer as one body: each choice's text and calls joined."""
    rng = random.Random(seed)
    choices = []
    for i in range(len(TEXTS)):
        deltas = _deltas(i, rng)
        text = "".join(d.get("content") or "" for d in deltas)
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if i >= 2:
            message["tool_calls"] = [{"id": "call_1", "type": "function", "function": CALL}]
        choices.append({"index": i, "message": message})
    return json.dumps({"choices": choices}).encode()


def _event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def _streamed(events: list[bytes]) -> Evidence | None:
    """One event per relayed piece (the common read)."""
    feed = EvidenceFeed()
    for data in events:
        feed.piece(_event(data))
    return feed.finish()


@pytest.mark.parametrize("hold", [1, 40, 300, 64 * 1024])
@pytest.mark.parametrize("seed", range(5))
def test_batched_stream_agrees_with_the_whole_answer(
    hold: int, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(feed_module, "HOLD_BYTES", hold)
    whole = EvidenceFeed()
    whole.body(_whole(seed))
    expected = whole.finish()
    # choices 0 and 1 agree once normalized; 2 and 3 call the same tool, with
    # different text beside it
    assert expected == Evidence(compared=4, distinct=3, majority=2, tool_calls=2)
    assert _streamed(_stream(seed)) == expected


def test_a_merged_write_holds_several_candidates() -> None:
    """The fan-out merge writes what arrived together from its branches, each choice at
    its branch's index: one piece, several candidates."""
    feed = EvidenceFeed()
    for half in (slice(0, 2), slice(2, None)):
        write = b"".join(
            _event(json.dumps({"choices": [{"index": i, "delta": {"content": t[half]}}]}).encode())
            for i, t in enumerate(["same", "same", "other"])
        )
        feed.piece(write)
    assert feed.finish() == Evidence(compared=3, distinct=2, majority=2, tool_calls=0)


def test_an_unreadable_event_means_no_evidence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(feed_module, "HOLD_BYTES", 100)
    events = _stream(1)
    events[3] = b'{"choices": [{"index": "zero"}]}'  # a shape the candidates cannot use
    assert _streamed(events) is None


def test_a_cut_stream_gives_no_evidence() -> None:
    feed = EvidenceFeed()
    for data in _stream(2)[:10]:
        feed.piece(_event(data))
    assert feed.finish(complete=False) is None


def test_text_before_a_delta_read_alone_keeps_its_place() -> None:
    """Choice 0's " world" arrives on a tool-call delta (read on its own), after
    "hello": its text is still "hello world", as choice 1's."""
    call = {"index": 0, "function": {"name": "f", "arguments": "{}"}}
    events = [
        {"index": 0, "delta": {"content": "hello"}},
        {"index": 1, "delta": {"content": "hello world"}},
        {"index": 0, "delta": {"content": " world", "tool_calls": [call]}},
        {"index": 1, "delta": {"tool_calls": [call]}},
    ]
    feed = EvidenceFeed()
    for choice in events:
        feed.piece(_event(json.dumps({"choices": [choice]}).encode()))
    assert feed.finish() == Evidence(compared=2, distinct=1, majority=2, tool_calls=2)


def _sse(events: list[bytes], crlf: bool) -> bytes:
    """The stream as an upstream sends it: a comment, the events, a usage chunk with no
    choices, ``[DONE]``; ``\\r\\n`` line ends or ``\\n``."""
    usage = b'{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}}'
    lines = [b": keep-alive", *(b"data: " + e for e in events), b"data: " + usage]
    lines.append(b"data: [DONE]")
    end = b"\r\n" if crlf else b"\n"
    return b"".join(line + end + end for line in lines)


@pytest.mark.parametrize("read", ["bytes", "summaries"])
@pytest.mark.parametrize("crlf", [False, True])
@pytest.mark.parametrize("hold", [1, 500, 64 * 1024])
@pytest.mark.parametrize("seed", range(4))
def test_relayed_pieces_cut_anywhere_agree_with_the_whole_answer(
    seed: int, hold: int, crlf: bool, read: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay's pieces (what ``EventSplitter`` makes of reads cut at random byte
    offsets: events split across reads, several in one), their bytes read in batches,
    or their summaries read with the candidates' text by the splitter itself."""
    monkeypatch.setattr(feed_module, "HOLD_BYTES", hold)
    monkeypatch.setattr(feed_module, "_PENDING_PARTS", hold // 100 + 1)
    whole = EvidenceFeed()
    whole.body(_whole(seed))
    body, rng = _sse(_stream(seed), crlf), random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(body)), 60))
    splitter, feed = EventSplitter(), EvidenceFeed()
    if read == "summaries":
        splitter.read_candidates()
    for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True):
        piece = splitter.feed(body[a:b])
        if piece is not None:
            wanted = CandidateSummary if read == "summaries" else ResponseSummary
            assert all(type(s) is wanted for s in piece.summaries)
            feed.piece(piece.raw, piece.summaries)
    assert splitter.done and splitter.failure is None
    assert feed.finish() == whole.finish()
