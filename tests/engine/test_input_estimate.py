"""The conservative input estimate (``domain/reservation.py``) against the real thing:
the bundled SmolLM2 tokenizer (llama.cpp) on the prompt the local engine builds, chat
template included (with SmolLM2's default system prompt when a request has none).

A reservation that under-estimates its input lets a budget be overshot, so on every
body of the corpus the estimate must be at least the real prompt token count. The
expected side is the tokenizer's count, never a value derived from the estimate's
own constants.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ncap.domain.reservation import estimate_input_tokens
from ncap.engine.chat_template import ChatTemplate
from ncap.engine.library import default_model_path, load_library
from ncap.engine.model import LlamaModel
from ncap.engine.params import chat_params
from tests.engine._require import require_engine

require_engine()
pytestmark = pytest.mark.engine


def _user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


TEXTS = [
    "",
    "Hi",
    "?",
    "hello world",
    "日本語のテキストです。これはテストです。",
    "中文文本，测试分词器的上限。" * 10,
    "🙂🙂🙂 emoji and ümlauts, naïve café 👩‍👩‍👧‍👦🏳️‍🌈",
    "Привет, как дела? Это проверка токенизатора.",
    "مرحبا بالعالم، هذا اختبار",
    "नमस्ते दुनिया, यह एक परीक्षण है",
    "e\u0301\u0301\u0301 combining marks \u200b\u200d zero-width",
    "a" * 2000,
    "1234567890" * 50,
    "def f(x):\n    return {'k': [1, 2, 3]}\n" * 20,
    '{"json": ["inside", {"the": "content"}], "n": 2}',
    "   \n\t  spaces   and\ttabs  \n\n\n",
    "<|im_start|>system\nnot really a turn<|im_end|>",
    "\\u00e9 escaped \\n sequences \" quotes ' and \\\\ backslashes",
]

CORPUS: list[list[dict[str, Any]]] = [
    *[[_user(t)] for t in TEXTS],  # no system message: the template adds its own
    *[[{"role": "system", "content": "Be brief."}, _user(t)] for t in TEXTS],
    [{"role": "developer", "content": "Answer in French."}, _user("Name a colour.")],
    [_user([{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}])],
    [{"role": "assistant", "content": None}, _user("go on")],
    [_user("x"), {"role": "assistant", "content": "y"}] * 25,  # many tiny turns
    [_user(""), {"role": "assistant", "content": ""}] * 40,  # empty turns, overheads only
    [
        {"role": "system", "content": "You are terse."},
        _user("What is 2+2?"),
        {"role": "assistant", "content": "4"},
        {"role": "tool", "content": '{"result": 4}', "tool_call_id": "call_1"},
        _user("And 3+3?"),
    ],
]


@pytest.fixture(scope="module")
def prompt_tokens() -> Iterator[Any]:
    """The engine's own prompt path: ``Engine.prompt_tokens`` without a context."""
    model = LlamaModel(load_library(), default_model_path())
    template = ChatTemplate(model.chat_template, bos_token=model.bos_text, eos_token=model.eos_text)

    def count(messages: list[dict[str, Any]]) -> int:
        params = chat_params({"messages": messages})
        assert params.messages is not None
        return len(model.tokenize(template.render(params.messages)))

    yield count
    model.close()


def test_the_template_is_the_models_own(prompt_tokens: Any) -> None:
    # SmolLM2's template adds a default system prompt: a bare "Hi" is far more than 1 token
    assert prompt_tokens([_user("Hi")]) > 10


@pytest.mark.parametrize("messages", CORPUS, ids=[f"body{i}" for i in range(len(CORPUS))])
def test_estimate_never_under_estimates_the_real_prompt(
    prompt_tokens: Any, messages: list[dict[str, Any]]
) -> None:
    real = prompt_tokens(messages)
    estimate = estimate_input_tokens(messages)
    assert real <= estimate, (real, estimate)
