"""The "candidates mostly duplicate" alert, posted to the budget webhook as it happens.

The daily report flags a workload (or exception) whose requests with more than one
returned candidate gave, on average, fewer distinct candidates per returned one than
``reports.thresholds.candidates_distinct_share``, over at least
``candidates_min_requests`` requests. This watch applies the same rule to today's
traffic (the UTC day) as rows become final, so an operator hears of the waste the day
it starts, not in the next report.

What it keeps: per (workload, exception) and UTC day, two numbers: how many requests
carried evidence and the sum of their distinct / compared shares. Nothing of the
candidates themselves (the evidence columns are counts already). The counts are this
process's own: after a restart, or on one replica of several, the watch judges the
traffic it has seen, and fires once that sample alone crosses the threshold.

Once: the alert is claimed in the admin store's ``budget_alerts`` table (scope
``candidates``, period the UTC day, ``threshold_pct`` the threshold in percent,
``spent_micros`` the mean distinct share in millionths, ``limit_micros`` the requests
it was judged on), whose primary key lets one claim win per subject and day, across
restarts and replicas; only the winner posts. The budget rows and this one share the
webhook and its retries (``alerts.webhook_url``); ``alerts.candidates: false`` turns
this post off. The report lists its own "candidates mostly duplicate" alert from the
ledger, not these rows.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ncap.config import Config
from ncap.http.alerts import Webhook, finish
from ncap.lifecycle import Attempt, Plan
from ncap.stores.ports import AdminStore, BudgetAlertRow

__all__ = ["CandidateWatch", "candidate_alert_text"]

log = logging.getLogger("ncap.alerts")
SCOPE = "candidates"


@dataclass
class _Day:
    day: str
    requests: int = 0
    share_sum: float = 0.0
    claimed: bool = False


class CandidateWatch:
    def __init__(
        self,
        config: Config,
        store: AdminStore,
        webhook: Webhook,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        """``webhook``: the budget alerts' poster, shared (its owner closes it)."""
        thresholds = config.reports.thresholds
        self._limit = thresholds.candidates_distinct_share
        self._min_requests = thresholds.candidates_min_requests
        self._on = config.alerts.candidates and config.alerts.webhook_url is not None
        self._store = store
        self._clock = clock
        self._webhook = webhook
        self._days: dict[tuple[str, str | None], _Day] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self._on and self._limit is not None

    def attempt_closed(
        self, plan: Plan, attempt: Attempt | None, final: Mapping[str, Any], outcome: str
    ) -> None:
        compared = final.get("candidates_compared")
        distinct = final.get("candidates_distinct")
        if not isinstance(compared, int) or compared < 2 or not isinstance(distinct, int):
            return
        now = self._clock()
        subject = (plan.caller.workload_id, plan.decision.exception_id)
        tally = self._tally(subject, now.date().isoformat())
        tally.requests += 1
        tally.share_sum += distinct / compared
        row = self._crossed(subject, tally, now)
        if row is not None:
            tally.claimed = True
            task = asyncio.create_task(self._fire(row))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _tally(self, subject: tuple[str, str | None], day: str) -> _Day:
        tally = self._days.get(subject)
        if tally is None or tally.day != day:
            tally = self._days[subject] = _Day(day)
        return tally

    def _crossed(
        self, subject: tuple[str, str | None], tally: _Day, now: datetime
    ) -> BudgetAlertRow | None:
        limit = self._limit
        if limit is None or tally.claimed or tally.requests < self._min_requests:
            return None
        mean = tally.share_sum / tally.requests
        if mean >= limit:
            return None
        workload, exception = subject
        return BudgetAlertRow(
            subject=exception or workload,
            scope=SCOPE,
            period=tally.day,
            threshold_pct=round(limit * 100),
            fired_at=now,
            spent_micros=round(mean * 1_000_000),
            limit_micros=tally.requests,
            workload=workload,
        )

    async def _fire(self, row: BudgetAlertRow) -> None:
        try:
            if not await self._store.claim_alert(row):
                return  # another replica, or this one before a restart, fired today's
            payload = {"text": candidate_alert_text(row), "ncap": _facts(row)}
            if await self._webhook.post(payload, label=SCOPE):
                await self._store.mark_delivered(row)
            else:
                log.warning(
                    "candidates alert not delivered: workload=%s subject=%s period=%s",
                    row.workload,
                    row.subject,
                    row.period,
                )
        except Exception as exc:  # an alert must never take the gateway down
            log.error("candidates alert failed: %s", type(exc).__name__)

    async def drain(self, grace_s: float = 5.0) -> None:
        """At shutdown: let posts in flight finish for a moment, then stop them."""
        await finish(self._tasks, grace_s)


def _facts(row: BudgetAlertRow) -> dict[str, Any]:
    exception = row.subject if row.subject != row.workload else None
    return {
        "kind": SCOPE,
        "workload": row.workload,
        "exception": exception,
        "period": row.period,
        "distinct_share_mean": row.spent_micros / 1_000_000,
        "threshold": row.threshold_pct / 100,
        "requests": row.limit_micros,
        "fired_at": row.fired_at.isoformat(),
    }


def candidate_alert_text(row: BudgetAlertRow) -> str:
    """One line for a chat channel, naming who, how far below and what to do."""
    facts = _facts(row)
    who = f"workload {row.workload}"
    who += f", exception {facts['exception']}" if facts["exception"] else " (no exception)"
    action = "lower n, raise the temperature"
    action += ", or revoke the exception" if facts["exception"] else ""
    return (
        f"ncap: candidates mostly duplicate today ({row.period}): {who}: "
        f"{facts['distinct_share_mean']:.2f} distinct per returned candidate on average "
        f"(below {facts['threshold']:.2f}) over {row.limit_micros} requests: {action}"
    )
