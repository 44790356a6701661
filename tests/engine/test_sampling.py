"""``PlainDraw``: the numpy draw for plain temperature sampling and greedy decoding.

No model needed: the draw takes a logits row. Its distribution is checked against the
exact softmax (float64) over many draws; the tests are deterministic (fixed seeds).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ncap.engine.params import GenerationParams
from ncap.engine.sampling import GrammarDraw, PlainDraw, SamplerChain, build_sampler


def _softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    x = logits.astype(np.float64) / temperature
    e = np.exp(x - x.max())
    return e / e.sum()


def _frequencies(draw: PlainDraw, logits: np.ndarray, count: int) -> np.ndarray:
    seen = np.zeros(len(logits))
    for _ in range(count):
        seen[draw.draw(logits)] += 1
    return seen / count


def _total_variation(seen: np.ndarray, expected: np.ndarray) -> float:
    return float(0.5 * np.abs(seen - expected).sum())


def _noise(expected: np.ndarray, count: int) -> float:
    """The total variation that ``count`` exact draws (numpy's own) show by chance."""
    exact = np.random.default_rng(1).choice(len(expected), count, p=expected)
    return _total_variation(np.bincount(exact, minlength=len(expected)) / count, expected)


def _row(n_vocab: int) -> np.ndarray:
    logits = (np.random.default_rng(11).standard_normal(n_vocab) * 2).astype(np.float32)
    logits[[3, 700, n_vocab - 1]] += 6.0  # a few likely tokens, one in the last block
    return logits


@pytest.mark.parametrize("n_vocab", [1300, 2048])  # a partial last block, and none
@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_draws_follow_the_softmax_at_the_temperature(n_vocab: int, temperature: float) -> None:
    logits = _row(n_vocab)
    seen = _frequencies(PlainDraw(None, n_vocab, temperature, seed=5), logits, 20_000)
    expected = _softmax(logits, temperature)
    # as close to the softmax as exact draws get by chance (0.02-0.10 here, by how flat
    # the distribution is); a wrong temperature or a skewed search is 0.3 and more off
    noise = _noise(expected, 20_000)
    assert _total_variation(seen, expected) < 1.25 * noise + 0.01
    for token in (3, 700, n_vocab - 1):
        assert seen[token] == pytest.approx(expected[token], abs=0.015)
    wrong = _softmax(logits, temperature / 2)
    assert _total_variation(seen, wrong) > 3 * noise  # the check above can fail


def test_tokens_without_mass_are_never_drawn() -> None:
    logits = np.full(1500, -np.inf, dtype=np.float32)
    allowed = [0, 511, 512, 1023, 1499]  # block edges on both sides
    logits[allowed] = 0.0
    draw = PlainDraw(None, 1500, 1.0, seed=1)
    drawn = {draw.draw(logits) for _ in range(3000)}
    assert drawn == set(allowed)


def test_temperature_zero_is_the_argmax() -> None:
    logits = np.zeros(4000, dtype=np.float32)
    logits[2222] = 0.5
    logits[3333] = 0.5  # a tie goes to the first, as llama.cpp's greedy sampler does
    draw = PlainDraw(None, 4000, 0.0, seed=1)
    assert {draw.draw(logits) for _ in range(10)} == {2222}


def test_a_seed_gives_the_same_draws_and_another_seed_others() -> None:
    logits = np.random.default_rng(2).standard_normal(5000).astype(np.float32)
    a, b, c = (PlainDraw(None, 5000, 1.0, seed=s) for s in (7, 7, 8))
    first = [a.draw(logits) for _ in range(50)]
    assert first == [b.draw(logits) for _ in range(50)]
    assert first != [c.draw(logits) for _ in range(50)]


class _FakeLib:
    """llama_cpp with a grammar sampler that needs no model's vocabulary."""

    def __getattr__(self, name: str) -> Any:
        import llama_cpp

        return getattr(llama_cpp, name)

    def llama_sampler_init_grammar(self, *args: Any) -> Any:
        import llama_cpp

        return llama_cpp.llama_sampler_init_greedy()


@pytest.mark.parametrize(
    ("changes", "plain"),
    [
        ({}, True),
        ({"temperature": 0.0}, True),
        ({"temperature": 0.3}, True),
        ({"top_p": 0.9}, False),
        ({"frequency_penalty": 0.5}, False),
        ({"presence_penalty": -0.5}, False),
        ({"logit_bias": {5: 1.0}}, False),
    ],
)
def test_only_plain_sampling_skips_llama_cpp_s_chain(changes: dict[str, Any], plain: bool) -> None:
    params = GenerationParams(messages=({"role": "user", "content": "hi"},), **changes)
    sampler = build_sampler(_FakeLib(), None, 100, params, seed=1, grammar=None)
    assert isinstance(sampler, PlainDraw) is plain
    assert isinstance(sampler, SamplerChain) is not plain
    sampler.close()


def test_a_grammar_under_plain_sampling_is_a_grammar_draw() -> None:
    params = GenerationParams(messages=({"role": "user", "content": "hi"},))
    sampler = build_sampler(_FakeLib(), None, 100, params, seed=1, grammar='root ::= "a"')
    assert isinstance(sampler, GrammarDraw)
    sampler.close()


def test_a_grammar_with_other_samplers_keeps_llama_cpp_s_chain() -> None:
    params = GenerationParams(messages=({"role": "user", "content": "hi"},), top_p=0.9)
    sampler = build_sampler(_FakeLib(), None, 100, params, seed=1, grammar='root ::= "a"')
    assert isinstance(sampler, SamplerChain)
    sampler.close()
