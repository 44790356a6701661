"""``DrawBuffer.draw`` (the context-free draw the scheduler splits over two threads)
picks the same tokens as ``llama_sampler_sample`` for the same chain and seed."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from ncap.engine.library import default_model_path, load_library
from ncap.engine.model import ContextSettings, LlamaModel
from ncap.engine.params import GenerationParams, JsonGrammar
from ncap.engine.sampling import DrawBuffer, SamplerChain, compile_grammar, logits_row
from tests.engine._require import require_engine

require_engine()
pytestmark = pytest.mark.engine

MESSAGES = ({"role": "user", "content": "Name a colour."},)


@pytest.fixture(scope="module")
def decoded() -> Iterator[tuple[Any, LlamaModel, Any]]:
    lib = load_library()
    model = LlamaModel(lib, default_model_path())
    ctx = model.new_context(ContextSettings(256, 2, 64, 1, 48))
    tokens = model.tokenize("The colour of the sky on a clear day is")
    array = (ctypes.c_int32 * len(tokens))(*tokens)
    assert lib.llama_decode(ctx, lib.llama_batch_get_one(array, len(tokens))) == 0
    yield lib, model, ctx
    lib.llama_free(ctx)
    model.close()


@pytest.mark.parametrize(
    "params",
    [
        GenerationParams(messages=MESSAGES),
        GenerationParams(messages=MESSAGES, temperature=0.7, top_p=0.9),
        GenerationParams(messages=MESSAGES, temperature=1.3, presence_penalty=0.5),
        GenerationParams(messages=MESSAGES, logit_bias={13: -100.0, 30: 5.0}),
        GenerationParams(messages=MESSAGES, temperature=0.0),
    ],
    ids=["default", "top_p", "penalties", "logit_bias", "greedy"],
)
def test_draw_equals_sample(decoded: tuple[Any, LlamaModel, Any], params: GenerationParams) -> None:
    lib, model, ctx = decoded
    logits = logits_row(lib, ctx, -1, model.n_vocab)
    buffer = DrawBuffer(lib, model.n_vocab)
    for seed in (1, 2, 3):
        a = SamplerChain.build(lib, model.vocab, model.n_vocab, params, seed=seed, grammar=None)
        b = SamplerChain.build(lib, model.vocab, model.n_vocab, params, seed=seed, grammar=None)
        try:
            # the same chain state evolves the same way: 40 draws from one row
            sampled = [a.sample(ctx, -1) for _ in range(40)]
            drawn = [b.draw(buffer, logits) for _ in range(40)]
        finally:
            a.close()
            b.close()
        assert drawn == sampled


def test_draw_with_a_grammar_and_on_two_threads(decoded: tuple[Any, LlamaModel, Any]) -> None:
    lib, model, ctx = decoded
    logits = logits_row(lib, ctx, -1, model.n_vocab)
    grammar = compile_grammar(JsonGrammar())
    params = GenerationParams(messages=MESSAGES)

    def chains() -> list[SamplerChain]:
        return [
            SamplerChain.build(lib, model.vocab, model.n_vocab, params, seed=s, grammar=grammar)
            for s in range(4)
        ]

    ref, par = chains(), chains()
    try:
        expected = [[c.sample(ctx, -1) for _ in range(3)] for c in ref]
        got: list[list[int]] = [[] for _ in par]
        buffers = [DrawBuffer(lib, model.n_vocab), DrawBuffer(lib, model.n_vocab)]

        def run(half: int) -> None:
            for i in range(half, len(par), 2):
                got[i] = [par[i].draw(buffers[half], logits) for _ in range(3)]

        threads = [threading.Thread(target=run, args=(h,)) for h in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for c in ref + par:
            c.close()
    assert got == expected
