"""The request lifecycle, split by concern (one module each, imports pointing down):

plan            Caller, RouteRuntime, the frozen Plan, Holds, Attempt, AttemptReport, Reply
asked           what a request asks for, chat or legacy completions (n / best_of, ceiling)
failures        one table: a failed attempt → its ledger outcome and the client's error
settlement      the settlement service: closed attempts' store writes, now, beside an
                answer (batched per loop tick) or once a refusing store is back
final_row       an attempt's final ledger columns, a denial's denied_* columns
settle          Accounting, the books: holds and ledger rows; an Attempt begun, closed
                exactly once
attempt_report  what an answer or a stream says about itself (finish reasons, usage)
admit           policy, route contracts, reservation → the Plan and its holds
attempts        one attempt (whole or streamed), and retry/fallback along the chain
relay           one upstream stream relayed to the client
fanout          n by k single-candidate branches, merged (whole or streamed)
gateway         Gateway.chat: picks the path, releases what an early end left held
"""

from ncap.lifecycle.gateway import Gateway
from ncap.lifecycle.plan import Attempt, AttemptReport, Caller, Plan, Reply, RouteRuntime
from ncap.lifecycle.settle import Accounting
from ncap.lifecycle.settlement import Settlement

__all__ = [
    "Accounting",
    "Attempt",
    "AttemptReport",
    "Caller",
    "Gateway",
    "Plan",
    "Reply",
    "RouteRuntime",
    "Settlement",
]
