"""``Candidates``: exact counts, the same digest however a candidate is cut into
deltas, and nothing of the content kept."""

from __future__ import annotations

import gc
import itertools
import random
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from ncap.domain.evidence import Candidates, Evidence

KEY = b"k" * 32


def _cuts(text: str, rng: random.Random) -> list[str]:
    """``text`` in random pieces (empty ones included)."""
    marks = sorted(rng.randrange(len(text) + 1) for _ in range(rng.randrange(6)))
    bounds = [0, *marks, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def _digest_of(texts: list[str], calls: list[tuple[str, str]] | None = None) -> Evidence | None:
    c = Candidates(KEY)
    for i, t in enumerate(texts):
        c.seen(i)
        c.text(i, t)
    for j, (name, args) in enumerate(calls or []):
        c.tool_call(0, j, name, args)
    return c.finish()


def test_five_candidates_three_identical() -> None:
    texts = ["Paris.", "Paris.", "Paris.", "It is Paris.", "Lyon"]
    assert _digest_of(texts) == Evidence(compared=5, distinct=3, majority=3, tool_calls=0)
    e = _digest_of(texts)
    assert e is not None and e.agreement == 0.6 and e.distinct_share == 0.6


def test_whitespace_is_normalized_case_is_not() -> None:
    assert _digest_of(["  a \n\t b  ", "a b"]) == Evidence(2, 1, 2, 0)
    assert _digest_of(["a b", "A b"]) == Evidence(2, 2, 1, 0)
    assert _digest_of(["ab", "a b"]) == Evidence(2, 2, 1, 0)
    # an empty candidate is one; a whitespace-only one is the same as empty
    assert _digest_of(["", "   "]) == Evidence(2, 1, 2, 0)


def test_fewer_than_two_candidates_is_no_evidence() -> None:
    assert _digest_of(["only"]) is None
    assert Candidates(KEY).finish() is None


def test_tool_calls_by_name_and_arguments_without_json_whitespace() -> None:
    c = Candidates(KEY)
    c.tool_call(0, 0, "get_weather", '{"city": "Paris", "unit":"c"}')
    c.tool_call(1, 0, "get_weather", '{ "city":"Paris","unit" : "c" }')
    c.tool_call(2, 0, "get_weather", '{"city": "Paris ", "unit":"c"}')  # a string differs
    c.tool_call(3, 0, "get_time", '{"city": "Paris", "unit":"c"}')  # the name differs
    c.text(4, "I don't know.")
    assert c.finish() == Evidence(compared=5, distinct=4, majority=2, tool_calls=4)


def test_text_beside_a_tool_call_counts_too() -> None:
    c = Candidates(KEY)
    for i in (0, 1):
        c.tool_call(i, 0, "f", "{}")
    c.text(1, "calling f")
    assert c.finish() == Evidence(2, 2, 1, 2)


def test_the_order_of_tool_calls_within_a_candidate_matters_their_arrival_does_not() -> None:
    c = Candidates(KEY)
    c.tool_call(0, 0, "a", "{}")
    c.tool_call(0, 1, "b", "{}")
    c.tool_call(1, 1, "b", "{}")  # arrives first, but is the second call
    c.tool_call(1, 0, "a", "{}")
    c.tool_call(2, 0, "b", "{}")
    c.tool_call(2, 1, "a", "{}")
    assert c.finish() == Evidence(3, 2, 2, 3)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list('ab \n\t"\\{}:,é')), max_size=40),
    args=st.text(alphabet=st.sampled_from(list('ab \n"\\{}:,1')), max_size=40),
    seed=st.integers(0, 2**32),
)
def test_any_cut_hashes_as_the_whole(text: str, args: str, seed: int) -> None:
    """A streamed candidate (deltas cut anywhere, interleaved with another candidate's)
    and the same candidate whole are identical: the streamed and non-streamed paths
    agree."""
    rng = random.Random(seed)
    c = Candidates(KEY)
    c.text(0, text)
    c.tool_call(0, 0, "f", args)
    pieces = _cuts(text, rng)
    fragments = _cuts(args, rng)
    for p in pieces:
        c.text(1, p)
        c.text(2, p + "x")  # another candidate interleaved
    c.tool_call(1, 0, "f", None)
    for f in fragments:
        c.tool_call(1, 0, None, f)
    e = c.finish()
    assert e is not None
    assert e.compared == 3
    assert e.majority >= 2  # candidates 0 and 1 are the same
    assert e.distinct == 2


def test_the_key_makes_digests_process_local() -> None:
    """Same text under two keys: different digests (nothing comparable across
    processes); the counts do not depend on the key."""
    a, b = Candidates(b"a" * 32), Candidates(b"b" * 32)
    for c in (a, b):
        c.text(0, "x")
        c.text(1, "x")
    assert a.finish() == b.finish() == Evidence(2, 1, 2, 0)


def test_no_content_is_kept() -> None:
    """While open the accumulator holds hash states, never a str or bytes of what it
    was fed; once finished it holds nothing but its key."""
    canary = "CANARY-7f3a-" + "z" * 300  # longer than a hash block
    c = Candidates(KEY)
    c.text(0, canary)
    c.text(1, canary[:150])
    c.text(1, canary[150:])
    c.tool_call(2, 0, "CANARYTOOL", '{"q": "' + canary + '"}')
    assert not _holds(c, b"CANARY")
    assert _holds(c, KEY[:8])  # the walk does reach what the object holds
    assert c.finish() == Evidence(3, 2, 2, 1)
    assert c._open is None  # the digests are gone: only the returned counts remain


def _holds(root: object, needle: bytes) -> bool:
    """Whether any str or bytes reachable from ``root`` contains ``needle``."""
    seen: set[int] = set()
    stack: list[object] = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, type) or o is sys.modules:
            continue
        seen.add(id(o))
        if isinstance(o, str | bytes):
            if needle in (o.encode() if isinstance(o, str) else o):
                return True
            continue
        stack.extend(gc.get_referents(o))
        for slot in getattr(type(o), "__slots__", ()):
            if hasattr(o, slot):
                stack.append(getattr(o, slot))
    return False
