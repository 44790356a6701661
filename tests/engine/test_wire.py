"""Engine events → OpenAI wire shapes, and the chat template (no model needed)."""

from __future__ import annotations

import msgspec
import pytest

from ncap.engine.chat_template import ChatTemplate
from ncap.engine.events import ChoiceDelta, ChoiceResult, Completion, TokenInfo, TopToken
from ncap.engine.wire import ChatChunks, best_of, chat_completion, text_completion
from ncap.errors import InvalidValue

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def as_dict(struct: msgspec.Struct) -> dict:  # type: ignore[type-arg]
    return msgspec.json.decode(msgspec.json.encode(struct))  # type: ignore[no-any-return]


def test_template_keeps_the_default_system_prompt() -> None:
    text = ChatTemplate(SMOLLM2_TEMPLATE).render([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_maps_developer_to_system_and_joins_text_parts() -> None:
    text = ChatTemplate(SMOLLM2_TEMPLATE).render(
        [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    )
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nab")


def test_template_refuses_images() -> None:
    with pytest.raises(InvalidValue) as info:
        ChatTemplate(None).render(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        )
    assert info.value.param == "messages.[0].content.[0]"


def test_chunks_role_first_then_content_then_finish_then_usage() -> None:
    chunks = ChatChunks(id_="c1", model="m", n=2, include_usage=True)
    opening = [as_dict(c) for c in chunks.opening()]
    assert [c["choices"][0]["index"] for c in opening] == [0, 1]
    assert opening[0]["choices"][0]["delta"] == {"content": "", "role": "assistant"}
    assert opening[0]["usage"] is None
    out = [as_dict(c) for c in chunks.delta(ChoiceDelta(1, "hi", None, "length"))]
    assert [c["choices"][0]["delta"] for c in out] == [{"content": "hi"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in out] == [None, "length"]
    (last,) = [as_dict(c) for c in chunks.closing(10, 7)]
    assert last["choices"] == []
    assert last["usage"]["prompt_tokens"] == 10
    assert last["usage"]["completion_tokens"] == 7
    assert last["usage"]["total_tokens"] == 17


def test_no_usage_field_without_include_usage() -> None:
    chunks = ChatChunks(id_="c1", model="m", n=1, include_usage=False)
    assert "usage" not in as_dict(chunks.opening()[0])
    assert chunks.closing(1, 1) == []


def test_chat_completion_shape_with_logprobs() -> None:
    info = TokenInfo("hi", -0.5, (104, 105), (TopToken("hi", -0.5, (104, 105)),))
    done = Completion([ChoiceResult(0, "hi", "stop", [info], 1, -0.5)], 30, 1)
    body = as_dict(chat_completion(done, id_="x", model="m", created=1))
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"content": "hi", "refusal": None, "role": "assistant"}
    assert body["choices"][0]["logprobs"]["content"][0]["top_logprobs"][0]["token"] == "hi"
    assert body["usage"]["total_tokens"] == 31


def test_best_of_keeps_the_highest_mean_logprob_and_bills_all() -> None:
    choices = [ChoiceResult(i, f"t{i}", "stop", None, 3, m) for i, m in enumerate([-3, -1, -2, -4])]
    chosen = best_of(Completion(choices, 5, 12), 2)
    body = as_dict(text_completion(chosen, id_="x", model="m", created=1))
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "t1"), (1, "t2")]
    assert body["usage"]["completion_tokens"] == 12
    assert body["object"] == "text_completion"
