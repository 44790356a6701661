"""Pin the public names of ncap.domain and ncap.stores (the lead integrates against them)."""

from __future__ import annotations

import ast
import pathlib

import ncap.domain
import ncap.stores

DOMAIN = {
    "LEDGER_COLUMNS",
    "MICROS_PER_USD",
    "UNSETTLED_STATES",
    "Amounts",
    "AttemptOutcome",
    "Buckets",
    "BudgetWindows",
    "CandidatesMode",
    "CeilingParam",
    "Decision",
    "EventState",
    "LedgerEvent",
    "Prices",
    "ProbeFindings",
    "ProbeInconclusive",
    "ProbeReply",
    "ReconcileOutcome",
    "ReconciliationRow",
    "Reservation",
    "Settlement",
    "StreamReply",
    "Usage",
    "UsageSource",
    "active_exceptions",
    "admit",
    "candidates_mode",
    "check_route",
    "cost_micros",
    "decide",
    "derive_contract",
    "estimate_input_tokens",
    "fallback_allowed",
    "format_usd",
    "micros_from_usd",
    "reconcile",
    "reservation_for",
    "settle",
    "to_decimal",
}

STORES = {
    "AdminStore",
    "BACKENDS",
    "Backend",
    "BudgetHistory",
    "BudgetSide",
    "BudgetStore",
    "DuplicateAttempt",
    "Hold",
    "HoldState",
    "IdempotencyStore",
    "Identity",
    "ImportResult",
    "InstanceRegistry",
    "LedgerSide",
    "LedgerSource",
    "LedgerStore",
    "MemoryBudgetStore",
    "MemoryLedgerStore",
    "PostgresLedgerStore",
    "PostgresSource",
    "RedisBudgetStore",
    "RowExport",
    "SQLiteBudgetStore",
    "SQLiteLedgerStore",
    "SQLiteSource",
    "StoreOptions",
    "Stores",
    "backend_name",
    "budgets_from_url",
    "check_store_urls",
    "ensure_report_indexes",
    "existing_admin",
    "history_of",
    "hold_id_for",
    "ledger_from_url",
    "migrate_stores",
    "open_admin",
    "open_budget_side",
    "open_ledger_side",
    "open_report_source",
    "open_stores",
    "shared_between_processes",
    "sqlite_target",
}


def test_public_names() -> None:
    assert set(ncap.domain.__all__) == DOMAIN
    assert set(ncap.stores.__all__) == STORES
    for module in (ncap.domain, ncap.stores):
        for name in module.__all__:
            assert hasattr(module, name), name


def test_domain_imports_only_errors_config_stdlib_and_msgspec() -> None:
    root = pathlib.Path(ncap.domain.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                mod = node.module
            elif isinstance(node, ast.Import):
                mod = node.names[0].name
            else:
                continue
            if mod.startswith("ncap"):
                assert mod in ("ncap.errors", "ncap.config") or mod.startswith("ncap.domain"), (
                    f"{path.name} imports {mod}"
                )
            else:
                # msgspec: pure serialisation (byte lengths for the input estimate), no I/O
                top = mod.split(".")[0]
                assert top in _STDLIB or top == "msgspec", f"{path.name} imports {mod}"


_STDLIB = {
    "__future__",
    "functools",
    "collections",
    "hashlib",  # keyed digests of candidates (domain/evidence.py): computation, no I/O
    "dataclasses",
    "datetime",
    "decimal",
    "json",
    "re",
    "typing",
}
