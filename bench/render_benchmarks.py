"""Write BENCHMARKS.md from the last run of every benchmark (``bench/results/*.json``).

Each benchmark behind ``make bench`` leaves one result envelope (``benchlib.save_result``):
the machine, the date, the commit, the load average at start and end, the command line
and its tables. This script renders them in a fixed order, one section per benchmark,
so the page always shows the current numbers and nothing else; a benchmark without a
result says so and names the ``make`` target that makes one. Older runs stay as JSON in
``bench/results/history/``. The output depends only on the envelopes (no clock), so a
test can check that the committed page is what the committed results render to.

    .venv/bin/python bench/render_benchmarks.py [--results DIR] [--output FILE] [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
OUTPUT = ROOT / "BENCHMARKS.md"


@dataclass(frozen=True)
class Section:
    name: str  # the envelope's name: bench/results/<name>.json
    title: str
    target: str  # the make target that runs it ("" when no target does)
    what: str


SECTIONS = [
    Section(
        "gateway",
        "Gateway: throughput and CPU per request",
        "bench-gateway",
        "Non-streamed requests at several concurrencies through every target in one run.",
    ),
    Section(
        "stream",
        "Streamed answers: CPU per relayed chunk and time to first byte",
        "bench-stream",
        "Streams of n=1 and n=4 candidates through every target in one run.",
    ),
    Section(
        "stream-profile",
        "Streaming relay: CPU per chunk by cause",
        "bench-stream-profile",
        "The relay with one concern switched off at a time, and cProfile tops: the shipped"
        " relay's and, measured in the same run (`--before-src`), the relay's before it"
        " worked per upstream read.",
    ),
    Section(
        "stream-instructions",
        "Streaming relay: instructions per chunk",
        "bench-stream-instructions",
        "The same cases counted under callgrind, which a busy machine does not move.",
    ),
    Section(
        "instructions",
        "Instructions per request",
        "bench-instructions",
        "User-space instructions per non-streamed request under callgrind.",
    ),
    Section(
        "request-levers",
        "Instructions per request by cause",
        "bench-request-levers",
        "The same count with one concern of the request path switched off at a time: what"
        " each costs.",
    ),
    Section(
        "ledger",
        "Ledger under load",
        "bench-ledger",
        "Many concurrent requests on the default stores, then the books checked.",
    ),
    Section(
        "rss",
        "Memory after many requests",
        "bench-rss",
        "Resident memory after a small and a large number of requests, per store set-up.",
    ),
    Section(
        "profile",
        "Where a request's CPU goes",
        "bench-profile",
        "cProfile of `ncap serve` under load, top functions by own time.",
    ),
    Section(
        "stack",
        "Choosing the HTTP stack",
        "bench-stack",
        "Server and client libraries compared as a pass-through, and request validation.",
    ),
    Section(
        "engine",
        "Local engine",
        "bench-engine",
        "The embedded llama.cpp engine: n=1 against n=8, sequential requests, the cache.",
    ),
    Section(
        "engine-tools",
        "Local engine: tool calls",
        "bench-engine-tools",
        "Seeded forced and automatic tool-call requests, every choice checked.",
    ),
    Section(
        "engine-timeouts",
        "Local engine under CPU contention",
        "bench-engine-timeouts",
        "Requests through the embedded default with CPU burners running, then a timeout.",
    ),
    Section(
        "export",
        "FinOps commands on a large ledger",
        "bench-export",
        "`ncap ledger export` (CSV, JSONL) and `ncap audit`, each timed as its own process.",
    ),
    Section(
        "telemetry",
        "OpenTelemetry's cost per request",
        "bench-telemetry",
        "Instructions per request with tracing off and with OTLP export on.",
    ),
    Section(
        "evidence",
        "Candidate evidence: the relay path",
        "bench-evidence",
        "CPU per streamed chunk with the candidate evidence on and off, the relay alone.",
    ),
    Section(
        "evidence-e2e",
        "Candidate evidence: two whole gateways",
        "bench-evidence",
        "The same, through two gateways in one run (the ratio of the medians).",
    ),
    Section(
        "fuzz",
        "Long fuzz pass",
        "fuzz",
        "The protocol fuzz tests at ten times the CI case counts.",
    ),
    Section(
        "soak-embedded",
        "Soak on the embedded stores",
        "soak",
        "Load, upstream faults and client disconnects, then the books (not in `make bench`).",
    ),
    Section(
        "soak-pg-redis",
        "Soak on PostgreSQL and Redis",
        "soak SOAK_STORES=pg-redis",
        "The same on the shared stores (not in `make bench`).",
    ),
]

INTRO = """\
# Benchmarks

This page is generated: `make bench` runs every benchmark and then
`bench/render_benchmarks.py`, which renders the last run of each from its result in
`bench/results/<name>.json` (`make bench-report` renders without running anything). Do
not edit it by hand; older runs are kept as JSON in `bench/results/history/`.

## Method

