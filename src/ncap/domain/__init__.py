"""Pure, synchronous domain logic: policy, contracts, money, reservations, events.

No I/O and no clock of its own: every instant is a parameter. Imports only
``ncap.errors``, ``ncap.config`` and the standard library.
"""

from ncap.domain.budget import Amounts, Buckets, BudgetWindows, Usage, admit
from ncap.domain.contracts import CandidatesMode, candidates_mode, check_route, fallback_allowed
from ncap.domain.events import (
    LEDGER_COLUMNS,
    UNSETTLED_STATES,
    AttemptOutcome,
    EventState,
    LedgerEvent,
    ReconcileOutcome,
    ReconciliationRow,
    Settlement,
    UsageSource,
    reconcile,
    settle,
)
from ncap.domain.money import (
    MICROS_PER_USD,
    Prices,
    cost_micros,
    format_usd,
    micros_from_usd,
    to_decimal,
)
from ncap.domain.policy import CeilingParam, Decision, active_exceptions, decide
from ncap.domain.probe import (
    ProbeFindings,
    ProbeInconclusive,
    ProbeReply,
    StreamReply,
    derive_contract,
)
from ncap.domain.reservation import Reservation, estimate_input_tokens, reservation_for

__all__ = [
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
]
