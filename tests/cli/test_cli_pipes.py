"""The CLI into a pipe or a file: ``ncap audit`` writes every column whole (tab-separated,
as ``reconcile list`` does), a reader that closes the pipe early (``| head -1``) ends
the command quietly with status 0, and an import file without rows is flagged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ncap.testing.ledger_gen import LedgerSpec, generate_ledger, synthetic_config

NCAP = [sys.executable, "-m", "ncap.cli.main"]
ENV = {k: v for k, v in os.environ.items() if k != "NCAP_DEBUG"}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("pipes")
    spec = LedgerSpec(rows=3000, days=7, seed=8)
    generate_ledger(tmp / "l.db", spec)
    path = tmp / "ncap.yaml"
    path.write_text(yaml.safe_dump(synthetic_config(spec, tmp / "l.db")))
    return path


def test_audit_into_a_pipe_is_tab_separated_and_never_cut(config: Path) -> None:
    done = subprocess.run(
        [*NCAP, "audit", "--since", "7d", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV | {"COLUMNS": "80"},
    )
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout
    lines = done.stdout.splitlines()
    head = lines.index("# exceptions") + 1
    assert lines[head].split("\t")[:3] == ["id", "workload", "owner"]
    row = next(line.split("\t") for line in lines[head:] if line.startswith("eval-q4\t"))
    assert row[1] == "support-eval" and row[2] == "finops@example.com"
    assert len(row) == len(lines[head].split("\t"))


@pytest.mark.parametrize(
    "args", [["ledger", "export"], ["reconcile", "list"], ["audit", "--since", "7d"]]
)
def test_a_reader_that_leaves_early_ends_the_command_quietly(config: Path, args: list[str]) -> None:
    proc = subprocess.Popen(
        [*NCAP, *args, "-c", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first write: EPIPE for certain
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Broken pipe" not in err and "Traceback" not in err and "error" not in err


def test_an_import_file_without_rows_is_flagged(config: Path, tmp_path: Path) -> None:
    empty = tmp_path / "usage.jsonl"
    empty.write_text("")
    done = subprocess.run(
        [*NCAP, "reconcile", "import", str(empty), "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "no rows" in done.stderr
