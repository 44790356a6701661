"""Request validation cost: msgspec vs pydantic v2 vs orjson/json + hand checks.

The same representative subset of the request validation rules is written three ways (typed
fields, ranges, role-tagged messages, stop ≤ 4, logit_bias range, unknown fields
rejected, top_logprobs only with logprobs, stream_options only with stream), and
each implementation must accept the valid body and reject every invalid one
before it is timed, so the comparison is between equal amounts of checking.
Timed: bytes in -> validated object out (parse included), µs per call.
"""

from __future__ import annotations

import json
import timeit
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec
import orjson
import pydantic
from msgspec import Meta, Struct

# ---------------------------------------------------------------- the body

_SYSTEM = (
    "You are the support assistant for Acme Cloud. Answer in at most three sentences, "
    "cite the relevant help-centre article by its title, and never promise refunds or "
    "credits: hand those cases to a human agent. If the question is not about Acme "
    "Cloud, say that you can only help with Acme Cloud."
)
_USER = (
    "Hi, since this morning our nightly backup job to the eu-west bucket fails with "
    "'403 SignatureDoesNotMatch'. We rotated the access key last week, but the job "
    "ran fine for six days after that. Nothing else changed on our side as far as I "
    "know. Which settings should I check first, and is there a known incident?"
)
VALID: dict[str, Any] = {
    "model": "approved-standard",
    "messages": [
        {"role": "system", "content": _SYSTEM},
        {"role": "user", "content": _USER},
        {"role": "assistant", "content": "Could you share the job's region setting?"},
        {"role": "user", "content": [{"type": "text", "text": "Region is eu-west-1."}]},
    ],
    "n": 4,
    "temperature": 0.8,
    "top_p": 0.95,
    "max_completion_tokens": 256,
    "stop": ["\n\nUser:"],
    "seed": 7,
    "presence_penalty": 0.1,
    "frequency_penalty": 0.1,
    "logit_bias": {"50256": -100},
    "user": "u-8c1f",
    "metadata": {"ticket": "T-4411"},
    "response_format": {"type": "text"},
    "stream": False,
}
INVALID: list[dict[str, Any]] = [
    {**VALID, "best_of": 3},
    {**VALID, "n": 0},
    {**VALID, "n": 1.5},
    {**VALID, "temperature": 2.5},
    {**VALID, "messages": []},
    {**VALID, "messages": [{"role": "robot", "content": "x"}]},
    {**VALID, "messages": [{"role": "user"}]},
    {**VALID, "stop": ["a", "b", "c", "d", "e"]},
    {**VALID, "logit_bias": {"1": 101}},
    {**VALID, "top_logprobs": 3},
    {**VALID, "stream_options": {"include_usage": True}},
    {**VALID, "response_format": {"type": "yaml"}},
    {k: v for k, v in VALID.items() if k != "model"},
]

# ---------------------------------------------------------------- msgspec

Penalty = Annotated[float, Meta(ge=-2, le=2)]


