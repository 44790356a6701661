"""One exception tree for the whole gateway, mapped to OpenAI's envelope once, at the edge.

    NcapError                               (500 api_error, never shown with details)
    ├── InvalidRequest                      400 invalid_request_error
    │   ├── InvalidJSON                     400 invalid_json
    │   ├── InvalidValue                    400 invalid_value
    │   ├── InvalidType                     400 invalid_type
    │   ├── MissingParameter                400 missing_required_parameter
    │   ├── UnknownParameter                400 unknown_parameter
    │   ├── ContextLengthExceeded           400 context_length_exceeded
    │   ├── IdempotencyKeyMismatch          400 idempotency_key_mismatch
    │   └── PolicyDenied                    400 (policy codes, never retried)
    │       ├── CandidateCountExceedsPolicy       candidate_count_exceeds_policy
    │       ├── CandidatesWithGreedySampling      candidates_with_greedy_sampling
    │       ├── RouteDoesNotSupportCandidates     route_does_not_support_candidates
    │       ├── RouteContractStale                route_contract_stale
    │       └── OutputCeilingExceedsPolicy        output_ceiling_exceeds_policy
    ├── BodyTooLarge                        413 request_too_large
    ├── RequestTimeout                      408 request_timeout (the body did not arrive in time)
    ├── InvalidApiKey                       401 invalid_api_key
    ├── Forbidden                           403 forbidden (a key that is not the admin key)
    ├── NotFound                            404 not_found (an admin API entry)
    ├── ModelNotFound                       404 model_not_found
    ├── IdempotencyKeyReused                409 idempotency_key_reused (x-should-retry: false)
    ├── RateLimited                         429 (Retry-After)
    │   ├── RateLimitExceeded                     rate_limit_exceeded
    │   ├── ConcurrencyLimitExceeded              concurrency_limit_exceeded
    │   ├── BudgetExhausted                       budget_exhausted (x-should-retry: false)
    │   └── SlowDown                              slow_down
    ├── Overloaded                          503 server_is_overloaded
    │   └── StoreUnavailable                503 store_unavailable (a store is down: fail closed)
    ├── UpstreamError                       502 upstream_error
    │   └── UpstreamTimeout                 504 upstream_timeout
    └── ConfigError                         (CLI only: a configuration problem)

Every class knows its HTTP status and OpenAI ``type``/``code``; the message of an
``NcapError`` is written for the client. A refusal may also carry a ``Refusal``: which
limit refused and by how much, for the ledger's denial row (never request content).
Anything else that escapes a handler is an internal error and is answered with a
generic 500 envelope, never a stack trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "BodyTooLarge",
    "BudgetExhausted",
    "CandidateCountExceedsPolicy",
    "CandidatesWithGreedySampling",
    "ConcurrencyLimitExceeded",
    "ConfigError",
    "ContextLengthExceeded",
    "Forbidden",
    "IdempotencyKeyMismatch",
    "IdempotencyKeyReused",
    "InvalidApiKey",
    "InvalidJSON",
    "InvalidRequest",
    "InvalidType",
    "InvalidValue",
    "MissingParameter",
    "ModelNotFound",
    "NcapError",
    "NotFound",
    "OutputCeilingExceedsPolicy",
    "Overloaded",
    "PolicyDenied",
    "RateLimitExceeded",
    "RateLimited",
    "Refusal",
    "RequestTimeout",
    "RouteContractStale",
    "RouteDoesNotSupportCandidates",
    "SlowDown",
    "StoreUnavailable",
    "UnknownParameter",
    "UpstreamError",
    "UpstreamTimeout",
]


@dataclass(frozen=True, slots=True)
class Refusal:
    """What refused a request, for its denial row: the limit's name (a budget window such
    as ``tokens_day``, ``max_candidates``, ``output_ceiling``, or a refused field's
    name), the limit's value, and what the request needed of it, in the limit's unit
    (tokens, micro-USD, requests, candidates)."""

    limit: str
    value: int | None = None
    amount: int | None = None


class NcapError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "api_error"
    code: ClassVar[str | None] = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
        code: str | None = None,
        refusal: Refusal | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.refusal = refusal
        # what the gateway decided about the request before it failed (``x-ncap-*``)
        self.request_headers: dict[str, str] = {}
        if code is not None:
            self.code = code  # type: ignore[misc]

    @property
    def should_retry(self) -> bool | None:
        """Value for ``x-should-retry``; None leaves the client's own rule in charge."""
        return None

    def envelope(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = dict(self.request_headers)
        if self.retry_after is not None:
            out["retry-after"] = str(max(0, round(self.retry_after)))
            out["retry-after-ms"] = str(max(0, int(self.retry_after * 1000)))
        if self.should_retry is not None:
            out["x-should-retry"] = "true" if self.should_retry else "false"
        return out


class InvalidRequest(NcapError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_value"

    @property
    def should_retry(self) -> bool | None:
        return False


class InvalidJSON(InvalidRequest):
    code = "invalid_json"


class InvalidValue(InvalidRequest):
    code = "invalid_value"


class InvalidType(InvalidRequest):
    code = "invalid_type"


class MissingParameter(InvalidRequest):
    code = "missing_required_parameter"


class UnknownParameter(InvalidRequest):
    code = "unknown_parameter"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class IdempotencyKeyMismatch(InvalidRequest):
    """The ``Idempotency-Key`` was used before with another body."""

    code = "idempotency_key_mismatch"

    @property
    def should_retry(self) -> bool | None:
        return False


class PolicyDenied(InvalidRequest):
    """A request the workload's policy refuses before dispatch; retrying cannot help."""

    code = "policy_denied"


class CandidateCountExceedsPolicy(PolicyDenied):
    code = "candidate_count_exceeds_policy"


class CandidatesWithGreedySampling(PolicyDenied):
    code = "candidates_with_greedy_sampling"


class RouteDoesNotSupportCandidates(PolicyDenied):
    code = "route_does_not_support_candidates"


class RouteContractStale(PolicyDenied):
    code = "route_contract_stale"


class OutputCeilingExceedsPolicy(PolicyDenied):
    code = "output_ceiling_exceeds_policy"


class BodyTooLarge(NcapError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RequestTimeout(NcapError):
    """The request body did not arrive within ``limits.body_timeout_s``; the answer
    closes the connection (what is left of the body is never read)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class InvalidApiKey(NcapError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(NcapError):
    status = 403
    type = "invalid_request_error"
    code = "forbidden"


class NotFound(NcapError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NcapError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class IdempotencyKeyReused(NcapError):
    """A request with this ``Idempotency-Key`` and body was already dispatched and its
    answer is not kept (or it is a stream): it is not dispatched again. Never retried:
    a retry would get the same answer."""

    status = 409
    type = "invalid_request_error"
    code = "idempotency_key_reused"

    @property
    def should_retry(self) -> bool | None:
        return False


class RateLimited(NcapError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class RateLimitExceeded(RateLimited):
    code = "rate_limit_exceeded"


class ConcurrencyLimitExceeded(RateLimited):
    code = "concurrency_limit_exceeded"


class BudgetExhausted(RateLimited):
    code = "budget_exhausted"

    @property
    def window(self) -> str | None:
        """The budget window that refused (``ncap.metrics.BUDGET_WINDOWS`` or
        ``exception``), when the store said."""
        return self.refusal.limit if self.refusal is not None else None

    @property
    def should_retry(self) -> bool | None:
        return False


class SlowDown(RateLimited):
    code = "slow_down"


class Overloaded(NcapError):
    status = 503
    type = "server_error"
    code = "server_is_overloaded"


class StoreUnavailable(Overloaded):
    """A store could not be reached or failed: the gateway refuses rather than serve
    traffic it cannot meter. ``store`` names it (``ledger`` or ``budgets`` for /readyz;
    ``admin`` for the admin API's changes).

    Every backend converts its driver's errors into this one class where they enter
    (``raise StoreUnavailable(...) from exc``), so nothing above the stores knows drivers.
    """

    code = "store_unavailable"

    def __init__(self, store: str, backend: str, detail: str = "") -> None:
        consequence = (
            "; an admin change asked for now may not have been made (GET /admin/audit "
            "lists those that were)"
            if store == "admin"  # an admin API call, not a metered request
            else ", so no request can be metered; nothing was sent upstream"
        )
        super().__init__(
            f"The gateway's {store} store ({backend}) is unavailable{consequence}. "
            "Retry after a short delay.",
            retry_after=1.0,
        )
        self.store = store
        self.backend = backend
        self.detail = detail  # the driver's error class, for logs; never sent to clients


class UpstreamError(NcapError):
    status = 502
    type = "server_error"
    code = "upstream_error"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class ConfigError(NcapError):
    """A configuration problem; ``problems`` lists every one with its location."""

    code = "config_error"

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]
