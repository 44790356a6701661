"""The benchmarks page is rendered from the result envelopes, and cannot drift from them.

``bench/benchlib.py`` writes one envelope per benchmark run (``save_result``), moving the
previous run to ``bench/results/history/``; ``bench/render_benchmarks.py`` renders the
newest envelopes into BENCHMARKS.md. These tests render a few envelopes made here, check
the rotation, and check that the committed page is what the committed results render to.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import benchlib as bl  # noqa: E402
import render_benchmarks as rb  # noqa: E402

from tests.docs.test_docs_stand_alone import citations, relative_links  # noqa: E402


def _tables() -> list[bl.Table]:
    return [
        bl.Table("Throughput", ["target", "req/s"], [["bare", 4652.0], ["ncap", 1622.0]]),
        bl.Table(
            "Instructions",
            ["setup", "per request"],
            [["ncap", 1_813_000]],
            command="python bench/instructions.py --requests 2000",
            notes="Counted under callgrind.",
        ),
    ]


def _save(tmp: Path, name: str, **kw: Any) -> Path:
    return bl.save_result(name, _tables(), raw={"rows": 2}, results_dir=tmp, **kw)


def test_an_envelope_records_the_run_and_its_tables(tmp_path: Path) -> None:
    doc = json.loads(_save(tmp_path, "gateway", load_start=[0.5, 0.4, 0.3]).read_text())
    assert doc["benchmark"] == "gateway"
    assert doc["load"]["start"] == [0.5, 0.4, 0.3]
    assert len(doc["load"]["end"]) == 3
    assert doc["machine"]["cores"] and doc["machine"]["python"]
    assert doc["command"].startswith("python ")
    assert doc["commit"]
    assert [t["title"] for t in doc["tables"]] == ["Throughput", "Instructions"]
    assert doc["tables"][1]["rows"] == [["ncap", 1_813_000]]
    assert doc["raw"] == {"rows": 2}


def test_every_table_and_its_command_are_on_the_page(tmp_path: Path) -> None:
    _save(tmp_path, "gateway", command="python bench/gateway_bench.py --rounds 3")
    page = rb.render(rb.load(tmp_path))
    gateway = page.split("## Gateway", 1)[1].split("\n## ", 1)[0]
    for expected in (
        "### Throughput",
        "Command: `python bench/gateway_bench.py --rounds 3`",
        "| bare | 4652.0 |",
        "### Instructions",
        "Command: `python bench/instructions.py --requests 2000`",
        "| ncap | 1,813,000 |",
        "Counted under callgrind.",
        "`make bench-gateway`",
    ):
        assert expected in gateway, expected


def test_the_page_gives_machine_date_load_and_commit(tmp_path: Path) -> None:
    _save(tmp_path, "rss", load_start=[1.25, 1, 1], load_end=[2.5, 2, 2])
    doc = rb.load(tmp_path)["rss"]
    section = rb.render({"rss": doc}).split("## Memory after many requests", 1)[1]
    section = section.split("\n## ", 1)[0]
    assert f"{doc['machine']['cores']} cores" in section
    assert doc["date"][:10] in section
    assert "1.25 at start, 2.50 at end" in section
    assert f"commit `{doc['commit']}`" in section


def test_a_benchmark_without_a_result_names_its_make_target(tmp_path: Path) -> None:
    _save(tmp_path, "gateway")
    page = rb.render(rb.load(tmp_path))
    ledger = page.split("## Ledger under load", 1)[1].split("\n## ", 1)[0]
    assert "No result yet: run `make bench-ledger`." in ledger
    assert "No result yet" not in page.split("## Gateway", 1)[1].split("\n## ", 1)[0]


def test_sections_come_in_a_fixed_order_and_unknown_results_are_kept(tmp_path: Path) -> None:
    for name in ("stack", "gateway", "a-new-benchmark"):
        _save(tmp_path, name)
    page = rb.render(rb.load(tmp_path))
    positions = [page.index(f"## {s.title}\n") for s in rb.SECTIONS]
    assert positions == sorted(positions)
    assert page.index("## a-new-benchmark") > positions[-1]


def test_a_new_run_moves_the_previous_one_to_the_history(tmp_path: Path) -> None:
    first = json.loads(_save(tmp_path, "engine").read_text())
    _save(tmp_path, "engine")
    stamp = first["date"].replace("-", "").replace(":", "")
    kept = tmp_path / "history" / f"engine-{stamp}.json"
    assert json.loads(kept.read_text()) == first
    _save(tmp_path, "engine")  # same second: a second file, not an overwrite
    assert len(list((tmp_path / "history").glob("engine-*.json"))) == 2
    assert rb.load(tmp_path)["engine"]["benchmark"] == "engine"


def test_the_renderer_reads_only_the_newest_runs(tmp_path: Path) -> None:
    _save(tmp_path, "engine")
    _save(tmp_path, "engine")
    (tmp_path / "notes.json").write_text('{"not": "an envelope"}')
    assert list(rb.load(tmp_path)) == ["engine"]


@pytest.mark.parametrize(
    ("value", "shown"),
    [(None, "–"), (True, "yes"), (12345, "12,345"), (0.83, "0.83"), ("a|b", "a\\|b")],
)
def test_cells(value: object, shown: str) -> None:
    assert rb.cell(value) == shown


def test_the_committed_page_is_what_the_committed_results_render_to() -> None:
    assert rb.OUTPUT.read_text(encoding="utf-8") == rb.render(rb.load(rb.RESULTS)), (
        "BENCHMARKS.md differs from bench/results/*.json: run `make bench-report`"
    )


def test_the_committed_page_cites_nothing_outside_the_repository() -> None:
    assert citations(rb.OUTPUT.read_text(encoding="utf-8")) == []


def test_every_section_names_a_make_target_that_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    for section in rb.SECTIONS:
        target = section.target.split()[0]
        assert f"\n{target}:" in makefile, target


@pytest.mark.parametrize(
    ("load", "shown"),
    [
        ({"start": [0.75, 0.7, 0.6], "end": [1.5, 1, 1]}, "0.75 at start, 1.50 at end"),
        (
            {"start": None, "end": [2.58], "note": "noted at the end"},
            "2.58 at end; noted at the end",
        ),
        ({"note": "a crushed machine"}, "a crushed machine"),
        ({}, "not recorded"),
    ],
)
def test_load_says_what_was_measured_and_what_was_noted(load: dict[str, Any], shown: str) -> None:
    assert rb.load_text(load) == shown


def test_make_bench_runs_every_section_s_target_then_renders_the_page() -> None:
    makefile = (ROOT / "Makefile").read_text()
    benches = next(line for line in makefile.splitlines() if line.startswith("BENCHES ="))
    listed = set(benches.split("=", 1)[1].split())
    in_bench = {s.target for s in rb.SECTIONS if not s.target.startswith("soak")}
    assert in_bench <= listed, in_bench - listed
    recipe = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    assert recipe.index("$(BENCHES)") < recipe.index("bench-report")
    assert "render_benchmarks.py" in makefile.split("\nbench-report:", 1)[1].split("\n\n", 1)[0]


def test_rewritten_results_do_not_make_the_commit_dirty(tmp_path: Path) -> None:
    """A run of make bench rewrites bench/results/ and the page as it goes; the commit of
    the next benchmark is still the code's."""
    page = rb.OUTPUT.read_text(encoding="utf-8")
    before = bl.git_commit()
    try:
        rb.OUTPUT.write_text(page + "\nedited\n", encoding="utf-8")
        assert bl.git_commit() == before
    finally:
        rb.OUTPUT.write_text(page, encoding="utf-8")


def test_the_page_s_links_resolve() -> None:
    page = rb.render({})
    links = relative_links(page)
    assert links and all((ROOT / t).is_file() for t in links), links