class MTextPart(Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    text: str


class MImageUrl(Struct, forbid_unknown_fields=True):
    url: str
    detail: Literal["auto", "low", "high"] = "auto"


class MImagePart(Struct, tag="image_url", tag_field="type", forbid_unknown_fields=True):
    image_url: MImageUrl


MContent = str | list[MTextPart | MImagePart]


class MSystem(Struct, tag="system", tag_field="role", forbid_unknown_fields=True):
    content: MContent
    name: str | None = None


class MDeveloper(Struct, tag="developer", tag_field="role", forbid_unknown_fields=True):
    content: MContent
    name: str | None = None


class MUser(Struct, tag="user", tag_field="role", forbid_unknown_fields=True):
    content: MContent
    name: str | None = None


class MAssistant(Struct, tag="assistant", tag_field="role", forbid_unknown_fields=True):
    content: MContent | None = None
    name: str | None = None
    refusal: str | None = None


class MTool(Struct, tag="tool", tag_field="role", forbid_unknown_fields=True):
    content: MContent
    tool_call_id: str


class MStreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None


class MFormatText(Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    pass


class MFormatJson(Struct, tag="json_object", tag_field="type", forbid_unknown_fields=True):
    pass


class MRequest(Struct, forbid_unknown_fields=True, omit_defaults=True):
    model: str
    messages: Annotated[list[MSystem | MDeveloper | MUser | MAssistant | MTool], Meta(min_length=1)]
    n: Annotated[int, Meta(ge=1, le=128)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    stop: str | Annotated[list[str], Meta(max_length=4)] | None = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100, le=100)]] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    response_format: MFormatText | MFormatJson | None = None
    stream: bool | None = None
    stream_options: MStreamOptions | None = None

    def __post_init__(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options requires stream: true")


_MSGSPEC_DECODER = msgspec.json.Decoder(MRequest)


def via_msgspec(raw: bytes) -> object:
    return _MSGSPEC_DECODER.decode(raw)


# ---------------------------------------------------------------- pydantic v2


class _P(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)


class PTextPart(_P):
    type: Literal["text"]
    text: str


class PImageUrl(_P):
    url: str
    detail: Literal["auto", "low", "high"] = "auto"


class PImagePart(_P):
    type: Literal["image_url"]
    image_url: PImageUrl


PContent = str | list[Annotated[PTextPart | PImagePart, pydantic.Field(discriminator="type")]]


class PSystem(_P):
    role: Literal["system"]
    content: PContent
    name: str | None = None


class PDeveloper(_P):
    role: Literal["developer"]
    content: PContent
    name: str | None = None


class PUser(_P):
    role: Literal["user"]
    content: PContent
    name: str | None = None


class PAssistant(_P):
    role: Literal["assistant"]
    content: PContent | None = None
    name: str | None = None
    refusal: str | None = None


class PTool(_P):
    role: Literal["tool"]
    content: PContent
    tool_call_id: str


class PStreamOptions(_P):
    include_usage: bool | None = None


class PFormat(_P):
    type: Literal["text", "json_object"]


PMessage = Annotated[
    PSystem | PDeveloper | PUser | PAssistant | PTool, pydantic.Field(discriminator="role")
]
PPenalty = Annotated[float, pydantic.Field(ge=-2, le=2)]


class PRequest(_P):
    model: str
    messages: Annotated[list[PMessage], pydantic.Field(min_length=1)]
    n: Annotated[int, pydantic.Field(ge=1, le=128)] | None = None
    temperature: Annotated[float, pydantic.Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, pydantic.Field(ge=0, le=1)] | None = None
    max_tokens: Annotated[int, pydantic.Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, pydantic.Field(ge=1)] | None = None
    stop: str | Annotated[list[str], pydantic.Field(max_length=4)] | None = None
    seed: int | None = None
    presence_penalty: PPenalty | None = None
    frequency_penalty: PPenalty | None = None
    logit_bias: dict[str, Annotated[float, pydantic.Field(ge=-100, le=100)]] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, pydantic.Field(ge=0, le=20)] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    response_format: PFormat | None = None
    stream: bool | None = None
    stream_options: PStreamOptions | None = None

    @pydantic.model_validator(mode="after")
    def _cross_field(self) -> PRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options requires stream: true")
        return self


def via_pydantic(raw: bytes) -> object:
    return PRequest.model_validate_json(raw)


# ---------------------------------------------------------------- hand checks


class Invalid(ValueError):
    pass


_NUM = (int, float)
_ROLES = {"system", "developer", "user", "assistant", "tool"}
_MSG_FIELDS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "refusal"},
    "tool": {"role", "content", "tool_call_id"},
}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, _NUM) and not isinstance(v, bool)


def _range(body: dict[str, Any], key: str, lo: float, hi: float, integer: bool = False) -> None:
    v = body.get(key)
    if v is None:
        return
    if not (_is_int(v) if integer else _is_num(v)) or not lo <= v <= hi:
        raise Invalid(key)


def _content(v: object, optional: bool = False) -> None:
    if isinstance(v, str) or (optional and v is None):
        return
    if not isinstance(v, list):
        raise Invalid("content")
    for part in v:
        if not isinstance(part, dict):
            raise Invalid("content")
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str) and len(part) == 2:
            continue
        if kind == "image_url" and isinstance(part.get("image_url"), dict) and len(part) == 2:
            continue
        raise Invalid("content")


def _message(m: object) -> None:
    if not isinstance(m, dict) or m.get("role") not in _ROLES:
        raise Invalid("messages.role")
    role = m["role"]
    if not m.keys() <= _MSG_FIELDS[role]:
        raise Invalid("messages")
    if role != "assistant" and "content" not in m:
        raise Invalid("messages.content")
    _content(m.get("content"), optional=role == "assistant")
    if role == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise Invalid("messages.tool_call_id")


