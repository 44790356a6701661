"""Per-choice detokenization: UTF-8 split across tokens, stop strings held back."""

from __future__ import annotations

import pytest

from ncap.engine.text import ChoiceText


def feed_all(text: ChoiceText, pieces: list[bytes]) -> tuple[list[str], bool]:
    out = []
    for piece in pieces:
        chunk, stopped = text.feed(piece)
        out.append(chunk)
        if stopped:
            return out, True
    out.append(text.finish())
    return out, False


def test_multibyte_character_split_across_tokens_is_buffered() -> None:
    euro = "€".encode()
    out, stopped = feed_all(ChoiceText(), [b"a", euro[:1], euro[1:], b"b"])
    assert out == ["a", "", "€", "b", ""]
    assert not stopped


def test_incomplete_bytes_at_the_end_become_a_replacement_character() -> None:
    out, _ = feed_all(ChoiceText(), [b"x", "€".encode()[:2]])
    assert "".join(out) == "x\ufffd"


@pytest.mark.parametrize(
    ("pieces", "stops", "emitted", "stopped"),
    [
        ([b"Hello", b" wor", b"ld"], ("world",), "Hello ", True),
        ([b"Hello", b" wor", b"k"], ("world",), "Hello work", False),
        ([b"ab", b"cSTO", b"P tail"], ("STOP",), "abc", True),
        ([b"1, 2, 3"], (", 3", "2"), "1, ", True),
        ([b"no stop here"], (), "no stop here", False),
        ([b"END"], ("END",), "", True),
    ],
)
def test_stop_strings_are_never_emitted(
    pieces: list[bytes], stops: tuple[str, ...], emitted: str, stopped: bool
) -> None:
    out, hit = feed_all(ChoiceText(stops), pieces)
    assert "".join(out) == emitted
    assert hit is stopped


def test_text_that_may_start_a_stop_string_is_held_back() -> None:
    text = ChoiceText(("</answer>",))
    assert text.feed(b"42 </ans") == ("42 ", False)
    assert text.feed(b"wer>") == ("", True)


def test_held_text_is_released_once_it_cannot_be_a_stop() -> None:
    text = ChoiceText(("</answer>",))
    assert text.feed(b"a </") == ("a ", False)
    assert text.feed(b"b>") == ("</b>", False)
