"""The long fuzz pass: the protocol fuzz tests at ``--scale`` times the CI case counts.

Runs ``tests/hardening/test_fuzz.py`` with ``NCAP_FUZZ_SCALE`` set, shows its output as
it goes, and saves the result (pass or fail, the wall time, the cases per operation the
last test prints) as the ``fuzz`` result envelope for BENCHMARKS.md.

    .venv/bin/python bench/fuzz_pass.py [--scale 10]
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import time

import benchlib as bl

CASES = re.compile(r"^fuzz cases: (\d+) (\{.*\})$", re.MULTILINE)
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", re.MULTILINE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=10.0)
    args = p.parse_args(argv)
    argv_test = [sys.executable, "-m", "pytest", "tests/hardening/test_fuzz.py", "-q", "-s"]
    argv_test += ["-p", "no:cacheprovider"]
    env = dict(os.environ, NCAP_FUZZ_SCALE=str(args.scale))
    began = time.monotonic()
    output, code = run_echoed(argv_test, env)
    table = result_table(output, code, round(time.monotonic() - began, 1), args.scale)
    bl.save_result("fuzz", [table], raw={"exit": code, "output_tail": output[-4000:]})
    return code


def run_echoed(argv: list[str], env: dict[str, str]) -> tuple[str, int]:
    """Run ``argv``, echoing its output as it comes (the pass takes minutes); the output."""
    lines = []
    with subprocess.Popen(
        argv, cwd=bl.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
    return "".join(lines), proc.returncode


def result_table(output: str, code: int, wall_s: float, scale: float) -> bl.Table:
    """Cases per operation from the line the last fuzz test prints, and pytest's verdict."""
    cases = CASES.search(output)
    summary = SUMMARY.findall(output)
    counts: dict[str, int] = ast.literal_eval(cases.group(2)) if cases else {}
    notes = (
        f"pytest: {summary[-1] if summary else 'no summary'} (exit {code}); "
        f"{cases.group(1) if cases else 'unknown'} cases in all, {wall_s} s."
    )
    title = f"Cases per operation at {scale:g}× the CI counts"
    rows = [[k, v] for k, v in counts.items()]
    return bl.Table(title, ["operation", "cases"], rows, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
