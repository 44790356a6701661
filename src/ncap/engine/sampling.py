"""Per-choice samplers, seeds, grammars and log-probabilities.

Every choice has its own llama.cpp sampler chain and its own seed (``seed + i``), so
choices are independent draws and choice i of an n-request equals an n=1 request made
with seed ``seed + i``. Log-probabilities are the log-softmax of the model's raw logits
row for that choice at that step (before temperature and penalties), as OpenAI reports.
"""

from __future__ import annotations

import ctypes
import json
import secrets
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ncap.engine.events import TokenInfo, TopToken
from ncap.engine.params import GenerationParams, JsonGrammar
from ncap.errors import InvalidValue, NcapError

__all__ = [
    "GrammarDraw",
    "LogitsRow",
    "PlainDraw",
    "Sampler",
    "SamplerChain",
    "base_seed",
    "build_sampler",
    "choice_seed",
    "compile_grammar",
    "logits_row",
    "token_info",
]

_U32 = 0xFFFFFFFF
# LLAMA_DEFAULT_SEED (0xFFFFFFFF) means "random" to llama.cpp: never hand it over
_DEFAULT_SEED_STANDIN = 0x7FFFFFFF


def base_seed(seed: int | None) -> int:
    """The request's base seed: the client's, or a random 32-bit one."""
    return secrets.randbits(32) if seed is None else seed


def choice_seed(base: int, index: int) -> int:
    """Seed of choice ``index``: ``base + index`` masked to 32 bits."""
    seed = (base + index) & _U32
    return _DEFAULT_SEED_STANDIN if seed == _U32 else seed


def compile_grammar(spec: JsonGrammar) -> str:
    """GBNF for a json_object / json_schema response format."""
    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

    if spec.schema is None:
        return str(JSON_GBNF)
    try:
        return str(json_schema_to_gbnf(json.dumps(spec.schema)))
    except Exception as exc:  # the converter raises bare Exceptions on unsupported schemas
        raise InvalidValue(
            f"cannot turn this JSON schema into a grammar: {exc}", param="response_format"
        ) from exc


class Sampler(Protocol):
    """One choice's token draws, owned by the scheduler thread."""

    def sample(self, ctx: Any, row: int) -> int:
        """The next token from logits row ``row`` of the last decode."""
        ...

    def close(self) -> None: ...


def build_sampler(
    lib: Any,
    vocab: Any,
    n_vocab: int,
    params: GenerationParams,
    *,
    seed: int,
    grammar: str | None,
) -> Sampler:
    """``PlainDraw`` for plain temperature sampling or greedy decoding (the API's
    defaults), ``GrammarDraw`` for the same under a grammar (tools, JSON), llama.cpp's
    sampler chain for everything else."""
    if grammar is None and _plain_under_grammar(params):
        return PlainDraw(lib, n_vocab, params.temperature, seed)
    if grammar is not None and _plain_under_grammar(params):
        return GrammarDraw(lib, vocab, n_vocab, params, seed=seed, grammar=grammar)
    return SamplerChain.build(lib, vocab, n_vocab, params, seed=seed, grammar=grammar)


def _plain_under_grammar(params: GenerationParams) -> bool:
    return (
        params.top_p >= 1.0
        and not params.logit_bias
        and not params.frequency_penalty
        and not params.presence_penalty
    )


