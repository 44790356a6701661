"""Fan-out emulation: n by k = k single-candidate requests on a route without native
n. Every branch is an attempt with its own ledger row and hold (each prefill is paid
and recorded), all or nothing, merged in branch order: whole bodies re-indexed, or k
streams relayed as one with each branch's choice at its own ``index``, usage summed.

Branches are independent draws: a client's ``seed`` s goes to branch i as s + i, since
a provider that honours seeds would otherwise return k copies of one answer at k times
the cost (``branch_body``). On a route whose provider caches prompts, branch 0 goes
first and the others once it answered (streamed: its first event), so they read its
prompt from the cache at the cached rate (``primed``).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgspec

from ncap.domain.evidence import Evidence
from ncap.errors import NcapError, UpstreamError
from ncap.lifecycle.attempt_report import Tally, answered_report, stream_report, summed_usage
from ncap.lifecycle.attempts import Attempts, StreamOpen
from ncap.lifecycle.evidence import EvidenceFeed, evidence_headers
from ncap.lifecycle.failures import client_error
from ncap.lifecycle.plan import Attempt, Holds, Plan, Reply, RouteRuntime
from ncap.lifecycle.relay import error_event
from ncap.lifecycle.settle import Accounting
from ncap.providers.base import AttemptFailed, UpstreamResult
from ncap.streaming.sse import DONE, StreamPiece, choice_chunks, encode_event

__all__ = ["FanOut", "branch_body", "cache_breakpoint", "primed"]

_encode = msgspec.json.Encoder().encode
Branch = tuple[Attempt, StreamOpen]
_SEED_SPAN = 2**64
T = TypeVar("T")
Item = tuple[int, StreamPiece | BaseException | None]


class FanOut:
    def __init__(self, accounting: Accounting, attempts: Attempts) -> None:
        self.accounting = accounting
        self.attempts = attempts

    async def complete(
        self, plan: Plan, holds: Holds, body: dict[str, Any], rt: RouteRuntime
    ) -> Reply:
        branches = await self._start(plan, holds, rt)
        results = await self._sent(branches, body, rt, self.attempts.call)
        answered = [
            (a, r) for a, r in zip(branches, results, strict=True) if isinstance(r, UpstreamResult)
        ]
        failures = [r for r in results if isinstance(r, BaseException)]
        evidence = None if failures else _evidence([r for _, r in answered])
        # the candidates' evidence goes on the first branch's row (once per request)
        reports = [
            (a, answered_report(r, evidence if i == 0 else None))
            for i, (a, r) in enumerate(answered)
        ]
        if failures:  # all or nothing: the answered branches are settled (they were paid)
            await self.accounting.answered_together(reports)
            raise _raised(failures[0])
        merged, returned = _merge(_id(plan), [r for _, r in answered])
        headers = plan.headers(rt.id)
        headers["x-ncap-candidates-returned"] = str(returned)
        headers.update(evidence_headers(evidence))
        headers["content-type"] = "application/json"
        self.accounting.answered_beside(reports)
        return Reply(200, headers, merged, settling=True)

    async def stream(
        self, plan: Plan, holds: Holds, body: dict[str, Any], rt: RouteRuntime
    ) -> Reply:
        """k streams opened together (all or nothing before the first byte)."""
        started = await self._start(plan, holds, rt)
        opened = await self._sent(started, body, rt, self.attempts.open)
        branches = [
            (a, o) for a, o in zip(started, opened, strict=True) if isinstance(o, StreamOpen)
        ]
        failures = [o for o in opened if isinstance(o, BaseException)]
        if failures:
            await self._abort(branches)
            raise _raised(failures[0])
        headers = plan.headers(rt.id)
        headers.update({"content-type": "text/event-stream", "cache-control": "no-cache"})
        return Reply(200, headers, stream=self._relay(plan, branches))

    async def _start(self, plan: Plan, holds: Holds, rt: RouteRuntime) -> list[Attempt]:
        """The k branches' reserved rows, written together so that they share one group
        commit."""
        k = plan.decision.effective
        begun = (self.accounting.begin(plan, holds, n, rt) for n in range(1, k + 1))
        return list(await asyncio.gather(*begun))

    async def _sent(
        self,
        branches: Sequence[Attempt],
        body: dict[str, Any],
        rt: RouteRuntime,
        send: Callable[[Attempt, dict[str, Any]], Awaitable[T]],
    ) -> list[T | BaseException]:
        """Every branch sent (a whole answer, or a stream up to its first event), each
        with its own seed. Cache-primed (``primed``): branch 0 alone first, the others
        once it answered, when its prompt is in the provider's cache; if branch 0 fails
        the others are never sent (their rows close as refused, at zero)."""
        bodies = [branch_body(body, i) for i in range(len(branches))]
        if not primed(rt, len(branches)):
            calls = (send(a, b) for a, b in zip(branches, bodies, strict=True))
            return list(await asyncio.gather(*calls, return_exceptions=True))
        if rt.capabilities.prompt_cache == "explicit":
            bodies = [cache_breakpoint(b) for b in bodies]
        (first,) = await asyncio.gather(send(branches[0], bodies[0]), return_exceptions=True)
        if isinstance(first, BaseException):
            for attempt in branches[1:]:
                await self.accounting.failed(attempt, _not_sent())
            return [first] * len(branches)
        rest = (send(a, b) for a, b in zip(branches[1:], bodies[1:], strict=True))
        return [first, *await asyncio.gather(*rest, return_exceptions=True)]

    async def _abort(self, branches: Sequence[Branch]) -> None:
        """Branches that opened when another did not: closed, and held as cut streams
        (they may have started generating)."""
        for attempt, branch in branches:
            await branch.stack.aclose()
            report = stream_report(Tally(branch.provider_request_id), "fan_out_aborted")
            await self.accounting.stream_finished(attempt, report)

    async def _relay(self, plan: Plan, branches: Sequence[Branch]) -> AsyncIterator[bytes]:
        queue = _Arrivals()
        tallies = [Tally(provider_request_id=b.provider_request_id) for _, b in branches]
        pumps = [asyncio.create_task(_pump(i, b, queue)) for i, (_, b) in enumerate(branches)]
        feed = EvidenceFeed()  # the branches' candidates, each at its branch's index
        cut: str | None = "client_disconnect"
        try:
            async for out in _merged(plan, queue, tallies, feed):
                yield out
            cut = None if all(t.done for t in tallies) else "stream_truncated"
            for out in _ending(plan, tallies, cut):
                yield out
        except (AttemptFailed, NcapError) as exc:
            health = branches[0][0].route.health  # every branch is on the same route
            if health is not None:
                health.failed(exc)  # a branch's upstream failed mid-way
            cut = "upstream_reset"
            yield error_event(UpstreamError("An upstream stream failed mid-way."))
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            evidence = feed.finish(complete=cut is None)
            await asyncio.shield(self._settle_streams(branches, tallies, cut, evidence))

    async def _settle_streams(
        self,
        branches: Sequence[Branch],
        tallies: Sequence[Tally],
        cut: str | None,
        evidence: Evidence | None,
    ) -> None:
        for i, ((attempt, branch), tally) in enumerate(zip(branches, tallies, strict=True)):
            await branch.stack.aclose()
            ended = None if tally.done else (cut or "stream_truncated")
            report = stream_report(tally, ended, evidence if i == 0 else None)
            await self.accounting.stream_finished(attempt, report)


def _not_sent() -> AttemptFailed:
    """A branch a cache-primed fan-out never sent, because branch 0 failed: it left
    nothing (refused, settled at zero)."""
    return AttemptFailed("connection", dispatched=False, detail="fan_out_not_sent")


def primed(rt: RouteRuntime, k: int) -> bool:
    """Whether a fan-out of ``k`` on ``rt`` primes the provider's prompt cache: the
    route's contract says its provider caches prompts and the route did not turn it off.
    The cost is about one time to first token (the others wait for branch 0's)."""
    route = rt.route
    return k > 1 and route.contract.prompt_cache and route.fanout_cache_priming


def cache_breakpoint(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with the prompt's last content part marked by OpenAI's
    ``prompt_cache_breakpoint`` (a provider that caches only where told, Anthropic,
    caches the prompt up to it); a message without a markable part is left as it is."""
    messages = list(body.get("messages") or [])
    if not messages or not isinstance(messages[-1], dict):
        return body
    last = dict(messages[-1])
    content = last.get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(parts, list) or not parts or parts[-1].get("type") == "refusal":
        return body
    parts = [*parts[:-1], {**parts[-1], "prompt_cache_breakpoint": {"mode": "explicit"}}]
    messages[-1] = {**last, "content": parts}
    return {**body, "messages": messages}


def branch_body(body: dict[str, Any], index: int) -> dict[str, Any]:
    """Branch ``index``'s body: the client's integer ``seed`` s becomes s + index, so
    that a provider honouring seeds draws k different answers; otherwise ``body``."""
    seed = body.get("seed")
    if index == 0 or not isinstance(seed, int) or isinstance(seed, bool):
        return body
    # wrapped into the signed 64-bit range the request's seed was validated against
    return {**body, "seed": (seed + index + _SEED_SPAN // 2) % _SEED_SPAN - _SEED_SPAN // 2}


def _raised(failure: BaseException) -> BaseException:
    return client_error(failure) if isinstance(failure, AttemptFailed) else failure


async def _merged(
    plan: Plan, queue: _Arrivals, tallies: Sequence[Tally], feed: EvidenceFeed
) -> AsyncIterator[bytes]:
    """The branches' pieces as they come (one per upstream read), until every branch
    ended; what arrived together (from several branches) goes out in one write, in
    arrival order. A failure raises, after what arrived before it."""
    live = len(tallies)
    merged_id = _encode(_id(plan))
    while live:
        out: list[bytes] = []
        failure: BaseException | None = None
        for index, item in await queue.taken():
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                failure = item
                break
            else:
                out.append(_rebase(item, tallies[index], index, merged_id))
        joined = b"".join(out)
        if joined:
            feed.piece(joined)  # each branch's choice at its index already
            yield joined
        if failure is not None:
            raise failure


class _Arrivals:
    """The branches' pieces in arrival order, for the one merge that takes them all at
    once (an ``asyncio.Queue`` does more per item than this needs: no size bound, one
    reader, everything taken together)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[Item] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def taken(self) -> list[Item]:
        """Everything that arrived since the last call, once something has."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


def _ending(plan: Plan, tallies: Sequence[Tally], cut: str | None) -> list[bytes]:
    """The merged stream's one usage chunk (summed) and its one ``[DONE]``, or the
    error event of a stream that ended early."""
    if cut:
        return [error_event(UpstreamError("An upstream stream ended early."))]
    usage = summed_usage([t.usage for t in tallies])
    if not plan.client_wants_usage or usage is None:
        return [DONE]
    model = next((t.model for t in tallies if t.model), plan.alias)
    return [_usage_chunk(plan, model, usage), DONE]


async def _pump(index: int, branch: StreamOpen, queue: _Arrivals) -> None:
    """One branch's pieces into the shared arrivals; None when it ends, or its failure."""
    try:
        if branch.first is not None:
            queue.put((index, branch.first))
            async for piece in branch.events:
                queue.put((index, piece))
    except (AttemptFailed, NcapError) as exc:
        queue.put((index, exc))
        return
    queue.put((index, None))


def _id(plan: Plan) -> str:
    """The merged answer's id, in the endpoint's own prefix."""
    return f"{'chatcmpl' if plan.kind == 'chat' else 'cmpl'}-{plan.request_id}"


def _rebase(piece: StreamPiece, tally: Tally, index: int, merged_id: bytes) -> bytes:
    """A branch's piece as the merged stream's: each chunk's choice moved to the branch's
    index, the merged id; its own usage chunk, ``[DONE]`` and comments kept back (the
    merged stream ends once, with the usage summed)."""
    if piece.done:
        tally.done = True
    tally.add_all(piece.summaries)
    at = str(index).encode()
    if tally.model:
        whole = _spliced_piece(piece, at, merged_id)
        if whole is not None:
            return whole
    out = []
    for data in choice_chunks(piece):
        if not tally.model:
            tally.model = _model_of(data)
        out.append(encode_event(_spliced(data, at, merged_id) or _recoded(data, index, merged_id)))
    return b"".join(out)


def _spliced_piece(piece: StreamPiece, index: bytes, merged_id: bytes) -> bytes | None:
    """``_spliced`` over a whole piece at once, when each of its events is a one-line
    chunk that ``_spliced`` rewrites and they share one upstream id (a branch's usual
    read: its one choice's chunks, nothing else): three replacements over the piece's
    bytes, each checked to hit every event exactly once. None otherwise (``[DONE]``, a
    comment, the usage chunk, a tool call's own ``"index"``, spacing of another form):
    the piece is then rewritten event by event."""
    raw, count = piece.raw, len(piece.summaries)
    if not count or raw.count(b"\n") != 2 * count or not raw.startswith(_EVENT_ID_HEAD):
        return None
    head = raw[: raw.find(b'"', len(_EVENT_ID_HEAD)) + 1]  # data: {"id":"<branch's id>"
    if len(head) <= len(_EVENT_ID_HEAD) or b"\\" in head or raw.count(head) != count:
        return None
    if raw.count(_INDEX_KEY) != count or raw.count(_FIRST_INDEX_0) != count:
        return None
    usage = raw.count(b'"usage"')
    if usage and raw.count(_NULL_USAGE_END) != usage:
        return None
    out = raw.replace(head, b"data: {" + b'"id":' + merged_id)
    out = out.replace(_FIRST_INDEX_0, _FIRST_INDEX + index)
    return out.replace(_NULL_USAGE_END, b"}\n\n") if usage else out


_ID_HEAD = b'{"id":"'
_INDEX_KEY = b'"index":'
_CHOICE_INDEX = re.compile(rb'"choices":\[\{"index":(\d+)')
_NULL_USAGE = b',"usage":null}'
_EVENT_ID_HEAD = b"data: " + _ID_HEAD
_FIRST_INDEX = b'"choices":[{"index":'
_FIRST_INDEX_0 = _FIRST_INDEX + b"0"
_NULL_USAGE_END = _NULL_USAGE + b"\n\n"


def _spliced(data: bytes, index: bytes, merged_id: bytes) -> bytes | None:
    """The chunk with the merged id and the branch's index written over its own, every
    other byte as the upstream sent it; a ``"usage":null`` it ends with dropped. None
    unless the chunk is in the form this rewrites exactly, OpenAI's: the id first and
    without escapes, one choice with its ``index`` first (``"choices":[{"index":N``),
    no other ``"index"`` anywhere (a tool call's, or one in a string), no other
    ``"usage"``. A chunk in the encoder's own form gives the bytes ``_recoded`` would."""
    if not data.startswith(_ID_HEAD):
        return None
    id_end = data.find(b'"', 7)
    if id_end < 0 or b"\\" in data[7:id_end] or data.count(_INDEX_KEY) != 1:
        return None
    found = _CHOICE_INDEX.search(data, id_end)
    if found is None:
        return None
    start, stop = found.span(1)
    tail = data[stop:]
    if b'"usage"' in tail:
        if not tail.endswith(_NULL_USAGE) or tail.count(b'"usage"') != 1:
            return None
        tail = tail[: -len(_NULL_USAGE)] + b"}"
    if b'"usage"' in data[:start]:
        return None
    return b"".join((b'{"id":', merged_id, data[id_end + 1 : start], index, tail))


def _recoded(data: bytes, index: int, merged_id: bytes) -> bytes:
    """The chunk decoded, its id, its choices' index and usage set, encoded again."""
    chunk = msgspec.json.decode(data)
    chunk["id"] = msgspec.json.decode(merged_id)
    chunk.pop("usage", None)
    for choice in chunk.get("choices") or []:
        choice["index"] = index
    return _encode(chunk)


class _Model(msgspec.Struct):
    model: object = None


_decode_model = msgspec.json.Decoder(_Model).decode


def _model_of(data: bytes) -> str:
    """A chunk's ``model``, as text ("" when it has none)."""
    try:
        return str(_decode_model(data).model or "")
    except msgspec.DecodeError:
        return ""


def _usage_chunk(plan: Plan, model: str, usage: dict[str, int]) -> bytes:
    chunk: dict[str, Any] = {
        "id": _id(plan),
        "object": "chat.completion.chunk" if plan.kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage,
    }
    return encode_event(_encode(chunk))


def _merge(merged_id: str, results: Sequence[UpstreamResult]) -> tuple[bytes, int]:
    """One answer from k single-candidate ones: choices re-indexed in branch order,
    usage summed (every branch's prompt was paid)."""
    bodies = [msgspec.json.decode(r.body) for r in results]
    choices = [choice for b in bodies for choice in b.get("choices") or []]
    for index, choice in enumerate(choices):
        choice["index"] = index
    merged = {**bodies[0], "id": merged_id, "choices": choices}
    usage = summed_usage([r.summary.usage for r in results])
    if usage is not None:
        merged["usage"] = usage
    else:
        merged.pop("usage", None)  # not all branches reported: the total is unknown
    return _encode(merged), len(choices)


def _evidence(results: Sequence[UpstreamResult]) -> Evidence | None:
    """How different the branches' candidates were, each at its merged index."""
    feed = EvidenceFeed()
    first = 0
    for result in results:
        feed.body(result.body, first)
        first += len(result.summary.choices)
    return feed.finish()