_KNOWN = set(VALID) | {
    "max_tokens",
    "logprobs",
    "top_logprobs",
    "stream_options",
}


def _scalars(b: dict[str, Any]) -> None:
    _range(b, "n", 1, 128, integer=True)
    _range(b, "temperature", 0, 2)
    _range(b, "top_p", 0, 1)
    _range(b, "presence_penalty", -2, 2)
    _range(b, "frequency_penalty", -2, 2)
    _range(b, "top_logprobs", 0, 20, integer=True)
    _range(b, "max_tokens", 1, float("inf"), integer=True)
    _range(b, "max_completion_tokens", 1, float("inf"), integer=True)
    for key, kind in (("seed", int), ("user", str), ("stream", bool), ("logprobs", bool)):
        if b.get(key) is not None and not isinstance(b[key], kind):
            raise Invalid(key)


def _str_list(v: object, max_len: int) -> bool:
    return isinstance(v, list) and len(v) <= max_len and all(isinstance(s, str) for s in v)


def _structured(b: dict[str, Any]) -> None:
    stop = b.get("stop")
    if not (stop is None or isinstance(stop, str) or _str_list(stop, 4)):
        raise Invalid("stop")
    bias = b.get("logit_bias")
    if bias is not None and (
        not isinstance(bias, dict)
        or not all(_is_num(v) and -100 <= v <= 100 for v in bias.values())
    ):
        raise Invalid("logit_bias")
    meta = b.get("metadata")
    if meta is not None and not all(isinstance(v, str) for v in meta.values()):
        raise Invalid("metadata")
    fmt = b.get("response_format")
    if fmt is not None and (
        not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object")
    ):
        raise Invalid("response_format")


def check(b: object) -> dict[str, Any]:
    """Hand-written equivalent of MRequest/PRequest over an already parsed body."""
    if not isinstance(b, dict):
        raise Invalid("body")
    if not b.keys() <= _KNOWN:
        raise Invalid("unknown_parameter")
    if not isinstance(b.get("model"), str):
        raise Invalid("model")
    msgs = b.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise Invalid("messages")
    for m in msgs:
        _message(m)
    _scalars(b)
    _structured(b)
    if b.get("top_logprobs") is not None and not b.get("logprobs"):
        raise Invalid("top_logprobs")
    if b.get("stream_options") is not None and not b.get("stream"):
        raise Invalid("stream_options")
    return b


def via_orjson(raw: bytes) -> object:
    return check(orjson.loads(raw))


def via_json(raw: bytes) -> object:
    return check(json.loads(raw))


IMPLS: dict[str, Callable[[bytes], object]] = {
    "msgspec Struct (decode+validate)": via_msgspec,
    "pydantic v2 model_validate_json": via_pydantic,
    "orjson.loads + hand checks": via_orjson,
    "json.loads + hand checks": via_json,
}


def self_check() -> None:
    """Every implementation accepts VALID and rejects each INVALID body."""
    good = json.dumps(VALID).encode()
    for name, fn in IMPLS.items():
        fn(good)
        for i, bad in enumerate(INVALID):
            try:
                fn(json.dumps(bad).encode())
            except (ValueError, msgspec.ValidationError, pydantic.ValidationError):
                continue
            raise AssertionError(f"{name} accepted invalid body #{i}: {bad}")


def _time(fn: Callable[[bytes], object], raw: bytes, number: int) -> float:
    """Best of 7 repeats, µs per call (the minimum is the least disturbed sample)."""

    def call() -> None:
        try:  # noqa: SIM105 - cheaper than contextlib.suppress inside the timed loop
            fn(raw)
        except (ValueError, msgspec.ValidationError, pydantic.ValidationError):
            pass

    return min(timeit.repeat(call, number=number, repeat=7)) / number * 1e6


def run(number: int = 20000) -> list[dict[str, Any]]:
    self_check()
    valid = json.dumps(VALID).encode()
    unknown = json.dumps({**VALID, "best_of": 3}).encode()
    rows = []
    for name, fn in IMPLS.items():
        rows.append(
            {
                "implementation": name,
                "valid_us": round(_time(fn, valid, number), 2),
                "invalid_unknown_field_us": round(_time(fn, unknown, number), 2),
                "body_bytes": len(valid),
            }
        )
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
