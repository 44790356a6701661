"""Chat formatting with the model's own Jinja template (``tokenizer.chat_template``).

llama.cpp's ``llama_chat_apply_template`` pattern-matches known templates instead of
running them and drops details such as SmolLM2's default system prompt, so the template
is rendered the way Hugging Face does it: jinja2 (sandboxed), ``trim_blocks``,
``lstrip_blocks``, ``add_generation_prompt=True``.

Tools: a template that uses ``tools`` gets them (and the messages' ``tool_calls`` and
``tool_call_id``) as Hugging Face passes them. Others, such as SmolLM2's plain ChatML, get
the ChatML fallback: the tool signatures appended to the system message, an assistant's
calls written as ``<tool_call>`` blocks, and tool results as ``<tool_response>`` user turns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ncap.engine.tools import ToolSpec, call_markup, tools_system_block
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
        self.native_tools = source is not None and "tools" in source

    def render(self, messages: Sequence[Mapping[str, Any]], tools: ToolSpec | None = None) -> str:
        extra: dict[str, Any] = {}
        if self.native_tools:
            normalized = normalize_messages(messages, keep_calls=True)
            if tools is not None:
                extra["tools"] = [t.definition() for t in tools.tools]
        else:
            normalized = _chatml_tools(normalize_messages(messages, keep_calls=True), tools)
        try:
            return self._template.render(
                messages=normalized, add_generation_prompt=True, **self._special, **extra
            )
        except jinja2.TemplateError as exc:
            raise InvalidValue(
                f"the model's chat template rejected the messages: {exc}", param="messages"
            ) from exc


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], *, keep_calls: bool = False
) -> list[dict[str, Any]]:
    """Messages as the template expects them: a known role and plain-text content (and,
    with ``keep_calls``, an assistant's ``tool_calls`` and a tool result's id)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        entry: dict[str, Any] = {"role": _role(m, i), "content": _content(m.get("content"), i)}
        if keep_calls and m.get("tool_calls"):
            entry["tool_calls"] = list(m["tool_calls"])
        if keep_calls and m.get("tool_call_id"):
            entry["tool_call_id"] = m["tool_call_id"]
        out.append(entry)
    return out


def _chatml_tools(messages: list[dict[str, Any]], tools: ToolSpec | None) -> list[dict[str, Any]]:
    """The ChatML fallback for a template without tool support (see the module doc)."""
    out = []
    for m in messages:
        calls = m.pop("tool_calls", None)
        m.pop("tool_call_id", None)
        if calls:
            m["content"] = "\n".join(filter(None, [m["content"], call_markup(calls)]))
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if tools is not None:
        block = tools_system_block(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}"
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


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
