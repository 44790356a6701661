"""Pins found by mutation testing (docs/mutation.md): each reply's status and headers
exactly, and the fan-out's merged answer and merged stream event by event (the usage
chunk it writes, the error event of a branch that ended early or failed, the cut each
branch is settled with), over the scripted provider, socket-free."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ncap.errors import Overloaded, UpstreamError
from ncap.providers.base import AttemptFailed
from ncap.streaming.sse import StreamPiece, iter_pieces
from ncap.testing.scripted import Answer, Fail, ScriptedProvider, Stream, chat_body, chunk, sse
from tests.lifecycle.harness import CALLER, EMULATE, Harness, drain, events, harness, route, settled

_encode = msgspec.json.Encoder().encode
STREAMED = {"content-type": "text/event-stream", "cache-control": "no-cache"}


def _reserved(h: Harness, request_id: str = "req-1") -> Any:
    async def total() -> str:
        rows = await h.rows(request_id)
        whole = rows[0].reserved_input_tokens + rows[0].reserved_output_tokens
        return str(whole * (len(rows) if len(rows) > 1 else 1))

    return total()


async def test_a_whole_answer_and_its_headers(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Answer(chat_body("x", "y"))]))})
    reply = await h.chat(n=2, temperature=1.0)
    assert reply.status == 200 and reply.stream is None and reply.settling
    await settled(h.gateway)
    assert reply.headers == {
        "x-ncap-route": "a",
        "x-ncap-candidates-requested": "2",
        "x-ncap-candidates-effective": "2",
        "x-ncap-reserved-tokens": await _reserved(h),
        "x-ncap-candidates-returned": "2",
        "x-ncap-candidates-distinct": "2",
        "x-ncap-candidates-agreement": "0.500",
        "content-type": "application/json",
    }


async def test_a_request_without_n_says_omitted(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Answer(chat_body("x"))]))})
    reply = await h.chat()
    assert reply.settling
    await settled(h.gateway)
    assert reply.headers["x-ncap-candidates-requested"] == "omitted"
    assert reply.headers["x-ncap-candidates-effective"] == "1"
    assert reply.headers["x-ncap-candidates-returned"] == "1"


async def test_a_stream_and_its_headers(tmp_path: Path) -> None:
    text = sse(chunk(0, "hi", finish="stop"), chunk(None, usage=(3, 1)))
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Stream(text)]))})
    reply = await h.chat(n=1, stream=True)
    assert reply.status == 200 and reply.stream is not None
    await drain(reply.stream)
    assert reply.headers == {
        "x-ncap-route": "a",
        "x-ncap-candidates-requested": "1",
        "x-ncap-candidates-effective": "1",
        "x-ncap-reserved-tokens": await _reserved(h),
        **STREAMED,
    }


# -- fan-out, whole answers ------------------------------------------------------------------


def _body(text: str, *, model: str, usage: tuple[int, int] | None = (4, 1)) -> bytes:
    body = msgspec.json.decode(chat_body(text, usage=usage, id_=f"up-{text}"))
    body["model"] = model
    return _encode(body)


async def test_a_fan_out_answer_its_headers_and_the_first_branchs_fields(tmp_path: Path) -> None:
    provider = ScriptedProvider([Answer(_body("x", model="m-1")), Answer(_body("y", model="m-2"))])
    h = harness(tmp_path, {"a": (route(EMULATE), provider)})
    reply = await h.chat(n=2, temperature=1.0)
    assert reply.status == 200 and reply.settling
    await settled(h.gateway)
    assert reply.headers == {
        "x-ncap-route": "a",
        "x-ncap-candidates-requested": "2",
        "x-ncap-candidates-effective": "2",
        "x-ncap-reserved-tokens": await _reserved(h),
        "x-ncap-candidates-returned": "2",
        "x-ncap-candidates-distinct": "2",
        "x-ncap-candidates-agreement": "0.500",
        "content-type": "application/json",
    }
    body = msgspec.json.decode(reply.body)
    assert (body["id"], body["model"], body["object"]) == (
        "chatcmpl-req-1",
        "m-1",
        "chat.completion",
    )
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}


async def test_a_fan_out_answer_without_every_branchs_usage_has_none(tmp_path: Path) -> None:
    provider = ScriptedProvider(
        [Answer(_body("x", model="m-1")), Answer(_body("y", model="m-1", usage=None))]
    )
    h = harness(tmp_path, {"a": (route(EMULATE), provider)})
    reply = await h.chat(n=2, temperature=1.0)
    assert reply.settling
    await settled(h.gateway)
    body = msgspec.json.decode(reply.body)
    assert "usage" not in body
    assert [c["index"] for c in body["choices"]] == [0, 1]


# -- fan-out, streams ------------------------------------------------------------------------


def _bare(index: int | None, content: str | None = None, **kw: Any) -> dict[str, Any]:
    """A chunk as some upstreams send it: no ``model``."""
    out = chunk(index, content, **kw)
    del out["model"]
    return out


def _branch(*chunks: dict[str, Any], done: bool = True, **kw: Any) -> Stream:
    return Stream(sse(*chunks, done=done), **kw)


def _ok(text: str, usage: tuple[int, int] = (4, 1)) -> Stream:
    return _branch(chunk(0, text), chunk(0, finish="stop"), chunk(None, usage=usage))


async def _fan_out_stream(h: Harness, **body: Any) -> tuple[Any, list[Any]]:
    reply = await h.chat(n=2, temperature=1.0, stream=True, **body)
    return reply, events(await drain(reply.stream))


async def test_the_merged_streams_usage_chunk_exactly(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(EMULATE), ScriptedProvider([_ok("x"), _ok("y", (5, 2))]))})
    before = int(time.time())
    reply, out = await _fan_out_stream(h, stream_options={"include_usage": True})
    assert reply.status == 200
    assert reply.headers == {
        "x-ncap-route": "a",
        "x-ncap-candidates-requested": "2",
        "x-ncap-candidates-effective": "2",
        "x-ncap-reserved-tokens": await _reserved(h),
        **STREAMED,
    }
    *_, usage, done = out
    assert done == "[DONE]"
    assert before <= usage.pop("created") <= int(time.time())
    assert usage == {
        "id": "chatcmpl-req-1",
        "object": "chat.completion.chunk",
        "model": "scripted",
        "choices": [],
        "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
    }


async def test_the_usage_chunk_names_the_alias_when_no_branch_named_a_model(
    tmp_path: Path,
) -> None:
    def bare(text: str) -> Stream:
        return _branch(_bare(0, text), _bare(0, finish="stop"), _bare(None, usage=(4, 1)))

    h = harness(tmp_path, {"a": (route(EMULATE), ScriptedProvider([bare("x"), bare("y")]))})
    _, out = await _fan_out_stream(h, stream_options={"include_usage": True})
    assert out[-2]["model"] == "m"


async def test_without_include_usage_the_merged_stream_has_no_usage(tmp_path: Path) -> None:
    # the last choice chunk carries usage too: the merged stream drops it
    def branch(text: str) -> Stream:
        return _branch(chunk(0, text), chunk(0, finish="stop", usage=(4, 1)))

    h = harness(tmp_path, {"a": (route(EMULATE), ScriptedProvider([branch("x"), branch("y")]))})
    _, out = await _fan_out_stream(h)
    assert out[-1] == "[DONE]" and all("usage" not in c for c in out[:-1])
    assert len(out) == 5  # two chunks per branch, one [DONE]
    assert [r.state for r in await h.rows()] == ["settled", "settled"]


async def test_a_usage_chunk_is_left_out_when_a_branch_reported_none(tmp_path: Path) -> None:
    silent = _branch(chunk(0, "y"), chunk(0, finish="stop"))
    h = harness(tmp_path, {"a": (route(EMULATE), ScriptedProvider([_ok("x"), silent]))})
    _, out = await _fan_out_stream(h, stream_options={"include_usage": True})
    assert out[-1] == "[DONE]" and all(c == "[DONE]" or c["choices"] for c in out)


async def test_an_unusual_done_spelling_still_ends_a_branch(tmp_path: Path) -> None:
    text = sse(chunk(0, "y"), chunk(0, finish="stop"), chunk(None, usage=(4, 1)), done=False)
    terse = Stream(text + b"data:[DONE]\n\n")
    h = harness(tmp_path, {"a": (route(EMULATE), ScriptedProvider([_ok("x"), terse]))})
    _, out = await _fan_out_stream(h)
    assert out[-1] == "[DONE]"
    assert [r.state for r in await h.rows()] == ["settled", "settled"]


def _failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [m for m in caplog.messages if m.startswith("upstream failure")]


async def test_a_branch_that_ends_early_ends_the_merged_stream_with_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a keep-alive is not an end: the branch stops with neither [DONE] nor a finish
    short = Stream(sse(chunk(0, "y"), done=False) + b": keep-alive\n\n")
    h = harness(tmp_path, {"a": (route(EMULATE), ScriptedProvider([_ok("x"), short]))})
    with caplog.at_level(logging.INFO, "ncap.lifecycle"):
        _, out = await _fan_out_stream(h)
    assert out[-1] == msgspec.json.decode(
        _encode(UpstreamError("An upstream stream ended early.").envelope())
    )
    assert "[DONE]" not in out
    done, cut = await h.rows()
    assert done.state == "settled"
    assert (cut.state, cut.reconciliation_reason) == ("pending", "stream_cut")
    assert _failures(caplog) == [
        "upstream failure: request=req-1 workload=default route=a attempt=2 status=- "
        "reason=stream_truncated outcome=stream_cut"
    ]


async def test_a_branch_that_fails_mid_way_ends_the_merged_stream_with_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    failing = _branch(chunk(0, "y"), done=False, then=AttemptFailed("connection", partial=True))
    h = harness(tmp_path, {"a": (route(EMULATE), ScriptedProvider([failing, _ok("x")]))})
    with caplog.at_level(logging.INFO, "ncap.lifecycle"):
        _, out = await _fan_out_stream(h)
    assert out[-1] == msgspec.json.decode(
        _encode(UpstreamError("An upstream stream failed mid-way.").envelope())
    )
    rows = await h.rows()
    assert (rows[0].attempt, rows[0].state) == (1, "pending")
    assert (
        "upstream failure: request=req-1 workload=default route=a attempt=1 status=- "
        "reason=upstream_reset outcome=stream_cut"
    ) in _failures(caplog)


async def test_a_client_that_leaves_a_fan_out_is_not_an_upstream_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # branches still streaming when the client leaves (what arrived together goes out in
    # one write: branches that had already ended would be settled, not cut)
    h = harness(tmp_path, {"a": (route(EMULATE), Stalling([]))})
    reply = await h.chat(n=2, temperature=1.0, stream=True)
    assert reply.stream is not None
    with caplog.at_level(logging.INFO, "ncap.lifecycle"):
        await anext(reply.stream)
        await reply.stream.aclose()  # type: ignore[attr-defined]
    rows = await h.rows()
    assert [(r.state, r.reconciliation_reason) for r in rows] == [("pending", "stream_cut")] * 2
    assert [r.provider_request_id for r in rows] == ["stall-1", "stall-2"]
    assert _failures(caplog) == []


class Stalling(ScriptedProvider):
    """Branches that send one chunk, then wait (for a client that leaves first)."""

    @asynccontextmanager
    async def stream(
        self, body: Mapping[str, Any], *, timeout: float, kind: Any = "chat"
    ) -> AsyncIterator[tuple[str | None, AsyncIterator[StreamPiece]]]:
        self.sent.append(body)

        async def events() -> AsyncIterator[StreamPiece]:
            async for piece in iter_pieces(_one(sse(chunk(0, "x"), done=False))):
                yield piece
            await asyncio.Event().wait()  # never set: the pump is cancelled
            yield StreamPiece(b"", [])  # pragma: no cover

        yield f"stall-{len(self.sent)}", events()


async def _one(text: bytes) -> AsyncIterator[bytes]:
    yield text


async def test_a_client_leaving_while_branches_still_stream_settles_them(
    tmp_path: Path,
) -> None:
    h = harness(tmp_path, {"a": (route(EMULATE), Stalling([]))})
    reply = await h.chat(n=2, temperature=1.0, stream=True)
    assert reply.stream is not None
    await anext(reply.stream)
    await reply.stream.aclose()  # type: ignore[attr-defined]
    rows = await h.rows()
    assert [(r.state, r.provider_request_id) for r in rows] == [
        ("pending", "stall-1"),
        ("pending", "stall-2"),
    ]


async def test_an_aborted_fan_out_logs_why_and_sends_each_branch_the_body(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    provider = ScriptedProvider([_ok("x"), Fail(AttemptFailed("status", 404))])
    h = harness(tmp_path, {"a": (route(EMULATE), provider)})
    with caplog.at_level(logging.INFO, "ncap.lifecycle"), pytest.raises(UpstreamError):
        await h.chat(n=2, temperature=1.0, stream=True)
    assert (
        "upstream failure: request=req-1 workload=default route=a attempt=1 status=- "
        "reason=fan_out_aborted outcome=stream_cut"
    ) in caplog.messages
    assert [b["messages"] for b in provider.sent] == [[{"role": "user", "content": "hi"}]] * 2
    assert all("n" not in b for b in provider.sent)


async def test_a_providers_own_refusal_of_a_branch_reaches_the_client(tmp_path: Path) -> None:
    for stream in (False, True):
        provider = ScriptedProvider(
            [_ok("x") if stream else Answer(chat_body("x")), Fail(Overloaded("busy"))]
        )
        h = harness(tmp_path, {"a": (route(EMULATE), provider)})
        with pytest.raises(Overloaded, match=r"^busy$"):
            await h.chat(f"req-{stream}", n=2, temperature=1.0, stream=stream)


async def test_a_fan_out_whose_first_branch_has_no_usage_has_none(tmp_path: Path) -> None:
    provider = ScriptedProvider(
        [Answer(_body("x", model="m-1", usage=None)), Answer(_body("y", model="m-1"))]
    )
    h = harness(tmp_path, {"a": (route(EMULATE), provider)})
    reply = await h.chat(n=2, temperature=1.0)
    assert reply.settling
    await settled(h.gateway)
    assert "usage" not in msgspec.json.decode(reply.body)


def _text_chunk(
    text: str | None, *, finish: str | None = None, usage: tuple[int, int] | None = None
) -> dict[str, Any]:
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": finish}]
    out: dict[str, Any] = {
        "id": "cmpl-up",
        "object": "text_completion",
        "created": 1,
        "model": "scripted",
        "choices": choices,
    }
    if usage is not None:
        out["usage"] = {
            "prompt_tokens": usage[0],
            "completion_tokens": usage[1],
            "total_tokens": sum(usage),
        }
    return out


async def test_a_legacy_fan_out_stream_speaks_text_completion(tmp_path: Path) -> None:
    def branch(text: str) -> Stream:
        return _branch(_text_chunk(text, finish="stop"), _text_chunk(None, usage=(3, 1)))

    h = harness(tmp_path, {"a": (route(EMULATE), ScriptedProvider([branch("a"), branch("b")]))})
    raw = msgspec.json.encode(
        {
            "model": "m",
            "prompt": "hi",
            "n": 2,
            "temperature": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    reply = await h.gateway.completions(raw, CALLER, "req-1")
    out = events(await drain(reply.stream))
    *chunks, usage, done = out
    assert done == "[DONE]"
    assert {c["id"] for c in chunks} == {"cmpl-req-1"}
    assert (usage["id"], usage["object"]) == ("cmpl-req-1", "text_completion")
    assert usage["usage"] == {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}
