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
    "CallsText",
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

# llama-cpp-python's converter lets a JSON string hold any character but ``"`` and ``\``,
# raw control characters included, which JSON forbids (a raw newline in a string makes
# ``json.loads`` fail); llama.cpp's own converter has since excluded them. Strings here
# take printable characters and escapes only.
_CHAR_RULE = re.compile(r"^char ::= .*$", re.MULTILINE)
_JSON_CHAR = (
    r'char ::= [^"\\\x7F\x00-\x1F] | '
    r'"\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
)


def tool_grammar(spec: ToolSpec) -> str:
    """GBNF: tool-call blocks, or (``auto`` only) prose that never opens one.

    Prose may not begin with ``<`` nor contain ``<tool_call>`` anywhere, so a choice
    that starts a call is, from its first character, held to the call grammar; after
    the last block only the end of the choice may follow (no trailing text).
    """
    body = _CHAR_RULE.sub(lambda _: _JSON_CHAR, _call_json_grammar(spec))
    block = r'"<tool_call>\n" tool-call-json "\n</tool_call>"'
    calls = f'{block} ("\\n" {block})*' if spec.parallel else block
    if spec.choice != "auto":
        return f"root ::= tool-calls\ntool-calls ::= {calls}\n{body}"
    return f"root ::= tool-calls | prose\ntool-calls ::= {calls}\n{_prose_rules()}\n{body}"


def _call_json_grammar(spec: ToolSpec) -> str:
    """``tool-call-json``: {"name": <an allowed tool>, "arguments": <its schema>}."""
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
    return re.sub(r"^root ::=", "tool-call-json ::=", body, count=1, flags=re.MULTILINE)


def _prose_rules() -> str:
    """GBNF for text that does not start with ``<`` and never contains ``<tool_call>``.

    ``prose-k`` has matched the first k characters of the marker (``<`` occurs in it
    only first, so a mismatch restarts at 0, or at 1 on a ``<``); ``prose-11`` would be
    the whole marker and does not exist."""
    marker = OPEN
    rules = ["prose ::= [^<\\x00] prose-0", 'prose-0 ::= [^<\\x00] prose-0 | "<" prose-1 | ""']
    for k in range(1, len(marker)):
        ch = marker[k]
        nxt = f"prose-{k + 1}" if k + 1 < len(marker) else None
        alts = [f'"{ch}" {nxt}'] if nxt else []
        alts += ['"<" prose-1', f"[^{_cls(ch)}<\\x00] prose-0", '""']
        rules.append(f"prose-{k} ::= " + " | ".join(alts))
    return "\n".join(rules)


def _cls(ch: str) -> str:
    return "\\" + ch if ch in "]^-\\" else ch


# --- output ---------------------------------------------------------------------------

_DECODER = json.JSONDecoder()
_NAME = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]*)("?)')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*', re.DOTALL)


@dataclass(frozen=True, slots=True)
class CallsText:
    """A call choice's text read as blocks: the calls, and whether the last is whole."""

    calls: list[ParsedCall]
    complete: bool


def parse_calls(text: str, names: Sequence[str] = ()) -> CallsText | None:
    """The calls in a call choice's text (it starts with ``<``); None for prose.

    Blocks are read with a JSON decoder, not a pattern, so a ``</tool_call>`` inside an
    argument string is part of the string. A block cut short (the token limit) becomes
    a partial call, as OpenAI returns one: its name as far as it went (completed when
    only one of ``names`` begins with it) and its arguments as far as they went."""
    if not text.startswith("<"):
        return None
    calls: list[ParsedCall] = []
    pos = 0
    while pos < len(text):
        whole = _block(text, pos)
        if whole is None:
            calls.append(_partial(text[pos:], names))
            return CallsText(calls, False)
        call, pos = whole
        calls.append(call)
        pos += len(text[pos:]) - len(text[pos:].lstrip())
    return CallsText(calls, bool(calls))


def _block(text: str, pos: int) -> tuple[ParsedCall, int] | None:
    """One whole ``<tool_call>`` block at ``pos``: the call and where the block ends."""
    if not text.startswith(OPEN, pos):
        return None
    start = pos + len(OPEN)
    start += len(text[start:]) - len(text[start:].lstrip())
    try:
        data, end = _DECODER.raw_decode(text, start)
    except ValueError:
        return None
    rest = text[end:].lstrip()
    if not rest.startswith(CLOSE) or not isinstance(data, dict):
        return None
    name = data.get("name")
    if not isinstance(name, str):
        return None
    arguments = json.dumps(data.get("arguments", {}), ensure_ascii=False)
    return _call(name, arguments), len(text) - len(rest) + len(CLOSE)


def _partial(text: str, names: Sequence[str]) -> ParsedCall:
    body = text[len(OPEN) :].lstrip() if text.startswith(OPEN) else ""
    found = _NAME.match(body)
    name = found.group(1) if found else ""
    if not (found and found.group(2)):  # the name itself was cut: complete it if unique
        fits = [n for n in names if n.startswith(name)]
        name = fits[0] if len(fits) == 1 else name
    args = _ARGUMENTS.search(body, found.end()) if found and found.group(2) else None
    return _call(name, _arguments_so_far(body[args.end() :]) if args else "")


def _arguments_so_far(text: str) -> str:
    """Cut arguments as they are; whole ones (the block was cut after them) alone."""
    try:
        value, _ = _DECODER.raw_decode(text)
    except ValueError:
        return text.rstrip()
    return json.dumps(value, ensure_ascii=False)


def _call(name: str, arguments: str) -> ParsedCall:
    return ParsedCall(f"call_{uuid.uuid4().hex[:24]}", name, arguments)


class ToolChoiceText:
    """One choice's text in a tool request: prose passes through as it comes; a call
    (the grammar starts it with ``<``, prose never) is held until the choice ends, then
    read into calls, whole or cut, and never handed back as prose."""

    def __init__(self, names: Sequence[str] = ()) -> None:
        self.mode: str | None = None  # "prose" or "call"
        self._names = tuple(names)
        self._held: list[str] = []

    def feed(self, text: str, done: bool) -> tuple[str, CallsText | None]:
        """(text to send now, the calls once a call choice is done)."""
        if self.mode is None and text:
            self.mode = "call" if text.startswith("<") else "prose"
        if self.mode == "prose":
            return text, None
        self._held.append(text)
        if not done or self.mode is None:
            return "", None
        return "", parse_calls("".join(self._held), self._names)
