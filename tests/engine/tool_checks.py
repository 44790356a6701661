"""What a tool request's choices must be, checked on the official SDK's objects.

Shared by the engine tests (a few seeded requests) and ``bench/engine_tools_bench.py``
(the full sweep over seeds 0-199): one definition of a request per seed, one check of
a choice, one tally.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import jsonschema

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current local time in a timezone",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"type": "string"}},
                "required": ["tz"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer"},
                },
                "required": ["city"],
            },
        },
    },
]
SCHEMAS: dict[str, Any] = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What time is it in Tokyo, and will it rain there?"}]

KINDS = ("named", "required", "auto")
TEMPERATURES = (1.0, 1.5)
MAX_TOKENS = (16, 64, 256)


def request(seed: int, *, n: int = 5) -> dict[str, Any]:
    """The sweep's request for ``seed``: kind, temperature, output ceiling and
    ``parallel_tool_calls`` cycle so that every combination recurs over 0-199."""
    kind = KINDS[seed % 3]
    choice: Any = {"named": {"type": "function", "function": {"name": "get_time"}}}.get(kind, kind)
    return {
        "model": "smollm2",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": choice,
        "parallel_tool_calls": (seed // 18) % 2 == 1,
        "n": n,
        "temperature": TEMPERATURES[(seed // 3) % 2],
        "max_tokens": MAX_TOKENS[(seed // 6) % 3],
        "seed": seed,
    }


def allowed(body: dict[str, Any]) -> set[str]:
    choice = body["tool_choice"]
    if isinstance(choice, dict):
        return {choice["function"]["name"]}
    return set(SCHEMAS)


def _whole(call: Any, names: set[str]) -> None:
    """A finished call names an allowed tool and its arguments match its schema."""
    assert call.function.name in names, call.function.name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert call.id and call.type == "function"


def _cut(call: Any, names: set[str]) -> bool:
    """The last call of a choice cut by the token limit: its name so far begins an
    allowed tool's; arguments that did parse are valid. True when they were whole."""
    name, arguments = call.function.name, call.function.arguments
    assert any(n.startswith(name) for n in names), name
    try:
        value = json.loads(arguments)
    except ValueError:
        return False
    assert name in names
    jsonschema.validate(value, SCHEMAS[name])
    return True


def check_choice(choice: Any, body: dict[str, Any]) -> str:
    """``call``, ``partial`` or ``prose``; an AssertionError names any breach."""
    names = allowed(body)
    forced = body["tool_choice"] != "auto"
    calls = choice.message.tool_calls or []
    if not calls:
        assert not forced, f"a forced choice came back without a call: {choice.finish_reason}"
        text = choice.message.content or ""
        assert text and not text.startswith("<") and "<tool_call>" not in text, text[:80]
        assert choice.finish_reason in ("stop", "length")
        return "prose"
    assert not choice.message.content, "text beside the calls"
    if body["parallel_tool_calls"] is False:
        assert len(calls) == 1, f"{len(calls)} calls with parallel_tool_calls false"
    for call in calls[:-1]:
        _whole(call, names)
    if choice.finish_reason == "tool_calls":
        _whole(calls[-1], names)
        return "call"
    assert choice.finish_reason == "length", choice.finish_reason
    return "call" if _cut(calls[-1], names) else "partial"


@dataclass
class Tally:
    """Counts over a sweep: choices by kind of request and by outcome."""

    requests: int = 0
    choices: Counter[tuple[str, str]] = field(default_factory=Counter)
    finish: Counter[str] = field(default_factory=Counter)
    calls_validated: int = 0
    single_call_choices: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, body: dict[str, Any], completion: Any) -> None:
        self.requests += 1
        kind = body["tool_choice"] if isinstance(body["tool_choice"], str) else "named"
        assert len(completion.choices) == body["n"]
        for choice in completion.choices:
            self.finish[choice.finish_reason] += 1
            try:
                outcome = check_choice(choice, body)
            except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
                self.failures.append(f"seed {body['seed']} choice {choice.index}: {exc}")
                continue
            self.choices[kind, outcome] += 1
            calls = choice.message.tool_calls or []
            whole = calls if outcome == "call" else calls[:-1]
            self.calls_validated += len(whole)
            if calls and body["parallel_tool_calls"] is False:
                self.single_call_choices += 1
