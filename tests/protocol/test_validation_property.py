"""Property tests: whatever the body, validation raises only NcapError with a valid envelope."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ncap.errors import NcapError
from ncap.protocol.validate import CHAT_FIELDS, parse_chat_request, parse_completion_request
from tests.protocol.test_validation_table import VALID_BODIES

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-200, max_value=200)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(["user", "assistant", "text", "function", "auto", "json_schema", ""])
)
KEYS = st.text(max_size=10) | st.sampled_from(
    ["role", "content", "type", "text", "name", "function", "tool_calls", "json_schema"]
)
JSON = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(KEYS, children, max_size=5),
    max_leaves=20,
)
SMALL_JSON = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(KEYS, children, max_size=3),
    max_leaves=6,
)
FIELD_NAMES = st.sampled_from(sorted(CHAT_FIELDS)) | st.sampled_from(
    ["best_of", "candidate_count", "num_return_sequences", "top_k"]
)

Parser = Callable[[bytes], tuple[dict[str, Any], object]]


def check(parse: Parser, raw: bytes) -> None:
    """Either the body parses (and round-trips) or an NcapError with a valid envelope."""
    try:
        decoded, _ = parse(raw)
    except NcapError as exc:
        assert exc.status in (400, 413)
        error = exc.envelope()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        assert error["type"] == "invalid_request_error"
        assert isinstance(error["code"], str) and error["code"]
        assert error["param"] is None or isinstance(error["param"], str)
        json.dumps(exc.envelope())
    else:
        assert decoded == json.loads(raw)


def check_both(raw: bytes) -> None:
    check(parse_chat_request, raw)
    check(parse_completion_request, raw)


@SETTINGS
@given(JSON)
def test_any_json_value(value: Any) -> None:
    check_both(json.dumps(value).encode())


@SETTINGS
@given(st.binary(max_size=64))
def test_any_bytes(raw: bytes) -> None:
    check_both(raw)


@SETTINGS
@given(st.dictionaries(FIELD_NAMES, SMALL_JSON, max_size=10))
def test_random_fields_with_random_values(value: dict[str, Any]) -> None:
    check_both(json.dumps(value).encode())


def _paths(root: Any) -> list[tuple[Any, ...]]:
    """Every path from the root to a node (iterative)."""
    out: list[tuple[Any, ...]] = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), root)]
    while stack:
        path, node = stack.pop()
        children = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in children:
            out.append((*path, key))
            if isinstance(child, dict | list):
                stack.append(((*path, key), child))
    return out


@st.composite
def mutated_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid body with one node replaced by a random JSON value, or deleted."""
    _, base = draw(st.sampled_from(VALID_BODIES))
    value = copy.deepcopy(base)
    path = draw(st.sampled_from(_paths(value)))
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(JSON)
    return value


@SETTINGS
@given(mutated_bodies())
def test_mutated_valid_body(value: dict[str, Any]) -> None:
    check(parse_chat_request, json.dumps(value).encode())


@SETTINGS
@given(st.sampled_from(VALID_BODIES), st.sampled_from(sorted(CHAT_FIELDS)), JSON)
def test_valid_body_with_one_field_replaced(
    case: tuple[str, dict[str, Any]], field: str, replacement: Any
) -> None:
    value = {**case[1], field: replacement}
    check(parse_chat_request, json.dumps(value).encode())
