"""Stores are chosen by URL scheme; unusable URLs are configuration errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from ncap.errors import ConfigError
from ncap.stores import (
    MemoryBudgetStore,
    MemoryLedgerStore,
    PostgresLedgerStore,
    RedisBudgetStore,
    SQLiteBudgetStore,
    SQLiteLedgerStore,
    budgets_from_url,
    ledger_from_url,
    sqlite_target,
)


async def test_memory_urls() -> None:
    assert isinstance(ledger_from_url("memory://"), MemoryLedgerStore)
    budgets = budgets_from_url("memory://", gateway_instance="g7")
    assert isinstance(budgets, MemoryBudgetStore) and budgets.quota_scope == "instance"


async def test_relative_sqlite_path_is_relative_to_cwd_and_parent_is_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ledger = ledger_from_url("sqlite:///.ncap/ledger.db")
    budgets = budgets_from_url("sqlite:///.ncap/budgets.db")
    try:
        assert isinstance(ledger, SQLiteLedgerStore) and isinstance(budgets, SQLiteBudgetStore)
        assert (tmp_path / ".ncap" / "ledger.db").exists()
        assert (tmp_path / ".ncap" / "budgets.db").exists()
        assert budgets.quota_scope == "host"
    finally:
        await ledger.close()
        await budgets.close()


@pytest.mark.parametrize(
    ("suffix", "synchronous"),
    [("", "FULL"), ("?synchronous=normal", "NORMAL"), ("?synchronous=FULL", "FULL")],
)
def test_absolute_sqlite_path(tmp_path: Path, suffix: str, synchronous: str) -> None:
    path, sync = sqlite_target(f"sqlite:///{tmp_path}/deep/er/l.db{suffix}")
    assert path == tmp_path / "deep" / "er" / "l.db" and path.parent.is_dir()
    assert sync == synchronous


def test_shared_store_urls() -> None:
    """Nothing connects until first use, so building them needs no server."""
    assert isinstance(ledger_from_url("postgresql://ncap@db/ncap?schema=s1"), PostgresLedgerStore)
    assert isinstance(ledger_from_url("postgres://ncap@db/ncap"), PostgresLedgerStore)
    budgets = budgets_from_url("redis://localhost:6379/0?prefix=p", gateway_instance="g1")
    assert isinstance(budgets, RedisBudgetStore) and budgets.quota_scope == "global"
    assert budgets.prefix == "p"
    with pytest.raises(ConfigError, match="schema"):
        ledger_from_url("postgresql://ncap@db/ncap?schema=Bad-Name")
    for url, factory in (
        ("redis://localhost:6379/0", ledger_from_url),
        ("postgresql://ncap@db/ncap", budgets_from_url),
    ):
        with pytest.raises(ConfigError, match="is not a"):
            factory(url)


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("sqlite://host/ledger.db", "sqlite:///relative/path"),
        ("sqlite:///:memory:", "memory://"),
        ("sqlite:///x.db?synchronous=off", "synchronous"),
        ("mysql://x", "unsupported"),
    ],
)
def test_unusable_urls_are_config_errors(url: str, needle: str) -> None:
    for factory in (ledger_from_url, budgets_from_url):
        with pytest.raises(ConfigError) as info:
            factory(url)
        assert needle in info.value.message
