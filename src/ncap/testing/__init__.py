"""Test and demo helpers: the fake upstream (``ncap.testing.fake_upstream``) and
synthetic ledgers (``LedgerSpec``, ``generate_ledger``, ``synthetic_config``)."""

from __future__ import annotations

from ncap.testing.ledger_gen import LedgerSpec, generate_ledger, synthetic_config

__all__ = ["LedgerSpec", "generate_ledger", "synthetic_config"]
