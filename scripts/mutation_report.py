"""Summarise the last ``mutmut run`` into docs/mutation.md (between its markers).

Reads mutmut's own result files (``mutants/**/*.py.meta``: the exit code of the test
run per mutant) and, for every surviving mutant, its diff (``mutmut show``). What a
survivor means (a missing test, or an equivalent mutant) is written by hand above the
markers; this script only refreshes the numbers and the list. A part's score is its
killed mutants over all its mutants: one no test reaches, or not checked yet, counts
as not killed.

    python scripts/mutation_report.py [--check] [--diffs]
    # --check: exit 1 when a part is below its target; --diffs: each survivor's diff
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "mutation.md"
BEGIN, END = "<!-- mutmut:begin -->", "<!-- mutmut:end -->"
# the score each part must reach (docs/mutation.md): the pure rules, and the accounting code
TARGETS = {"src/ncap/domain/": 0.90, "src/ncap/lifecycle/": 0.80, "src/ncap/stores/": 0.80}
# mutmut's exit-code meaning (mutmut/stats.py)
KILLED = {1, 3, -11, -9, 37}
TIMEOUT = {36, -24, 24, 152, 255}


def _results() -> dict[str, dict[str, int | None]]:
    by_file: dict[str, dict[str, int | None]] = {}
    for meta in sorted((ROOT / "mutants").rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        source = str(meta.relative_to(ROOT / "mutants")).removesuffix(".meta")
        by_file[source] = data.get("exit_code_by_key", {})
    return by_file


NO_TESTS = 33  # no selected test reaches the mutated function


def _status(code: int | None) -> str:
    if code in KILLED:
        return "killed"
    if code in TIMEOUT:
        return "timeout"  # the mutant made the tests hang: counted as killed
    if code == 0:
        return "survived"
    if code == NO_TESTS:
        return "no test"
    return "not checked" if code is None else "other"


def _diff(name: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "mutmut", "show", name],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    lines = [ln for ln in out.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    return "\n".join(lines)


def _score(counts: Counter[str]) -> tuple[float, int]:
    """Killed over the whole scope: a mutant no test reaches, one not checked yet and
    any other outcome count as not killed (the score cannot rise by checking less)."""
    total = sum(counts.values())
    checked = counts["killed"] + counts["timeout"] + counts["survived"] + counts["no test"]
    return ((counts["killed"] + counts["timeout"]) / total if total else 1.0), checked


def _group(names: list[str]) -> list[str]:
    """Survivors one line per function: ``module.function``: mutant numbers."""
    by_function: dict[str, list[str]] = {}
    for name in names:
        function, _, number = name.rpartition("__mutmut_")
        by_function.setdefault(function, []).append(number)
    return [f"- `{f}`: {', '.join(n)}" for f, n in by_function.items()]


def render(
    by_file: dict[str, dict[str, int | None]], *, diffs: bool = False
) -> tuple[str, dict[str, float]]:
    rows, survivors = [], []
    parts = {part: Counter[str]() for part in TARGETS}
    for source, codes in by_file.items():
        counts = Counter(_status(c) for c in codes.values())
        for part, total in parts.items():
            if source.startswith(part):
                total.update(counts)
        score, done = _score(counts)
        rows.append(
            f"| `{source}` | {len(codes)} | {counts['killed'] + counts['timeout']} "
            f"| {counts['survived']} | {counts['no test']} "
            f"| {counts['not checked'] + counts['other']} "
            f"| {f'{score:.1%}' if done else 'not run'} |"
        )
        survivors += [
            name for name, code in codes.items() if _status(code) in ("survived", "no test")
        ]
    scores: dict[str, float] = {}
    summary = []
    for part, total in parts.items():
        scores[part], done = _score(total)
        summary.append(
            f"- `{part}`: **{scores[part]:.1%}** (target {TARGETS[part]:.0%}): "
            f"{total['killed'] + total['timeout']} killed of {sum(total.values())} mutants "
            f"({done} checked: {total['survived']} survived, {total['no test']} reached by "
            f"no test; {total['not checked'] + total['other']} not checked)"
        )
    out = [
        BEGIN,
        "",
        *summary,
        "",
        "| file | mutants | killed | survived | no test | not checked | score |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        "Surviving mutants (and any no test reaches), by function "
        "(`mutmut show <module.function>__mutmut_<n>`):",
        "",
    ]
    if not diffs:
        out += _group(survivors)
    for name in survivors if diffs else []:
        out += [f"- `{name}`", "", "  ```diff", *[f"  {ln}" for ln in _diff(name).splitlines()],
                "  ```"]  # fmt: skip
    out += ["", END]
    return "\n".join(out), scores


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail below a part's target")
    parser.add_argument("--diffs", action="store_true", help="each survivor's diff")
    args = parser.parse_args()
    by_file = _results()
    if not by_file:
        print("no mutmut results under mutants/: run `make mutation` first", file=sys.stderr)
        return 1
    block, scores = render(by_file, diffs=args.diffs)
    text = DOC.read_text() if DOC.exists() else f"# Mutation testing\n\n{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOC.write_text(head + block + tail)
    for part, score in scores.items():
        print(f"mutation score {part}: {score:.1%} (target {TARGETS[part]:.0%})")
    print(f"written to {DOC.relative_to(ROOT)}")
    low = [part for part, score in scores.items() if score < TARGETS[part]]
    return 1 if args.check and low else 0


if __name__ == "__main__":
    raise SystemExit(main())
