"""``output_tokens_per_choice`` on the ledger row: the provider's own per-choice counts
when they add up to its total, an emulated branch's own usage, and None wherever only
a total is known (never split from it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ncap.lifecycle import Reply
from ncap.testing.scripted import Answer, ScriptedProvider, chat_body
from tests.lifecycle.harness import EMULATE, Harness, harness, route, settled


async def _settled_rows(h: Harness, reply: Reply) -> None:
    assert reply.settling
    await settled(h.gateway)


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        ((3, 2), (3, 2)),  # the provider knows each choice, and they add up
        ((3, 3), None),  # they do not add up to the total: not recorded
        ((5,), None),  # not one count per returned choice
        (None, None),  # only a total: never inferred
    ],
)
async def test_native_route(
    tmp_path: Path, counts: tuple[int, ...] | None, expected: tuple[int, ...] | None
) -> None:
    provider = ScriptedProvider([Answer(chat_body("a", "b", usage=(10, 5)), choice_tokens=counts)])
    h = harness(tmp_path, {"r": (route(), provider)})
    reply = await h.chat(n=2)
    await _settled_rows(h, reply)
    [row] = await h.rows()
    assert row.state == "settled" and row.output_tokens_total == 5
    assert row.output_tokens_per_choice == expected


async def test_emulated_branches_each_have_their_own(tmp_path: Path) -> None:
    steps = [Answer(chat_body("x", usage=(10, c), id_=f"b{c}")) for c in (4, 7, 9)]
    h = harness(tmp_path, {"r": (route(EMULATE), ScriptedProvider(steps))})
    reply = await h.chat(n=3)
    await _settled_rows(h, reply)
    rows = await h.rows()
    assert sorted(r.output_tokens_per_choice or () for r in rows) == [(4,), (7,), (9,)]
    assert all(r.returned_candidate_count == 1 for r in rows)


async def test_missing_usage_leaves_it_null(tmp_path: Path) -> None:
    provider = ScriptedProvider([Answer(chat_body("a", "b", usage=None), choice_tokens=(1, 2))])
    h = harness(tmp_path, {"r": (route(), provider)})
    reply = await h.chat(n=2)
    await _settled_rows(h, reply)
    [row] = await h.rows()
    assert row.state == "usage_reconciliation_required"
    assert row.output_tokens_per_choice is None