class PlainDraw:
    """Softmax sampling at a temperature (greedy at 0) straight from the logits row.

    The same distribution as llama.cpp's ``temp`` → ``dist`` chain, drawn in numpy:
    one vectorised ``exp``, the row's probability mass summed per block of
    ``_BLOCK`` tokens, and the inverse CDF searched over the block sums, then within
    one block. llama.cpp's ``dist`` does the ``exp`` and the double sum one token at a
    time (≈ 0.4 ms per draw over SmolLM2's 49,152 tokens, measured); this is ≈ 0.05
    ms, and an n=8 step makes eight. Each choice owns its generator (PCG64 seeded
    with the choice's seed), so choice i of an n-request still equals an n=1 request
    with seed + i, and a draw depends on nothing but its row and its seed.
    """

    _BLOCK = 512

    def __init__(self, lib: Any, n_vocab: int, temperature: float, seed: int) -> None:
        self._lib = lib
        self._n_vocab = n_vocab
        self._temperature = np.float32(temperature)
        self._greedy = temperature <= 0.0
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._starts = np.arange(0, n_vocab, self._BLOCK)

    def sample(self, ctx: Any, row: int) -> int:
        return self.draw(logits_row(self._lib, ctx, row, self._n_vocab))

    def draw(self, logits: npt.NDArray[np.float32]) -> int:
        if self._greedy:
            return int(np.argmax(logits))
        scaled = logits / self._temperature
        weights = np.exp(scaled - scaled.max())
        sums = np.add.reduceat(weights, self._starts, dtype=np.float64)
        cumulative = np.cumsum(sums)
        target = self._rng.random() * cumulative[-1]
        block = int(np.searchsorted(cumulative, target, side="right"))
        if block >= len(sums):  # rounding at the very top: the last block with mass
            block = int(np.flatnonzero(sums)[-1])
            target = cumulative[block]
        start = block * self._BLOCK
        part = weights[start : start + self._BLOCK]
        within = np.cumsum(part, dtype=np.float64)
        rest = target - (cumulative[block - 1] if block else 0.0)
        i = int(np.searchsorted(within, rest, side="right"))
        if i >= len(part):  # the same at the block's top: its last token with mass
            i = int(np.flatnonzero(part)[-1])
        return start + i

    def close(self) -> None:
        pass


# llama_token_data as numpy sees it: {int32 id; float logit; float p} (12 bytes)
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class GrammarDraw:
    """``PlainDraw`` held to a GBNF grammar (llama.cpp's grammar sampler).

    The token is drawn from the whole distribution first and kept when the grammar takes
    it (one token checked); only when it does not is the grammar applied to the whole
    vocabulary and the token drawn again from what it allows. The result has exactly
    the distribution of drawing from the grammar's tokens alone (a rejected first draw
    is a draw from the rest, renormalised), as llama.cpp's own common sampler does, and
    the grammar's full pass over the 49,152 tokens is paid only on a rejection.
    """

    def __init__(
        self,
        lib: Any,
        vocab: Any,
        n_vocab: int,
        params: GenerationParams,
        *,
        seed: int,
        grammar: str,
    ) -> None:
        self._lib = lib
        self._n_vocab = n_vocab
        self._draw = PlainDraw(lib, n_vocab, params.temperature, seed)
        self._grammar = lib.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
        if not self._grammar:
            raise InvalidValue(_bad_grammar(params), param=_grammar_param(params))
        self._one = np.zeros(1, dtype=_TOKEN_DATA)
        self._all = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._all["id"] = np.arange(n_vocab, dtype=np.int32)
        self._one_view = self._view(self._one)
        self._all_view = self._view(self._all)

    def _view(self, data: npt.NDArray[Any]) -> Any:
        pointer = data.ctypes.data_as(ctypes.POINTER(self._lib.llama_token_data))
        return self._lib.llama_token_data_array(pointer, len(data), -1, False)

    def sample(self, ctx: Any, row: int) -> int:
        logits = logits_row(self._lib, ctx, row, self._n_vocab)
        token = self._draw.draw(logits)
        if not self.allows(token):
            token = self._draw.draw(self._allowed(logits))
        self.accept(token)
        return token

    def accept(self, token: int) -> None:
        """Advance the grammar past ``token`` (``sample`` does this for its own draws)."""
        self._lib.llama_sampler_accept(self._grammar, token)

    def allows(self, token: int) -> bool:
        """Whether the grammar takes ``token`` next."""
        self._one[0] = (token, 0.0, 0.0)
        self._apply(self._one_view, 1)
        return bool(np.isfinite(self._one[0]["logit"]))

    def _allowed(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The row with every token the grammar refuses at minus infinity."""
        self._all["logit"] = logits
        self._apply(self._all_view, self._n_vocab)
        masked: npt.NDArray[np.float32] = self._all["logit"].copy()
        if not np.isfinite(masked).any():
            raise NcapError("the grammar allows no token here")
        return masked

    def _apply(self, view: Any, size: int) -> None:
        view.size, view.selected, view.sorted = size, -1, False
        self._lib.llama_sampler_apply(self._grammar, ctypes.byref(view))

    def close(self) -> None:
        if self._grammar:
            self._lib.llama_sampler_free(self._grammar)
            self._grammar = None


def _grammar_param(params: GenerationParams) -> str:
    return "tools" if params.tools is not None else "response_format"


def _bad_grammar(params: GenerationParams) -> str:
    return f"the grammar built from {_grammar_param(params)} is invalid"


class SamplerChain:
    """One choice's llama.cpp sampler chain; owned by the scheduler thread."""

    def __init__(self, lib: Any, vocab: Any, n_vocab: int, params: GenerationParams) -> None:
        self._lib = lib
        self._vocab = vocab
        self._n_vocab = n_vocab
        self._params = params
        self._chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())

    @classmethod
    def build(
        cls,
        lib: Any,
        vocab: Any,
        n_vocab: int,
        params: GenerationParams,
        *,
        seed: int,
        grammar: str | None,
    ) -> SamplerChain:
        """logit bias → penalties → grammar → temperature → top-p → draw (or greedy)."""
        chain = cls(lib, vocab, n_vocab, params)
        try:
            chain._add_bias_and_penalties()
            if grammar is not None:
                chain._add_grammar(grammar)
            chain._add_draw(seed)
        except BaseException:
            chain.close()
            raise
        return chain

    def sample(self, ctx: Any, row: int) -> int:
        """Sample from logits row ``row`` of the last decode; the chain accepts the token."""
        return int(self._lib.llama_sampler_sample(self._chain, ctx, row))

    def close(self) -> None:
        if self._chain:
            self._lib.llama_sampler_free(self._chain)
            self._chain = None

    def _add(self, sampler: Any) -> None:
        self._lib.llama_sampler_chain_add(self._chain, sampler)

    def _add_bias_and_penalties(self) -> None:
        lib, p = self._lib, self._params
        if p.logit_bias:
            biases = (lib.llama_logit_bias * len(p.logit_bias))()
            for i, (token, bias) in enumerate(p.logit_bias.items()):
                biases[i].token = token
                biases[i].bias = bias
            self._add(lib.llama_sampler_init_logit_bias(self._n_vocab, len(p.logit_bias), biases))
        if p.frequency_penalty or p.presence_penalty:
            # the window covers the whole completion: OpenAI penalises every earlier token
            window = p.max_tokens or 4096
            self._add(
                lib.llama_sampler_init_penalties(
                    self._n_vocab, window, 1.0, p.frequency_penalty, p.presence_penalty
                )
            )

    def _add_grammar(self, grammar: str) -> None:
        sampler = self._lib.llama_sampler_init_grammar(self._vocab, grammar.encode(), b"root")
        if not sampler:
            p = self._params
            raise InvalidValue(_bad_grammar(p), param=_grammar_param(p))
        self._add(sampler)

    def _add_draw(self, seed: int) -> None:
        lib, p = self._lib, self._params
        if p.temperature <= 0.0:
            self._add(lib.llama_sampler_init_greedy())
            return
        self._add(lib.llama_sampler_init_temp(p.temperature))
        if p.top_p < 1.0:
            self._add(lib.llama_sampler_init_top_p(p.top_p, 1))
        self._add(lib.llama_sampler_init_dist(seed))


