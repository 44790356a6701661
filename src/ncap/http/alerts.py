"""Budget alerts: each configured percentage of a budget, posted once per window period
to a webhook, and recorded where the report reads it (``budget_alerts``).

Which budgets: a workload's ``usd_per_day`` (period: the UTC day), ``usd_per_month``
(the UTC month) and an exception's ``budget_usd`` (period: its life). What counts is
what the budget check counts: settled cost plus what is still held.

When: an attempt's row is final, or a request was refused by a USD budget (an
``Accounting`` observer). A refusal by a budget's window fires that budget's
thresholds up to 100 % even when settled plus held is below the limit: the check
refuses a request whose own reservation would pass the limit, so the spend of a
refusing budget stalls short of it, and a budget that refuses work is the state an
operator most needs to hear about (the critical alert). The hook only schedules
a check for that workload and exception in the background; a check already running
for them runs once more when it ends instead of piling up. The request path never
waits for the budget read, the webhook or its retries.

Once: a threshold is claimed by inserting its row (subject, scope, period,
threshold) into the admin store, whose primary key lets one claim win, across
restarts and across replicas sharing the ledger database. Only the winner posts.
The post is JSON with a Slack-compatible ``text`` and the same facts under ``ncap``;
it is retried ``retries`` times with exponential backoff on a connection error, a
timeout, a 429 or a 5xx, then given up (logged; the row stays ``delivered = 0``).
A redirect is never followed (the webhook URL is often itself a secret, and the post
must not go to an origin the receiver names): a 3xx is a refusal, not retried.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Set
from datetime import UTC, datetime
from typing import Any

import aiohttp

from ncap.config import BudgetAlerts, Config
from ncap.domain.budget import Buckets, BudgetWindows, Usage
from ncap.domain.grants import Grants
from ncap.domain.money import format_usd
from ncap.lifecycle import Attempt, Plan
from ncap.metrics import Metrics
from ncap.stores.ports import AdminStore, BudgetAlertRow, BudgetStore

__all__ = ["BudgetAlerter", "Webhook", "alert_text", "finish"]

log = logging.getLogger("ncap.alerts")
Subject = tuple[str, str | None]  # (workload, exception id)
# a ``budget_exhausted`` denial's ``denied_by`` -> the alert scope it exhausts
_REFUSING = {"usd_micros_day": "day", "usd_micros_month": "month", "exception": "exception"}


class BudgetAlerter:
    def __init__(
        self,
        config: Config,
        grants: Grants,
        budgets: BudgetStore,
        store: AdminStore,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        metrics: Metrics | None = None,
        webhook: Webhook | None = None,
    ) -> None:
        """``webhook``: the poster shared with other alerts (its owner closes it);
        without one the alerter makes its own and closes it in ``drain``."""
        self._config = config
        self._settings: BudgetAlerts = config.alerts
        self._grants = grants
        self._budgets = budgets
        self._store = store
        self._clock = clock
        self._running: dict[Subject, asyncio.Task[None]] = {}
        self._again: set[Subject] = set()
        self._refused: dict[Subject, set[str]] = {}
        self._own_webhook = webhook is None
        self._webhook = webhook or Webhook(self._settings, metrics)

    @property
    def enabled(self) -> bool:
        return self._settings.webhook_url is not None and bool(self._settings.thresholds)

    # -- the lifecycle's hook ----------------------------------------------------------------

    def attempt_closed(
        self, plan: Plan, attempt: Attempt | None, final: Mapping[str, Any], outcome: str
    ) -> None:
        subject = (plan.caller.workload_id, plan.decision.exception_id)
        if attempt is None:  # a denial spent nothing; a USD budget's refusal is news
            scope = _REFUSING.get(str(final.get("denied_by")))
            if final.get("policy_reason") != "budget_exhausted" or scope is None:
                return
            self._refused.setdefault(subject, set()).add(scope)
        if subject in self._running:
            self._again.add(subject)
            return
        self._running[subject] = asyncio.create_task(self._checks(subject))

    async def _checks(self, subject: Subject) -> None:
        try:
            while True:
                self._again.discard(subject)
                refused = self._refused.pop(subject, set())
                try:
                    await self.check(*subject, refused=refused)
                except Exception as exc:  # an alert must never take the gateway down
                    log.error("budget alert check failed: %s", type(exc).__name__)
                if subject not in self._again:
                    return
        finally:
            self._running.pop(subject, None)

    # -- one check ---------------------------------------------------------------------------

    async def check(
        self, workload_id: str, exception_id: str | None, *, refused: Set[str] = frozenset()
    ) -> list[BudgetAlertRow]:
        """Claim and post every threshold crossed now (``refused``: scopes that refused a
        request, which count as at 100 %); returns the ones this call fired."""
        now = self._clock()
        usage = await self._budgets.usage(workload_id, exception_id=exception_id, now=now)
        fired = []
        for row in self._crossed(workload_id, exception_id, usage, now, refused):
            if await self._store.claim_alert(row):
                fired.append(row)
                if await self._post(row):
                    await self._store.mark_delivered(row)
        return fired

    def _crossed(
        self,
        workload_id: str,
        exception_id: str | None,
        usage: Usage,
        now: datetime,
        refused: Set[str] = frozenset(),
    ) -> list[BudgetAlertRow]:
        workload = self._config.workloads.get(workload_id)
        if workload is None:
            return []
        grant = self._grants.exception(exception_id)
        windows = BudgetWindows.for_workload(workload, grant)
        buckets = Buckets.at(now)
        budgets = {
            "day": (workload_id, buckets.day, usage.cost_day, windows.usd_per_day_micros),
            "month": (workload_id, buckets.month, usage.cost_month, windows.usd_per_month_micros),
            "exception": (
                exception_id or "",
                "life",
                usage.cost_exception,
                windows.exception_budget_micros,
            ),
        }
        rows = []
        for scope in self._settings.scopes:
            subject, period, spent, limit = budgets[scope]
            if not limit or not subject:
                continue
            at_limit = scope in refused
            for pct in self._settings.thresholds:
                if spent * 100 >= pct * limit or (at_limit and pct <= 100):
                    rows.append(
                        BudgetAlertRow(
                            subject, scope, period, pct, now, spent, limit, workload=workload_id
                        )
                    )
        return rows

    # -- the webhook -------------------------------------------------------------------------

    async def _post(self, row: BudgetAlertRow) -> bool:
        payload = {"text": alert_text(row), "ncap": _facts(row)}
        if await self._webhook.post(payload, label=row.scope):
            return True
        log.warning(
            "budget alert not delivered: workload=%s subject=%s window=%s period=%s threshold=%s%%",
            row.workload or row.subject,
            row.subject,
            row.scope,
            row.period,
            row.threshold_pct,
        )
        return False

    async def drain(self, grace_s: float = 5.0) -> None:
        """At shutdown: let running checks finish for a moment, then stop them."""
        await finish(self._running.values(), grace_s)
        if self._own_webhook:
            await self._webhook.close()


class Webhook:
    """Posts one alert's JSON to ``alerts.webhook_url``: retried ``retries`` times with
    exponential backoff on a connection error, a timeout, a 429 or a 5xx; a redirect is
    a refusal (never followed), as is any other 4xx. A post given up is counted under
    its ``label`` in ``ncap_budget_alert_webhook_failures``."""

    def __init__(self, settings: BudgetAlerts, metrics: Metrics | None = None) -> None:
        self._settings = settings
        self._metrics = metrics
        self._session: aiohttp.ClientSession | None = None

    async def post(self, payload: Mapping[str, Any], *, label: str) -> bool:
        settings, url = self._settings, self._settings.webhook_url
        if url is None:
            return False
        timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
        for attempt in range(settings.retries + 1):
            if attempt:
                await asyncio.sleep(settings.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._client().post(
                    url, json=payload, timeout=timeout, allow_redirects=False
                ) as reply:
                    if reply.status < 300:
                        return True
                    if reply.status != 429 and reply.status < 500:
                        break  # the receiver refused this payload: retrying will not help
            except (aiohttp.ClientError, TimeoutError):
                continue
        if self._metrics is not None:
            self._metrics.child(self._metrics.alert_webhook_failures, label).inc()
        return False

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def finish(tasks: Iterable[asyncio.Task[None]], grace_s: float) -> None:
    """Let ``tasks`` finish for ``grace_s``, then cancel the late ones."""
    pending = list(tasks)
    if pending:
        _, late = await asyncio.wait(pending, timeout=grace_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)


def _facts(row: BudgetAlertRow) -> dict[str, Any]:
    return {
        "subject": row.subject,
        "kind": "exception" if row.scope == "exception" else "workload",
        "window": row.scope,
        "period": row.period,
        "threshold_pct": row.threshold_pct,
        "spent_usd": row.spent_micros / 1e6,
        "budget_usd": row.limit_micros / 1e6,
        "fired_at": row.fired_at.isoformat(),
    }


def alert_text(row: BudgetAlertRow) -> str:
    """One line for a chat channel (Slack, Mattermost and Teams read ``text``)."""
    what = (
        f"exception {row.subject} has used"
        if row.scope == "exception"
        else f"workload {row.subject} has used"
    )
    window = {"day": f"its day budget ({row.period})", "month": f"its month budget ({row.period})"}
    budget = window.get(row.scope, "its lifetime budget")
    # fired by a refusal below the limit (see the module docstring)
    below = row.spent_micros * 100 < row.threshold_pct * row.limit_micros
    refusing = " and refuses requests" if below else ""
    return (
        f"ncap: {what} {row.threshold_pct}% of {budget}{refusing}: "
        f"{format_usd(row.spent_micros)} of {format_usd(row.limit_micros)}"
    )