- **Ratios in one run.** The machine is shared, so absolute figures move from run to
  run. Each gateway benchmark runs, in the same run and against the same fake upstream,
  a bare aiohttp pass-through (the floor: what relaying costs with no gateway logic),
  ncap in its store set-ups, and LiteLLM and Portkey as peers; the ratios between them
  are what to compare across runs.
- **CPU from the processes' own counters.** CPU time is read from `/proc` for each
  server's whole process tree (user + system), not inferred from wall time; the share of
  the machine taken by other processes meanwhile is reported as the run's noise.
- **Instructions for levers.** Whether a change to the hot path helps is judged by
  user-space instructions per request (or per relayed chunk) counted under callgrind,
  which a busy machine does not move.
- **Every section says where it ran**: the machine, the date, the commit, the 1-minute
  load average at the start and end of the run (or the machine's state as it was noted
  at the time, for runs made before results carried it), and the command of each table.

The targets, the CPU layout and the peers' set-up are in
[Benchmark method and targets](docs/decisions/benchmark-method.md); how this page is
made, in [the benchmarks page is generated](docs/decisions/benchmarks-page-generated.md).
"""


def load(results: Path) -> dict[str, dict[str, Any]]:
    """The envelopes in ``results`` (the newest run of each benchmark), by name."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(results.glob("*.json")):
        doc = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(doc, dict) and "envelope" in doc and "tables" in doc:
            found[str(doc["benchmark"])] = doc
    return found


def cell(value: Any) -> str:
    """One table cell: numbers as recorded, no value as a dash, no pipes or newlines."""
    if value is None or value == "":
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    text = f"{value:,}" if isinstance(value, int) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def md_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def load_text(load: Mapping[str, Any]) -> str:
    """The 1-minute load average at start and end, and what was noted about the machine."""
    start, end, note = load.get("start"), load.get("end"), load.get("note") or ""
    parts = []
    measured = [f"{x[0]:.2f} at {when}" for x, when in ((start, "start"), (end, "end")) if x]
    if measured:
        parts.append(", ".join(measured))
    if note:
        parts.append(note)
    return "; ".join(parts) or "not recorded"


def machine_text(machine: Mapping[str, Any]) -> str:
    parts = []
    if machine.get("cpu"):
        parts.append(str(machine["cpu"]))
    if machine.get("cores"):
        parts.append(f"{machine['cores']} cores")
    if machine.get("memory_gib"):
        parts.append(f"{machine['memory_gib']} GiB")
    if machine.get("python"):
        parts.append(f"Python {machine['python']}")
    if machine.get("os"):
        parts.append(str(machine["os"]))
    return ", ".join(parts) or "not recorded"


def date_text(doc: Mapping[str, Any]) -> str:
    start = str(doc.get("date", "")).replace("T", " ").replace("Z", " UTC")
    end = str(doc.get("finished") or "").replace("T", " ").replace("Z", " UTC")
    if end and end[:10] == start[:10]:
        end = end[11:]
    return f"{start} – {end}" if end and end != start else start


def render_table(table: Mapping[str, Any], run_command: str) -> str:
    parts = [f"### {table['title']}"]
    parts.append(f"Command: `{table.get('command') or run_command}`")
    parts.append(md_table(table["columns"], table["rows"]))
    if table.get("notes"):
        parts.append(str(table["notes"]))
    return "\n\n".join(parts)


def render_section(section: Section, doc: Mapping[str, Any] | None) -> str:
    head = f"## {section.title}\n\n{section.what}"
    if doc is None:
        return f"{head}\n\nNo result yet: run `make {section.target}`."
    target = f" (`make {section.target}`)" if section.target else ""
    facts = [
        f"- Run: {date_text(doc)}, commit `{doc.get('commit', 'unknown')}`{target}",
        f"- Machine: {machine_text(doc.get('machine', {}))}",
        f"- Load: {load_text(doc.get('load', {}))}",
        f"- Command: `{doc['command']}`",
    ]
    parts = [head, "\n".join(facts)]
    if doc.get("notes"):
        parts.append(str(doc["notes"]))
    parts += [render_table(t, str(doc["command"])) for t in doc["tables"]]
    return "\n\n".join(parts)


def render(envelopes: Mapping[str, Mapping[str, Any]]) -> str:
    """The whole page: the method, then every known benchmark in a fixed order, then any
    result this script has no section for (so nothing measured is left off)."""
    known = {s.name for s in SECTIONS}
    extra = [
        Section(name, name, "", "A result with no section of its own on this page yet.")
        for name in sorted(envelopes)
        if name not in known
    ]
    sections = [*SECTIONS, *extra]
    contents = "\n".join(f"- [{s.title}](#{anchor(s.title)})" for s in sections)
    body = [render_section(s, envelopes.get(s.name)) for s in sections]
    return "\n\n".join([INTRO.rstrip(), "## Contents\n\n" + contents, *body]) + "\n"


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--output", type=Path, default=OUTPUT)
    p.add_argument("--check", action="store_true", help="fail if the page is not current")
    args = p.parse_args(argv)
    page = render(load(args.results))
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != page:
            print(f"{args.output} is not what the results render to", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(page, encoding="utf-8")
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
