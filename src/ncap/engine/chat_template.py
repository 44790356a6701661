"""Chat formatting with the model's own Jinja template (``tokenizer.chat_template``).

llama.cpp's ``llama_chat_apply_template`` pattern-matches known templates instead of
running them and drops details such as SmolLM2's default system prompt, so the template
is rendered the way Hugging Face does it: jinja2 (sandboxed), ``trim_blocks``,
``lstrip_blocks``, ``add_generation_prompt=True``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ncap.errors import InvalidType, InvalidValue

__all__ = ["CHATML", "ChatTemplate", "normalize_messages"]

# used when the GGUF carries no template
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_ROLES |= {"tool": "tool", "function": "tool"}


def _raise(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


class ChatTemplate:
    """A compiled chat template; ``render`` turns messages into the prompt text."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source or CHATML)
        self._special = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        try:
            return self._template.render(
                messages=normalize_messages(messages), add_generation_prompt=True, **self._special
            )
        except jinja2.TemplateError as exc:
            raise InvalidValue(
                f"the model's chat template rejected the messages: {exc}", param="messages"
            ) from exc


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Messages as the template expects them: a known role and plain-text content."""
    return [
        {"role": _role(m, i), "content": _content(m.get("content"), i)}
        for i, m in enumerate(messages)
    ]


def _role(message: Mapping[str, Any], i: int) -> str:
    role = message.get("role")
    if role not in _ROLES:
        raise InvalidValue(f"unknown role {role!r}", param=f"messages.[{i}].role")
    return _ROLES[role]


def _content(content: Any, i: int) -> str:
    """Text parts are joined; other part types cannot be given to a text-only model."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidType(
            "content must be a string or a list of parts", param=f"messages.[{i}].content"
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") not in ("text", "refusal"):
            raise InvalidValue(
                "the local engine accepts text content parts only",
                param=f"messages.[{i}].content.[{j}]",
            )
        texts.append(str(part.get("text") or part.get("refusal") or ""))
    return "".join(texts)
