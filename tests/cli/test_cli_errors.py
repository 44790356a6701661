"""A user's mistake anywhere in the CLI is a message and an exit status, never
a traceback; ``--since``/``--until`` take words, durations and dates."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
import typer

from ncap.cli.when import parse_when

NCAP = [sys.executable, "-m", "ncap.cli.main"]

GOOD = "stores: {ledger: 'sqlite:///l.db', budgets: 'sqlite:///b.db'}\n"
BAD_INVOCATIONS = [
    (["ledger", "export", "--since", "yesterdayy"], "not a point in time"),
    (["ledger", "export", "--since", "2026-13-01"], "not a point in time"),
    (["ledger", "export", "--since", "today", "--until", "yesterday"], "later than --since"),
    (["ledger", "export", "--format", "xml"], "use jsonl, csv or focus"),
    (["reconcile", "list", "--format", "html"], "use table, tsv or json"),
    (["reconcile", "import", "missing.csv"], "cannot read"),
    (["check-config", "missing.yaml"], "cannot read"),
    (["check-config", "broken.yaml"], "not valid YAML"),
    (["check-config", "mysql.yaml"], "stores.ledger: unsupported store URL scheme 'mysql'"),
    (["check-config", "pg-budgets.yaml"], "stores.budgets: postgresql:// is not a budgets store"),
    (["keys", "create", "--workload", "ghost"], "unknown workload 'ghost'"),
    (["keys", "revoke", "nobody", "--config", "ncap.yaml"], "no key labelled 'nobody'"),
    (["serve", "--port", "eighty"], "Invalid value for '--port'"),
    (["fake-upstream", "--profile", "gremlins"], "unknown fake fault profile"),
    (["ledger", "export", "--config", "pg.yaml"], "PostgreSQL"),
    (["ledger", "export", "--config", "unwritable.yaml"], "cannot create"),
    (["no-such-command"], "No such command"),
    (["serve", "--port", "84643"], "less than or equal to 65535"),
    (["ledger", "generate", "--rows", "10", "--out", "/nonexistent/dir/x.db"], "no such directory"),
    (["audit", "--since", "1000000d"], "too far back"),
    (["report", "daily", "--date", "0001-01-01"], "too far back"),
]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "ncap.yaml").write_text(GOOD)
    (tmp_path / "broken.yaml").write_text("server: [unclosed\n")
    (tmp_path / "pg.yaml").write_text("stores: {ledger: 'postgresql://u@h/db'}\n")
    # the password must not be printed back
    (tmp_path / "mysql.yaml").write_text("stores: {ledger: 'mysql://u:hunter2@h/db'}\n")
    (tmp_path / "pg-budgets.yaml").write_text("stores: {budgets: 'postgresql://u@h/db'}\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "unwritable.yaml").write_text(f"stores: {{ledger: 'sqlite:///{blocker}/x/l.db'}}\n")
    return tmp_path


@pytest.mark.parametrize(("args", "message"), BAD_INVOCATIONS, ids=lambda v: str(v)[:40])
def test_bad_invocations_exit_2_without_a_traceback(
    folder: Path, args: list[str], message: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NCAP_DEBUG"}
    done = subprocess.run(
        [*NCAP, *args], cwd=folder, capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout
    assert message in " ".join(done.stderr.split()), done.stderr
    assert "hunter2" not in done.stderr + done.stdout
    assert "listening" not in done.stderr


def test_serve_on_a_busy_port_fails_without_saying_it_listens(folder: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [*NCAP, "serve", "--port", str(port)],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "listening" not in done.stderr
    assert "address already in use" in " ".join(done.stderr.lower().split())
    assert "Traceback" not in done.stderr


def test_since_and_until_words_durations_and_dates(folder: Path) -> None:
    for since in ("yesterday", "today", "7d", "2026-12-01", "2026-12-01T08:30:00Z"):
        done = subprocess.run(
            [*NCAP, "ledger", "export", "--since", since, "--until", "now", "--format", "csv"],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("timestamp,request_id,")


def test_parse_when() -> None:
    now = datetime(2026, 12, 1, 10, 30, tzinfo=UTC)
    assert parse_when("yesterday", now, "--since") == datetime(2026, 11, 30, tzinfo=UTC)
    assert parse_when("Today", now, "--since") == datetime(2026, 12, 1, tzinfo=UTC)
    assert parse_when("7d", now, "--since") == datetime(2026, 11, 24, 10, 30, tzinfo=UTC)
    assert parse_when("2026-11-15", now, "--since") == datetime(2026, 11, 15, tzinfo=UTC)
    assert parse_when("2026-11-15T01:02:03", now, "--since") == datetime(
        2026, 11, 15, 1, 2, 3, tzinfo=UTC
    )
    with pytest.raises(typer.BadParameter):
        parse_when("last tuesday", now, "--since")


def test_help_texts_are_for_users() -> None:
    from typer.testing import CliRunner

    from ncap.cli.main import app

    top = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert top.exit_code == 0
    assert "typer + rich" not in top.stdout and "``" not in top.stdout
    assert "OpenAI-compatible Chat Completions gateway" in top.stdout
    fake = CliRunner().invoke(app, ["fake-upstream", "--help"], env={"COLUMNS": "200"})
    text = " ".join(fake.stdout.split())
    for profile in ("error_500", "missing_usage", "rate_limit", "reset_mid_stream", "timeout"):
        assert profile in text, profile
