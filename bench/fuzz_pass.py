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
    done = subprocess.run(argv_test, cwd=bl.ROOT, env=env, capture_output=True, text=True)
    wall = round(time.monotonic() - began, 1)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    cases = CASES.search(done.stdout)
    summary = SUMMARY.findall(done.stdout)
    counts: dict[str, int] = ast.literal_eval(cases.group(2)) if cases else {}
    rows = [[operation, count] for operation, count in counts.items()]
    notes = (
        f"pytest: {summary[-1] if summary else 'no summary'} (exit {done.returncode}); "
        f"{cases.group(1) if cases else 'unknown'} cases in all, {wall} s."
    )
    title = f"Cases per operation at {args.scale:g}× the CI counts"
    table = bl.Table(title, ["operation", "cases"], rows, notes=notes)
    bl.save_result("fuzz", [table], raw={"exit": done.returncode, "wall_s": wall, "cases": counts})
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
