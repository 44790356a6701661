"""Every provider kind that reaches an upstream over a wire has a translator
(``providers.kinds.translator_for``) implementing the whole ``Translator`` interface,
and its adapter uses the one the registry picks. The check reads the interface's own
members, so a method added to it is checked on every translator at once."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import pytest

from ncap.config import parse_route
from ncap.providers import provider_for
from ncap.providers.base import AttemptFailed
from ncap.providers.kinds import KINDS, TRANSLATORS, translator_for
from ncap.providers.translate import Reply, Sent, StreamTranslator, Translator

BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "Hi"}],
    "max_completion_tokens": 16,
}
WIRED = sorted(kind for kind, caps in KINDS.items() if not caps.in_process)
ROUTES: dict[str, dict[str, Any]] = {
    "openai": {"base_url": "http://127.0.0.1:9/v1"},
    "azure": {"base_url": "http://127.0.0.1:9", "upstream_model": "dep"},
    "anthropic": {"upstream_model": "claude-x"},
    "gemini": {"upstream_model": "gemini-2.5-flash"},
}


def _members(protocol: type) -> dict[str, Any]:
    """The interface's members: its public methods and properties, by name."""
    return {
        name: value
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


def missing(implementation: object, protocol: type) -> list[str]:
    """What ``implementation`` lacks of ``protocol``: a member, or a method whose
    parameters (names, kinds) differ from the interface's."""
    gaps = []
    for name, member in _members(protocol).items():
        if not hasattr(implementation, name):
            gaps.append(f"{name}: missing")
            continue
        if isinstance(member, property):
            continue
        wanted = list(inspect.signature(member).parameters.values())[1:]  # without self
        given = list(inspect.signature(getattr(implementation, name)).parameters.values())
        if [(p.name, p.kind) for p in wanted] != [(p.name, p.kind) for p in given]:
            gaps.append(f"{name}: parameters {given} are not {wanted}")
    return gaps


def _reply(**fields: Any) -> Reply:
    return Reply(
        headers=fields.pop("headers", {}),
        request_id="rid-1",
        created=1,
        model="m",
        scrub_id=lambda value: value,
        spare_id=lambda: "spare",
        **fields,
    )


class _WithoutErrors:
    """A translator that forgot the error half of the pair."""

    def request(self, body: Mapping[str, Any], kind: str, *, model: str) -> Sent[None]:
        return Sent(b"", None)

    def response(self, payload: bytes, reply: Reply, shape: None) -> Any:
        raise AssertionError

    def stream(self, reply: Reply, shape: None) -> Any:
        raise AssertionError


class _StreamWithoutEnd:
    provider_request_id = None

    def events(self, data: bytes) -> None:
        return None


def test_the_check_finds_a_missing_method_or_other_parameters() -> None:
    assert missing(_WithoutErrors(), Translator) == ["error: missing"]
    assert missing(_StreamWithoutEnd(), StreamTranslator) == ["end: missing"]

    class _OtherRequest(_WithoutErrors):
        def request(self, body: Mapping[str, Any], kind: str, model: str) -> Sent[None]:  # type: ignore[override]
            return Sent(b"", None)

        def error(self, status: int, headers: Mapping[str, str], payload: bytes) -> Any:
            raise AssertionError

    assert [gap.split(":")[0] for gap in missing(_OtherRequest(), Translator)] == ["request"]


def test_every_kind_on_a_wire_has_a_translator_and_the_engine_has_none() -> None:
    assert sorted(TRANSLATORS) == WIRED
    assert set(KINDS) - set(WIRED) == {"local"}  # in-process: no bytes to translate


@pytest.mark.parametrize("kind", WIRED)
def test_each_translator_implements_the_whole_interface(kind: str) -> None:
    translator = translator_for(kind)
    assert missing(translator, Translator) == []
    sent = translator.request(BODY, "chat", model="m")
    assert isinstance(sent, Sent) and isinstance(sent.data, bytes) and sent.data
    stream = translator.stream(_reply(first_event=b"{}"), sent.shape)
    assert missing(stream, StreamTranslator) == []
    assert stream.end() is None  # nothing arrived: not a completed stream


@pytest.mark.parametrize("kind", WIRED)
def test_each_translator_raises_only_the_failure_tables_facts(kind: str) -> None:
    translator = translator_for(kind)
    failure = translator.error(503, {"retry-after": "2"}, b"<html>busy</html>")
    assert (failure.kind, failure.status, failure.retry_after) == ("status", 503, 2.0)
    shape = translator.request(BODY, "chat", model="m").shape
    with pytest.raises(AttemptFailed) as caught:
        translator.response(b"{not json", _reply(), shape)
    assert (caught.value.kind, caught.value.status) == ("protocol", 200)


@pytest.mark.parametrize("kind", WIRED)
def test_each_adapter_uses_the_translator_the_registry_picks(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    picked = translator_for(kind)
    asked: list[str] = []

    def pick() -> Translator[Any]:
        asked.append(kind)
        return picked

    monkeypatch.setitem(TRANSLATORS, kind, pick)
    route = parse_route({"provider": kind, **ROUTES[kind]})
    provider = provider_for(route, route_id="r")
    assert asked == [kind]
    assert provider._translator is picked  # type: ignore[attr-defined]
