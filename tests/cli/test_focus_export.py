"""``ncap ledger export --format focus``: FOCUS rows of a generated ledger pass the
FinOps Foundation's ``focus-validator`` and their BilledCost adds up to ``ncap audit``'s
spend to the micro-dollar; unknown usage is never priced at zero."""

from __future__ import annotations

import csv
import io
import json
import subprocess
from collections import Counter
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from xml.etree import ElementTree

import pytest
from typer.testing import CliRunner

from ncap.cli.focus import FOCUS_COLUMNS, _split
from ncap.cli.main import app
from tests.tools import REPO, require_tool

runner = CliRunner()

# The validator's FOCUS 1.0 rule set (focus-validator 1.0.0, the release on PyPI)
# still uses the pre-1.0 names of four columns and, in one rule, the pre-1.0
# ``ChargeType`` for what FOCUS 1.0 renamed ``ChargeCategory``. The file it checks is
# the export with those columns given the names its rules look for (a copy; nothing
# else changes), so every rule runs against ncap's values.
_VALIDATOR_NAMES = {
    "ProviderName": "Provider",
    "PublisherName": "Publisher",
    "InvoiceIssuerName": "InvoiceIssuer",
    "ResourceId": "ResourceID",
}


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("focus")
    out, cfg = tmp / "gen.db", tmp / "gen.yaml"
    result = runner.invoke(
        app,
        [
            "ledger",
            "generate",
            "--rows",
            "3000",
            "--days",
            "3",
            "--out",
            str(out),
            "--write-config",
            str(cfg),
        ],
    )
    assert result.exit_code == 0, result.output
    return out, cfg


def _export(cfg: Path, *extra: str) -> tuple[list[dict[str, str]], str, str]:
    result = runner.invoke(app, ["ledger", "export", "--format", "focus", "-c", str(cfg), *extra])
    assert result.exit_code == 0, result.output
    text = result.stdout
    return list(csv.DictReader(io.StringIO(text))), text, result.stderr


def test_billed_cost_equals_the_audit_spend_to_the_micro_dollar(
    generated: tuple[Path, Path],
) -> None:
    _, cfg = generated
    rows, _, stderr = _export(cfg)
    audit = runner.invoke(app, ["audit", "--since", "7d", "--format", "json", "-c", str(cfg)])
    assert audit.exit_code == 0, audit.output
    report = json.loads(audit.stdout)
    spend = sum(r["cost_micros"] for r in report["spend_by_workload"])
    held = sum(r["held_micros"] for r in report["spend_by_workload"])
    billed = sum(Decimal(r["BilledCost"]) for r in rows)
    assert spend > 0 and billed == Decimal(spend) / 1_000_000
    # per workload too, and every cost column agrees (one list price, no discounts)
    by_workload = Counter[str]()
    for r in rows:
        by_workload[r["SubAccountId"]] += int(r["x_ncap_CostMicros"])
        assert r["BilledCost"] == r["EffectiveCost"] == r["ListCost"] == r["ContractedCost"]
    assert dict(by_workload) == {
        r["key"]: r["cost_micros"] for r in report["spend_by_workload"] if r["cost_micros"]
    } | {k: 0 for k, v in by_workload.items() if v == 0}
    # what is held for unknown usage is not in the export, and the command says so
    assert held > 0 and "not known yet" in stderr
    assert {r["x_ncap_ReconciliationState"] for r in rows} <= {"settled", "reconciled"}


def test_one_row_per_attempt_and_charge(generated: tuple[Path, Path]) -> None:
    _, cfg = generated
    rows, _, _ = _export(cfg)
    assert list(rows[0]) == list(FOCUS_COLUMNS)
    charges = Counter(r["x_ncap_Charge"] for r in rows)
    assert charges["input"] == charges["output"] > 0 and charges["cached_input"] >= 0
    keys = [(r["x_ncap_RequestId"], r["x_ncap_Attempt"], r["x_ncap_Charge"]) for r in rows]
    assert len(keys) == len(set(keys))
    for r in rows:
        assert r["ChargeCategory"] == "Usage" and r["BillingCurrency"] == "USD"
        assert r["ConsumedUnit"] == "Tokens" and r["PricingUnit"] == "1M Tokens"
        assert Decimal(r["PricingQuantity"]) * 1_000_000 == Decimal(r["ConsumedQuantity"])
        assert r["x_ncap_PolicyResult"] == "allow"  # denials generated nothing
        tags = json.loads(r["Tags"])
        assert tags["ncap:workload"] == r["x_ncap_Workload"] == r["SubAccountId"]
        assert r["ChargePeriodStart"] < r["ChargePeriodEnd"]


