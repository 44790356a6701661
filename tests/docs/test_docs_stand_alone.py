"""The product's docs stand alone, and the decision records are indexed.

The user-facing docs (``README.md``, ``CONTRIBUTING.md``, ``docs/**/*.md``) describe the
product as it is: they must not send a reader to a tracker, a work session or a spec
that is not in the repository. The decision records in ``docs/decisions/`` are one file
each, every one linked from ``docs/decisions/README.md`` (the index), every link in
the index naming a file that exists, and every relative link between the docs resolving.

The code stands alone too: comments, docstrings, test names, migration headers, bench and
script text under ``src/``, ``tests/``, ``bench/``, ``scripts/``, ``.ci/``, the
``Makefile`` and ``pyproject.toml`` say what the code does and why, never which issue or
work session asked for it, and cite no section of a spec kept outside the repository.
Another project's tracker (``litellm issue 1234``, ``aio-libs/aiohttp#5678``) may be cited.
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
    "issue number": re.compile(r"\b[Ii]ssues?[\s-]+#?\d+"),
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


# -- the code: the same citations, in every text file of the code's folders -------------

CODE_ROOTS = ("src", "tests", "bench", "scripts", ".ci")
CODE_FILES = ("Makefile", "pyproject.toml")
# binary or generated artefacts (profiles, compiled files) are not prose
BINARY_SUFFIXES = frozenset({".prof", ".pyc", ".so", ".db", ".gguf", ".png", ".gz"})
CODE_CITATIONS = {
    "issue number": CITATIONS["issue number"],
    "session number": CITATIONS["session number"],
    "spec section": CITATIONS["spec section"],
    "outside folder": re.compile(r"\.\./shared\b"),
}
# another project's tracker, named just before the number: ``owner/repo`` or a project
# ncap uses or compares itself with (``litellm issue 1234``, ``CPython's issue 98765``)
THIRD_PARTY = re.compile(
    r"(?:\b[\w.-]+/[\w.-]+|\b(?:CPython|Python|aiohttp|msgspec|pydantic|typer|asyncpg|"
    r"redis(?:-py)?|hiredis|SQLite|PostgreSQL|llama\.cpp|llama-cpp-python|ggml|openai"
    r"(?:-python)?|anthropic|LiteLLM|Portkey|HELM|mutmut|schemathesis|hypothesis|pytest|"
    r"uvloop|ruamel\.yaml|playwright|numpy))(?:'s)?\s*$",
    re.I,
)


def code_citations(text: str) -> list[str]:
    """Each citation of this project's tracker, sessions or outside spec in ``text``."""
    found: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        for kind, pattern in CODE_CITATIONS.items():
            for m in pattern.finditer(line):
                if kind == "issue number" and THIRD_PARTY.search(line[: m.start()]):
                    continue
                found.append(f"line {number}: {kind}: {m.group(0)!r}")
    return found


def code_files() -> list[Path]:
    """Every text file of the code's folders, this file excepted (its examples above are
    citations on purpose)."""
    files = [ROOT / name for name in CODE_FILES if (ROOT / name).is_file()]
    for top in CODE_ROOTS:
        for path in sorted((ROOT / top).rglob("*")):
            skipped = {"__pycache__", "mutants", "node_modules"} & set(path.parts)
            if path.is_file() and not skipped and path.suffix not in BINARY_SUFFIXES:
                files.append(path)
    return [p for p in files if p.resolve() != Path(__file__).resolve()]


@pytest.mark.parametrize(
    "text",
    [
        "-- What refused a denial (issue 13): null on older rows.",
        '"""Must-show 5 of issue 9: the official SDK retrying"""',
        "# issue #15: the long fuzz pass",
        "    # measured in session 5, x1.4",
        '"""One durable row per attempt (SPEC §7)."""',
        "(the shape of SPEC Appendix A)",
        "the default before issue 8, with litellm beside it",
        "both FULL (the pre-issue-8 default)",
        "# see ../shared/SPEC.md",
    ],
)
def test_the_code_check_finds_each_kind_of_citation(text: str) -> None:
    assert code_citations(text), text


@pytest.mark.parametrize(
    "text",
    [
        "# litellm issue 1234: a stream without usage",
        "# see HELM issue #476 for the same count",
        "# aio-libs/aiohttp issue 5678 (fixed in 3.9)",
        "# CPython's issue 98765 made this slower",
        'assert hold.hold_id.endswith("#1")',
        "session = aiohttp.ClientSession()  # one per test session",
        "a shared HTTP transport, the shared 2-core machine",
        "x-stainless-retry-count of the try that made the row",
    ],
)
def test_the_code_check_leaves_code_and_other_projects_alone(text: str) -> None:
    assert code_citations(text) == []


def test_the_code_check_reads_every_part_of_the_code() -> None:
    scanned = {p.relative_to(ROOT).parts[0] for p in code_files()}
    assert scanned >= {"src", "tests", "bench", "scripts", "Makefile", "pyproject.toml"}


def test_code_cites_no_issue_session_or_outside_spec() -> None:
    """Say the rule or the reason itself; point at README.md or docs/ where it is stated."""
    hits: list[str] = []
    for path in code_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # not a text file
        hits += [f"{path.relative_to(ROOT)}: {hit}" for hit in code_citations(text)]
    assert hits == []
