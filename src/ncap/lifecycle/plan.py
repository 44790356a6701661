"""The shapes both sides of the lifecycle share: the caller, a route at run time, the
admitted request's plan (frozen), one attempt, and what an attempt said about itself.

Everything in ``ncap.lifecycle`` imports these from here and nothing here imports the
rest of the package, so the lifecycle's modules form a tree, not a cycle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime

import msgspec

from ncap.config import Route
from ncap.domain.events import LedgerEvent
from ncap.domain.evidence import Evidence
from ncap.domain.policy import Decision
from ncap.domain.reservation import Reservation
from ncap.lifecycle.health import RouteHealth
from ncap.protocol.responses import SummaryUsage
from ncap.providers.base import Provider, RequestKind
from ncap.providers.kinds import Capabilities, capabilities_of
from ncap.stores.ports import Hold

__all__ = [
    "Attempt",
    "AttemptReport",
    "Caller",
    "Holds",
    "Plan",
    "Reply",
    "RouteRuntime",
    "Sampling",
]


class Caller(msgspec.Struct, frozen=True, gc=False):
    """Who sent the request (its workload, environment and key), and which of the
    client's own tries it is (``x-stainless-retry-count``: every row records it)."""

    workload_id: str
    environment: str
    client_retry_count: int | None = None
    # the public id of the API key the request presented (its hash prefix); None in
    # keyless mode. What a client may name for itself (an Idempotency-Key) is scoped by it
    key_id: str | None = None


@dataclass(frozen=True, slots=True)
class RouteRuntime:
    id: str
    route: Route
    provider: Provider
    # a remote route's health metrics, moved by each attempt (None: in-process)
    health: RouteHealth | None = None

    @property
    def capabilities(self) -> Capabilities:
        """What the route's kind of provider can do (never its name: see providers)."""
        return capabilities_of(self.route.provider)


class Reply(msgspec.Struct):
    status: int
    headers: dict[str, str]
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    # its settlement was handed to the settlement service, which ends the request's
    # record (access line, span) once it is done: the HTTP layer does not end it
    settling: bool = False


class Sampling(msgspec.Struct, frozen=True, gc=False):
    """The request's numeric sampling parameters as sent (None: not sent), which traces
    report; never anything the client wrote as text."""

    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None


class Plan(msgspec.Struct, frozen=True):
    """One admitted request: what policy decided, what is reserved, which routes it may
    use. Frozen once admitted; what changes per attempt lives on the ``Attempt``."""

    request_id: str
    caller: Caller
    alias: str
    decision: Decision
    reservation: Reservation
    # what each attempt holds (a fan-out branch: 1/k of the whole)
    attempt_reservation: Reservation
    usable_routes: tuple[RouteRuntime, ...]
    # fan-out emulation: k single-candidate branches, each its own attempt and hold
    emulated: bool
    stream: bool
    client_wants_usage: bool
    quota_scope: str
    timestamp: datetime
    started: float
    # the endpoint (chat, or legacy completions), and for a legacy ``best_of`` > ``n``
    # how many of the generated candidates come back (None: all of them)
    kind: RequestKind = "chat"
    returns: int | None = None
    sampling: Sampling = Sampling()

    @property
    def candidates_per_attempt(self) -> int:
        return 1 if self.emulated else self.decision.effective

    @property
    def expected_returned(self) -> int:
        """The choices a complete answer of one attempt has (``best_of`` generates more
        candidates than it returns)."""
        if self.emulated:
            return 1
        return self.returns if self.returns is not None else self.decision.effective

    def headers(self, route_id: str) -> dict[str, str]:
        d = self.decision
        return {
            "x-ncap-route": route_id,
            "x-ncap-candidates-requested": "omitted" if d.requested is None else str(d.requested),
            "x-ncap-candidates-effective": str(d.effective),
            "x-ncap-reserved-tokens": str(self.reservation.total_tokens),
        }


class Holds(dict[int, Hold]):
    """The request's unsettled holds by attempt number, shared by its attempts: closing
    an attempt takes its hold out, and whatever is left when the request ends early is
    released (``Accounting.abandon``). With budgets on another server, admission writes
    the first attempt's ``reserved`` row beside its hold (``reserve_beside_row``): that
    row is kept here for the first attempt, not on the frozen plan."""

    __slots__ = ("first_row",)

    def __init__(self) -> None:
        super().__init__()
        self.first_row: LedgerEvent | None = None


class Attempt(msgspec.Struct, eq=False):
    """One try of one route: started (its reserved row durable), then closed exactly
    once as answered, failed or stream-finished (``ncap.lifecycle.settle``).

    ``holds`` is the request's registry of unsettled holds (``Holds``)."""

    plan: Plan
    holds: Holds
    number: int
    route: RouteRuntime
    hold: Hold | None
    row: LedgerEvent
    started: float
    closed: bool = False
    # trace headers for this attempt's upstream request (``traceparent``), set by an
    # observer when traces are on; None otherwise
    trace: dict[str, str] | None = None


class AttemptReport(msgspec.Struct, frozen=True, gc=False):
    """What an answered attempt said about itself (from its body or its stream)."""

    provider_request_id: str | None
    returned: int
    finish_reasons: dict[str, int]
    usage: SummaryUsage | None
    stream: bool
    cut: str | None  # why a stream ended early, None when it ended normally
    choice_tokens: tuple[int, ...] | None = None  # per choice, when the provider told
    # how different its candidates were (two or more, read whole; counts only)
    evidence: Evidence | None = None
