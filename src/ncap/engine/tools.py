"""Tool calling on the local engine: request parsing, prompt block, grammar, output parsing.

Each choice is constrained by one GBNF grammar: either prose (first character not ``<``)
or one (or, with ``parallel_tool_calls``, several) blocks of
``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`` whose ``name`` is one of
the request's tools and whose ``arguments`` match that tool's JSON schema. ``auto`` offers
both alternatives and lets the model's own probabilities choose, per choice; ``required``
and a named tool leave only the call. The format is the Hermes/Qwen one that SmolLM2 was
trained with; its chat template has no tool support, so the tool list goes into the
system message and tool results come back as ``<tool_response>`` user turns (the ChatML
fallback of ``docs/decisions/engine-tool-calls-by-grammar.md``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ncap.errors import InvalidType, InvalidValue

__all__ = [
    "ParsedCall",
    "ToolChoiceText",
    "ToolSpec",
    "parse_calls",
    "tool_grammar",
    "tool_spec",
    "tools_system_block",
]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]

    def definition(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """The request's function tools and how a choice may use them."""

    tools: tuple[Tool, ...]
    choice: str  # "auto", "required" or the name of the one tool to call
    parallel: bool = True

    @property
    def callable(self) -> tuple[Tool, ...]:
        if self.choice in ("auto", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)


@dataclass(frozen=True, slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def tool_spec(body: Mapping[str, Any]) -> ToolSpec | None:
    """The tools of a validated chat body; None when no call is possible."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    if not raw or choice == "none":
        return None
    if not isinstance(raw, list):
        raise InvalidType("tools must be a list", param="tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidValue("tool names must be unique", param="tools")
    parallel = body.get("parallel_tool_calls")
    return ToolSpec(tools, _choice(choice, names), parallel is not False)


def _tool(raw: Any, i: int) -> Tool:
    if not isinstance(raw, Mapping) or raw.get("type") != "function":
        raise InvalidValue(
            "the local engine supports function tools only", param=f"tools.[{i}].type"
        )
    fn = raw.get("function")
    if not isinstance(fn, Mapping):
        fn = {}
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidValue("a function tool needs a name", param=f"tools.[{i}].function.name")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, Mapping):
        raise InvalidType(
            "parameters must be a JSON schema object", param=f"tools.[{i}].function.parameters"
        )
    return Tool(name, str(fn.get("description") or ""), params)


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None or choice in ("auto", "required"):
        return str(choice or "auto")
    fn = choice.get("function") if isinstance(choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise InvalidValue(
            "tool_choice must be none, auto, required or a named function", param="tool_choice"
        )
    if name not in names:
        raise InvalidValue(f"tool_choice names an unknown tool {name!r}", param="tool_choice")
    return name


# --- prompt ---------------------------------------------------------------------------


def tools_system_block(spec: ToolSpec) -> str:
    """The Hermes-style instructions and signatures put into the system message."""
    signatures = "\n".join(json.dumps(t.definition(), ensure_ascii=False) for t in spec.tools)
    return (
        "You are a function calling AI model. You are provided with function signatures "
        "within <tools></tools> XML tags. You may call one or more functions to assist with "
        "the user query. Don't make assumptions about what values to plug into functions.\n"
        f"<tools>\n{signatures}\n</tools>\n"
        "For each function call return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def call_markup(calls: Sequence[Any]) -> str:
    """An assistant message's ``tool_calls`` written back the way the model emits them."""
    blocks = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping):
            continue
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            arguments = fn.get("arguments")
        payload = {"name": fn.get("name"), "arguments": arguments}
        blocks.append(f"{OPEN}\n{json.dumps(payload, ensure_ascii=False)}\n{CLOSE}")
    return "\n".join(blocks)


# --- grammar --------------------------------------------------------------------------


def tool_grammar(spec: ToolSpec) -> str:
    """GBNF: prose or tool-call blocks (``auto``), or tool-call blocks only."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": dict(t.parameters)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in spec.callable
    ]
    schema = variants[0] if len(variants) == 1 else {"oneOf": variants}
    try:
        body = str(json_schema_to_gbnf(json.dumps(schema), prop_order=["name", "arguments"]))
    except Exception as exc:  # the converter raises bare Exceptions on unsupported schemas
        raise InvalidValue(
            f"cannot turn a tool's parameters into a grammar: {exc}", param="tools"
        ) from exc
    body = re.sub(r"^root ::=", "tool-call-json ::=", body, count=1, flags=re.MULTILINE)
    block = r'"<tool_call>\n" tool-call-json "\n</tool_call>"'
    calls = f'{block} ("\\n" {block})*' if spec.parallel else block
    root = "root ::= tool-calls | prose" if spec.choice == "auto" else "root ::= tool-calls"
    return f"{root}\ntool-calls ::= {calls}\nprose ::= [^<\\x00] [^\\x00]*\n{body}"


# --- output ---------------------------------------------------------------------------


def parse_calls(text: str) -> list[ParsedCall] | None:
    """The calls in a choice's text; None when it is not a complete call block."""
    if not text.lstrip().startswith(OPEN):
        return None
    calls = []
    for payload in _BLOCK.findall(text):
        try:
            data = json.loads(payload)
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = json.dumps(data.get("arguments", {}), ensure_ascii=False)
        calls.append(ParsedCall(f"call_{uuid.uuid4().hex[:24]}", data["name"], arguments))
    return calls or None


class ToolChoiceText:
    """One choice's text in a tool request: prose passes through as it comes; a call
    (the grammar starts it with ``<``, prose never) is held until the choice ends."""

    def __init__(self) -> None:
        self.mode: str | None = None  # "prose" or "call"
        self._held: list[str] = []

    def feed(self, text: str, done: bool) -> tuple[str, list[ParsedCall] | None]:
        """(text to send now, the parsed calls once a call choice is done)."""
        if self.mode is None and text.strip():
            self.mode = "call" if text.lstrip().startswith("<") else "prose"
        if self.mode == "prose":
            if self._held:
                text, self._held = "".join(self._held) + text, []
            return text, None
        self._held.append(text)
        if not done:
            return "", None
        held = "".join(self._held)
        calls = parse_calls(held)
        return ("", calls) if calls else (held, None)