def test_pending_usage_is_flagged_never_priced_at_zero(generated: tuple[Path, Path]) -> None:
    _, cfg = generated
    priced, _, _ = _export(cfg)
    rows, _, stderr = _export(cfg, "--include-pending")
    pending = [r for r in rows if r["x_ncap_ReconciliationState"] not in ("settled", "reconciled")]
    assert pending and "not known yet" not in stderr
    for r in pending:
        assert r["BilledCost"] == r["EffectiveCost"] == r["ListCost"] == ""
        assert r["x_ncap_CostMicros"] == "" and r["x_ncap_Charge"] == "usage"
        assert r["x_ncap_ReconciliationState"] in ("pending", "usage_reconciliation_required")
    assert len(rows) == len(priced) + len(pending)


def test_focus_validator_passes_the_export(generated: tuple[Path, Path], tmp_path: Path) -> None:
    tool = require_tool("focus-validator", REPO / ".venv-focus/bin/focus-validator")
    _, cfg = generated
    _, text, _ = _export(cfg)
    reader = csv.DictReader(io.StringIO(text))
    checked = tmp_path / "focus.csv"
    with checked.open("w", newline="") as f:
        names = [_VALIDATOR_NAMES.get(c, c) for c in reader.fieldnames or []] + ["ChargeType"]
        writer = csv.writer(f)
        writer.writerow(names)
        for row in reader:
            writer.writerow([*row.values(), row["ChargeCategory"]])
    tests, failed = _validate(tool, checked, tmp_path / "report.xml")
    assert tests >= 130 and failed == [], failed  # every rule of its FOCUS 1.0 set ran
    # the validator does fail a file that breaks FOCUS: a null BilledCost
    broken = tmp_path / "broken.csv"
    lines = checked.read_text().splitlines()
    header = lines[0].split(",")
    cells = next(csv.reader([lines[1]]))
    cells[header.index("BilledCost")] = ""
    out = io.StringIO()
    csv.writer(out).writerows([header, cells])
    broken.write_text(out.getvalue())
    _, failed = _validate(tool, broken, tmp_path / "broken.xml")
    assert "BilledCost_NotNull :: AllowNullsCheck" in failed, failed


def _validate(tool: Path, data: Path, report: Path) -> tuple[int, list[str]]:
    """Run focus-validator on ``data`` against FOCUS 1.0 (the newest version it
    validates); the number of checks it ran and the names of those that failed."""
    # it reads its currency list relative to the working directory: its package's parent
    site = subprocess.run(
        [str(tool.parent / "python"), "-c", "import focus_validator, os; "
         "print(os.path.dirname(os.path.dirname(focus_validator.__file__)))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    subprocess.run(
        [
            *(str(tool), "--data-file", str(data), "--validate-version", "1.0"),
            *("--output-type", "unittest", "--output-destination", str(report)),
        ],
        capture_output=True,
        text=True,
        cwd=site,
        timeout=300,
    )
    suites = ElementTree.parse(report).getroot()
    failed = [
        case.get("name", "")
        for case in suites.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return int(suites.get("tests", "0")), failed


def test_cost_split_is_exact() -> None:
    assert _split(10, [1.0, 1.0, 1.0]) == [4, 3, 3]
    assert sum(_split(1_234_567, [0.15 * 900, 0.075 * 100, 0.6 * 400])) == 1_234_567
    assert _split(7, [0.0, 0.0]) == [0, 7]


def test_window_flags(generated: tuple[Path, Path]) -> None:
    _, cfg = generated
    since = (datetime.now(UTC) - timedelta(days=1)).strftime("%Y-%m-%d")
    rows, _, _ = _export(cfg, "--since", since)
    assert rows and all(r["ChargePeriodStart"] >= since for r in rows)
    bad = runner.invoke(app, ["ledger", "export", "--format", "csv", "--include-pending"])
    assert bad.exit_code == 2
