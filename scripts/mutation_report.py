"""Summarise the last ``mutmut run`` into docs/mutation.md (between its markers).

Reads mutmut's own result files (``mutants/**/*.py.meta``: the exit code of the test
run per mutant) and, for every surviving mutant, its diff (``mutmut show``). What a
survivor means (a missing test, or an equivalent mutant) is written by hand above the
markers; this script only refreshes the numbers and the list.

    python scripts/mutation_report.py [--check]   # --check: exit 1 below the target
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
TARGET = 0.90
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


def _status(code: int | None) -> str:
    if code in KILLED:
        return "killed"
    if code in TIMEOUT:
        return "timeout"  # the mutant made the tests hang: counted as killed
    if code == 0:
        return "survived"
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


def render(by_file: dict[str, dict[str, int | None]]) -> tuple[str, float]:
    rows, survivors, total = [], [], Counter[str]()
    for source, codes in by_file.items():
        counts = Counter(_status(c) for c in codes.values())
        total.update(counts)
        done = counts["killed"] + counts["timeout"] + counts["survived"]
        score = (counts["killed"] + counts["timeout"]) / done if done else 1.0
        rows.append(
            f"| `{source}` | {len(codes)} | {counts['killed'] + counts['timeout']} "
            f"| {counts['survived']} | {score:.1%} |"
        )
        survivors += [name for name, code in codes.items() if _status(code) == "survived"]
    done = total["killed"] + total["timeout"] + total["survived"]
    score = (total["killed"] + total["timeout"]) / done if done else 1.0
    out = [
        BEGIN,
        "",
        f"**Score: {score:.1%}** ({total['killed'] + total['timeout']} killed of {done} "
        f"checked; {total['survived']} survived; {total['not checked']} not checked).",
        "",
        "| file | mutants | killed | survived | score |",
        "| --- | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        "Surviving mutants (diffs from `mutmut show`):",
        "",
    ]
    for name in survivors:
        out += [f"- `{name}`", "", "  ```diff", *[f"  {ln}" for ln in _diff(name).splitlines()],
                "  ```"]  # fmt: skip
    out += ["", END]
    return "\n".join(out), score


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help=f"fail below {TARGET:.0%}")
    args = parser.parse_args()
    by_file = _results()
    if not by_file:
        print("no mutmut results under mutants/: run `make mutation` first", file=sys.stderr)
        return 1
    block, score = render(by_file)
    text = DOC.read_text() if DOC.exists() else f"# Mutation testing\n\n{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOC.write_text(head + block + tail)
    print(f"mutation score {score:.1%}; written to {DOC.relative_to(ROOT)}")
    return 1 if args.check and score < TARGET else 0


if __name__ == "__main__":
    raise SystemExit(main())