def logits_row(lib: Any, ctx: Any, row: int, n_vocab: int) -> npt.NDArray[np.float32]:
    """A numpy view of the raw logits of batch row ``row`` (valid until the next decode)."""
    ptr = lib.llama_get_logits_ith(ctx, row)
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (n_vocab,))


@dataclass(frozen=True, slots=True)
class LogitsRow:
    """One logits row and its log-normaliser: logprob(t) = logits[t] - lse."""

    logits: npt.NDArray[np.float32]
    lse: float

    @classmethod
    def of(cls, logits: npt.NDArray[np.float32]) -> LogitsRow:
        top = float(np.max(logits))
        return cls(logits, top + float(np.log(np.sum(np.exp(logits - top, dtype=np.float64)))))

    def logprob(self, token: int) -> float:
        return float(self.logits[token]) - self.lse


def token_info(row: LogitsRow, token: int, top_n: int, pieces: list[bytes]) -> TokenInfo:
    """The sampled token's entry with the ``top_n`` most likely tokens of the same row."""
    top: tuple[TopToken, ...] = ()
    if top_n > 0:
        best = np.argpartition(-row.logits, top_n)[:top_n]
        best = best[np.argsort(-row.logits[best], kind="stable")]
        top = tuple(_top(int(t), row.logprob(int(t)), pieces) for t in best)
    piece = pieces[token]
    return TokenInfo(_text(piece), row.logprob(token), tuple(piece), top)


def _top(token: int, logprob: float, pieces: list[bytes]) -> TopToken:
    return TopToken(_text(pieces[token]), logprob, tuple(pieces[token]))


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="backslashreplace")
