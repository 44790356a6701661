"""The product's docs stand alone, and the decision records are indexed.

The user-facing docs (``README.md``, ``CONTRIBUTING.md``, ``docs/**/*.md``) describe the
product as it is: they must not send a reader to a tracker, a work session or a spec
that is not in the repository. The decision records in ``docs/decisions/`` are one file
each, every one linked from ``docs/decisions/README.md`` (the index), every link in
the index naming a file that exists, and every relative link between the docs resolving.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DECISIONS = ROOT / "docs" / "decisions"
INDEX = DECISIONS / "README.md"

# What a reader of the repository cannot follow: a tracker's issue number, a work
# session, a section of a spec kept outside the repository, or that spec's folder.
CITATIONS = {
    "issue number": re.compile(r"\b[Ii]ssues?\s+#?\d+"),
    "session number": re.compile(r"\b[Ss]essions?\s+#?\d+"),
    "spec section": re.compile(r"§|\bSPEC\b|\bAppendix\s+[A-Z]\b"),
    "outside folder": re.compile(r"\.\./shared\b|/work/shared\b"),
}
# a bare "#12" is a tracker's number in prose; inside `code` it is something else
HASH_NUMBER = re.compile(r"(?<![\w/&#])#\d+\b")
CODE_SPAN = re.compile(r"`[^`]*`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def user_docs() -> list[Path]:
    docs = sorted((ROOT / "docs").rglob("*.md"))
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *docs]


def citations(text: str) -> list[str]:
    """Each outside citation in ``text``, as ``line N: kind: 'match'``."""
    found: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        for kind, pattern in CITATIONS.items():
            found += [f"line {number}: {kind}: {m.group(0)!r}" for m in pattern.finditer(line)]
        prose = CODE_SPAN.sub("", line)
        for m in HASH_NUMBER.finditer(prose):
            found.append(f"line {number}: issue number: {m.group(0)!r}")
    return found


def relative_links(text: str) -> list[str]:
    """The link targets of ``text`` that are files of the repository (no URL, no anchor)."""
    targets = []
    for target in LINK.findall(text):
        path = target.split("#", 1)[0]
        if path and "://" not in path and not path.startswith("mailto:"):
            targets.append(path)
    return targets


def records() -> set[str]:
    return {p.name for p in DECISIONS.glob("*.md") if p.name != "README.md"}


@pytest.mark.parametrize(
    "text",
    [
        "see issue 24",
        "Issue 9, fourth phase",
        "fixed in #12.",
        "Session 4 had rejected this",
        "the embedded default, SPEC §2",
        "(the shape of SPEC Appendix A)",
        "details in ../shared/SPEC.md",
    ],
)
def test_the_check_finds_each_kind_of_citation(text: str) -> None:
    assert citations(text), text


@pytest.mark.parametrize(
    "text",
    [
        "msgspec validates the body",
        "no server-side session table",
        "one connection pool per session",
        "see [the index](decisions/README.md#ledger)",
        "the `#1` choice",
        "`x-fake-fail-times` of 2 for an issue with the route",
        "a shared HTTP transport, the shared 2-core machine",
    ],
)
def test_the_check_leaves_ordinary_prose_alone(text: str) -> None:
    assert citations(text) == []


@pytest.mark.parametrize("doc", user_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_cite_nothing_outside_the_repository(doc: Path) -> None:
    assert citations(doc.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("doc", user_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    missing = [t for t in relative_links(text) if not (doc.parent / t).exists()]
    assert missing == []


def test_every_link_in_the_index_names_a_record() -> None:
    linked = relative_links(INDEX.read_text(encoding="utf-8"))
    assert linked, "the index links no record"
    assert [t for t in linked if not (DECISIONS / t).is_file()] == []
    assert len(linked) == len(set(linked)), "a record is listed twice"


def test_every_record_is_in_the_index() -> None:
    linked = set(relative_links(INDEX.read_text(encoding="utf-8")))
    assert sorted(records() - linked) == [], "add a line for each to docs/decisions/README.md"


@pytest.mark.parametrize("name", sorted(records()))
def test_each_record_has_its_parts(name: str) -> None:
    """A title, then its context, the decision and its consequences, each opened by a
    heading (``## Context``) or a bold lead (``**Context.**``, ``**Decision:**``)."""
    text = (DECISIONS / name).read_text(encoding="utf-8")
    assert text.startswith("# "), "a record starts with its title"
    for part in ("Context", "Decision", "Consequence"):
        opened = re.compile(rf"^(#+\s*|\*\*){part}", re.M | re.I)
        assert opened.search(text), part


def test_superseded_records_point_at_their_successor() -> None:
    index = INDEX.read_text(encoding="utf-8")
    superseded = []
    for name in sorted(records()):
        text = (DECISIONS / name).read_text(encoding="utf-8")
        if "**Status: superseded**" not in text:
            continue
        superseded.append(name)
        status = next(line for line in text.splitlines() if "**Status: superseded**" in line)
        successors = [t for t in relative_links(status) if (DECISIONS / t).is_file()]
        assert successors, f"{name}: the status line links no existing record"
        assert f"]({name}) (superseded)" in index, f"{name}: the index does not say so"
    assert superseded, "no superseded record found: the marker has changed?"
