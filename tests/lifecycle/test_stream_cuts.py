"""1,000 streams, each cut by its client at a seeded random point or read to its end,
through the real OpenAI provider's stream plumbing (reads cut at random offsets, many
events per read or one split across several) and the whole lifecycle on in-memory
stores: the books must close exactly.

- every stream read to its end is settled to the upstream's own usage, and so is one
  its client left after the usage had reached the gateway (the client asked for usage,
  so it knows: a stream whose client did not ask is always read to its end here);
- every stream its client left before that is pending, its hold kept;
- one ledger row per attempt, nothing else;
- the budget counters equal the ledger: settled tokens and cost plus the kept holds.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import msgspec

from tests.lifecycle.harness import CALLER
from tests.streaming.recorded import RecordedTransport, gateway, openai_provider

STREAMS = 1000
_enc = msgspec.json.Encoder().encode


def _upstream(rng: random.Random, n: int) -> tuple[bytes, dict[str, int]]:
    """n choices of random lengths, interleaved, with finish reasons and usage."""
    head = {"id": "chatcmpl-u", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    lengths = [rng.randint(1, 12) for _ in range(n)]
    events = []
    for t in range(max(lengths)):
        for i in range(n):
            if t < lengths[i]:
                choice = {"index": i, "delta": {"content": f"w{t}"}, "finish_reason": None}
                events.append({**head, "choices": [choice]})
    for i in range(n):
        choice = {"index": i, "delta": {}, "finish_reason": rng.choice(["stop", "length"])}
        events.append({**head, "choices": [choice]})
    prompt = rng.randint(1, 50)
    usage = {"prompt_tokens": prompt, "completion_tokens": sum(lengths)}
    usage["total_tokens"] = prompt + sum(lengths)
    events.append({**head, "choices": [], "usage": usage})
    text = b"".join(b"data: " + _enc(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    return text, usage


def _reads(rng: random.Random, text: bytes) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


async def test_a_thousand_streams_cut_at_random_close_the_books(tmp_path: Path) -> None:
    rng = random.Random(20261201)
    plans: list[dict[str, Any]] = []
    recordings = []
    for number in range(STREAMS):
        n = rng.randint(1, 4)
        text, usage = _upstream(rng, n)
        reads = _reads(rng, text)
        recordings.append((reads, None))
        # a cut after k pieces (k = 0: the client left on the first), or read to the end
        asks = rng.random() < 0.7
        cut = rng.randint(0, len(reads)) if asks and rng.random() < 0.7 else None
        plans.append({"id": f"req-{number}", "n": n, "usage": usage, "cut": cut, "asks": asks})
    h = gateway(tmp_path, openai_provider(RecordedTransport(recordings)))
    for plan in plans:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        body["n"] = plan["n"]
        if plan["asks"]:
            body["stream_options"] = {"include_usage": True}
        reply = await h.gateway.chat(_enc(body), CALLER, plan["id"])
        assert reply.stream is not None
        received, got = 0, b""
        async for out in reply.stream:
            received += 1
            got += out
            if plan["cut"] is not None and received > plan["cut"]:
                break  # the client leaves with the stream still open
        await reply.stream.aclose()  # type: ignore[attr-defined]
        plan["completed"] = got.endswith(b"data: [DONE]\n\n")
        plan["usage_relayed"] = b'"usage":{' in got
        assert plan["asks"] == plan["usage_relayed"] or not plan["completed"]

    holds = {hold.hold_id: hold for hold in await h.outstanding()}
    settled_tokens = settled_cost = completed = cut = 0
    all_rows = []
    for plan in plans:
        request_rows = await h.rows(plan["id"])
        assert [r.attempt for r in request_rows] == [1], plan  # one row per attempt
        (row,) = request_rows
        all_rows.append(row)
        if plan["completed"] or plan["usage_relayed"]:
            completed += plan["completed"]
            usage = plan["usage"]
            assert row.state == "settled", plan
            assert (row.input_tokens, row.output_tokens_total) == (
                usage["prompt_tokens"],
                usage["completion_tokens"],
            )
            assert row.returned_candidate_count == plan["n"]
            assert sum(row.finish_reasons.values()) == plan["n"]
            settled_tokens += row.total_tokens or 0
            settled_cost += row.cost_micros or 0
        else:
            cut += 1
            assert row.state == "pending", plan
            assert row.usage_source == "none"
    assert completed > 250 and cut > 250  # both kinds, many of each
    assert len(holds) == cut  # every cut stream keeps its hold, nothing else is held
    assert all(h.state == "kept" for h in holds.values())
    usage = await h.budgets.usage("default")
    kept_tokens = sum(hold.tokens for hold in holds.values())
    kept_cost = sum(hold.cost_micros for hold in holds.values())
    assert usage.tokens_day == settled_tokens + kept_tokens
    assert usage.cost_month == settled_cost + kept_cost
    assert usage.in_flight == 0
    kept_rows = sum(r.reserved_cost_micros for r in all_rows if r.state == "pending")
    assert kept_rows == kept_cost  # each kept hold is its pending row's reservation
