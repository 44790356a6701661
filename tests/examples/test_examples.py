"""The scripts in ``examples/`` run as a user would run them (a subprocess, this Python)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_finops_walkthrough(tmp_path: Path) -> None:
    done = _run(
        "finops_walkthrough.py", "--rows", "3000", "--dir", str(tmp_path / "d"), cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout
    assert "$ ncap ledger generate" in out and "$ ncap audit --since 7d" in out
    assert "1 distribution-shift alert(s)" in out
    assert "chart bars" in out and "/dashboard" in out
    assert (tmp_path / "d" / "ledger.db").exists()


@pytest.mark.engine
def test_self_consistency_vote_n5(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    done = _run("self_consistency.py", "-n", "5", "--max-tokens", "8", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith("candidate ") for line in lines) == 5
    majority = next(line for line in lines if line.startswith("majority:"))
    assert "/5 votes" in majority
    assert "over 5 candidates" in done.stdout
