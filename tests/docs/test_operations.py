"""docs/operations.md's fresh-folder walk-through, run as written.

The code blocks between ``<!-- walkthrough:start -->`` and ``<!-- walkthrough:end -->``
become one bash script, in order: ``sh`` blocks verbatim, ``python`` blocks through
``python -``. The only change is the two ports (8080, 9100), replaced by free ones so
that the test can run beside anything else on the machine. ``ncap`` is this checkout's
CLI (``python -m ncap.cli.main``), ``python`` the test's interpreter.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from ncap.stores import SQLiteLedgerStore

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operations.md"
BLOCK = re.compile(r"^```(sh|python)\n(.*?)^```$", re.S | re.M)


def walkthrough_script(text: str, ports: dict[str, str]) -> str:
    start = text.index("<!-- walkthrough:start -->")
    end = text.index("<!-- walkthrough:end -->")
    # a failing step must not leave the background servers holding the output open
    parts = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    for lang, code in BLOCK.findall(text[start:end]):
        if lang == "sh":
            parts.append(code)
        else:
            parts.append(f"python - <<'PYTHON'\n{code}PYTHON\n")
    script = "\n".join(parts)
    for old, new in ports.items():
        script = script.replace(old, new)
    return script


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _bin(tmp: Path) -> Path:
    """``ncap`` and ``python`` on PATH, both this interpreter on this checkout."""
    bindir = tmp / "bin"
    bindir.mkdir()
    (bindir / "ncap").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ncap.cli.main "$@"\n')
    (bindir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for f in bindir.iterdir():
        f.chmod(0o755)
    return bindir


def test_the_walkthrough_runs_as_written(tmp_path: Path) -> None:
    script = walkthrough_script(DOC.read_text(), {"8080": _free_port(), "9100": _free_port()})
    assert script.count("ncap ") >= 10  # the blocks were found
    folder = tmp_path / "fresh"
    folder.mkdir()
    env = {
        **os.environ,
        "PATH": f"{_bin(tmp_path)}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT / "src"),
    }
    # The script's Python blocks and the background `ncap serve` (its access lines)
    # share one stdout pipe. Unbuffered (PYTHONUNBUFFERED=1 on these machines), a
    # block's print() is several writes, and an access line written between two of
    # them split "choices: 3" (2 runs in 4 under load). Buffered, each block's output
    # is one write at its exit, and each access line is whole.
    env.pop("PYTHONUNBUFFERED", None)
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=240)
    finally:  # the background servers, whatever happened to the script
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "Traceback" not in err
    assert "choices: 3" in out
    assert "refused: candidate_count_exceeds_policy" in out
    assert "usage: None" in out
    assert "ncap_pending_reconciliation 0.0" in out
    keys = (folder / "ncap.yaml").read_text()
    assert "# ncap.yaml: two workloads on one provider" in keys and "label: eval-notebook" in keys

    sheet = list(csv.DictReader((folder / "ledger.csv").open()))
    assert sorted(r["state"] for r in sheet) == [
        "denied",
        "settled",
        "usage_reconciliation_required",
    ]
    assert {r["environment"] for r in sheet} == {"production", "staging"}

    async def final_states() -> list[str]:
        store = SQLiteLedgerStore(folder / ".ncap" / "ledger.db")
        try:
            return sorted([e.state async for e in store.export()])
        finally:
            await store.close()

    assert asyncio.run(final_states()) == ["denied", "reconciled", "settled"]
