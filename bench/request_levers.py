"""Where a non-streamed request's instructions go, by cause: ``ncap serve`` counted
under callgrind (``bench/instructions.py``'s harness) with ONE concern switched off
at a time, by monkeypatching it in the served process (never in the product code).
The difference between ``full`` and a case is what that concern costs per request:

  full              nothing switched off
  no-access-line    the access-log line not built, encoded or written
  no-signals        no request record at all (access line, its attempt views)
  no-metrics        every labelled metric child a no-op
  no-budgets        the budget store's reserve and settle return at once
  no-ledger         the ledger store's append and updates return at once
  no-validation     the request body parsed once, then the same result reused
  no-upstream-call  the transport's POST answered from its first answer (no client,
                    no socket: what the upstream client and its I/O cost)
  no-provider       the provider answered from its first answer (the client, the
                    translator's request encode and response decode)
  no-settlement     a whole answer's settlement skipped (only its hold released and
                    its record ended): the books' closing of an attempt, the
                    settlement service, the hold's settle and the row's update

``--setup`` picks the stores (``ncap-memory``, ``ncap`` the shipped default with
its SQLite ledger, ``ncap-shared``); ``no-budgets``/``no-ledger``/``no-settlement``
patch the memory and SQLite stores only.

    .venv/bin/python bench/request_levers.py [--setup ncap-memory] [--cases full,...]
        [--requests 600] [--src DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import benchlib as bl
import instructions as ins

CASES = (
    "full",
    "no-access-line",
    "no-signals",
    "no-metrics",
    "no-budgets",
    "no-ledger",
    "no-validation",
    "no-upstream-call",
    "no-provider",
    "no-settlement",
)

# imported by the served process (it is first on its PYTHONPATH); NCAP_LEVER names the
# case. Every patch replaces a method or a module-level name the request path calls.
_SITECUSTOMIZE = """
import os

LEVER = os.environ.get("NCAP_LEVER", "full")


def _patch():
    from datetime import UTC, datetime

    if LEVER == "no-access-line":
        import ncap.http.signals as s

        s.RequestSignals.end = lambda self, rid: self._open.pop(rid, None) and None
    elif LEVER == "no-signals":
        import ncap.http.signals as s

        for name in ("begin", "caller", "responded", "settled", "end", "attempt_closed"):
            setattr(s.RequestSignals, name, lambda self, *a, **k: None)
    elif LEVER == "no-metrics":
        import ncap.metrics as m

        class Nothing:
            def inc(self, *a): pass
            def dec(self, *a): pass
            def observe(self, *a): pass
            def set(self, *a): pass

        nothing = Nothing()
        m.Metrics.child = lambda self, family, *labels: nothing
    elif LEVER == "no-budgets":
        import ncap.stores.memory.budgets as b
        from ncap.stores.ports import Hold

        hold = Hold("h", "default", None, 1, 1, "m", "d", "mo", "i", datetime.now(UTC))

        async def reserve(self, *a, **k): return hold
        async def done(self, *a, **k): return True
        b.MemoryBudgetStore.reserve = reserve
        b.MemoryBudgetStore.settle = done
        b.MemoryBudgetStore.settle_many = done
        b.MemoryBudgetStore.release = done
    elif LEVER == "no-ledger":
        import ncap.stores.memory.ledger as ml
        import ncap.stores.sqlite.ledger as sl

        async def nothing(self, *a, **k): return None
        for store in (ml.MemoryLedgerStore, sl.SQLiteLedgerStore):
            store.append = nothing
            store.update = nothing
            store.update_many = nothing
    elif LEVER == "no-validation":
        import ncap.lifecycle.gateway as g

        parse, seen = g.parse_chat_request, {}

        def once(raw, **kw):
            if raw not in seen:
                seen[raw] = parse(raw, **kw)
            return seen[raw]
        g.parse_chat_request = once
    elif LEVER == "no-upstream-call":
        import ncap.providers.transport as t

        post, answers = t.HttpTransport.post, {}

        async def first(self, data, **kw):
            if self.url not in answers:
                answers[self.url] = await post(self, data, **kw)
            return answers[self.url]
        t.HttpTransport.post = first
    elif LEVER == "no-provider":
        import ncap.providers.openai as o

        complete, answers = o.OpenAIProvider.complete, {}

        async def first(self, body, *, timeout, kind="chat"):
            if kind not in answers:
                answers[kind] = await complete(self, body, timeout=timeout, kind=kind)
            return answers[kind]
        o.OpenAIProvider.complete = first
    elif LEVER == "no-settlement":
        import ncap.lifecycle.settle as st

        def released(self, answered):
            store = getattr(self.budgets, "_inner", self.budgets)
            for attempt, _ in answered:
                hold = attempt.holds.pop(attempt.number, None)
                if hold is not None and store._holds.pop(hold.hold_id, None) is not None:
                    store._active[hold.workload_id] -= 1
            if self.settlement._on_settled is not None:
                self.settlement._on_settled(answered[0][0].plan.request_id)
        st.Accounting.answered_beside = released


if LEVER != "full":
    _patch()
"""


def measure(case: str, args: argparse.Namespace, upstream_port: int, work: Path) -> dict:
    src = work / f"src-{case}"
    src.mkdir()
    (src / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    (src / "ncap").symlink_to(Path(args.src).resolve() / "ncap")
    opts = argparse.Namespace(
        requests=args.requests, warm=args.warm, concurrency=args.concurrency,
        src=str(src), keep="",
    )  # fmt: skip
    os.environ["NCAP_LEVER"] = case  # the served process inherits it
    try:
        row = ins.measure(args.setup, opts, upstream_port, work)
    finally:
        os.environ.pop("NCAP_LEVER", None)
    row["case"] = case
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", default="ncap-memory", choices=["ncap-memory", "ncap", "ncap-shared"])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--warm", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--src", default=str(bl.ROOT / "src"), help="the ncap sources to serve")
    p.add_argument("--no-save", action="store_true", help="print only (a lever's A/B)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        print(f"unknown cases: {', '.join(unknown)}", file=sys.stderr)
        return 2
    if not ins.have_callgrind():
        return 2
    rows = ins.measure_each(
        cases, lambda case, port, work: measure(case, args, port, work), "ncap-levers-"
    )
    if not args.no_save:
        bl.save_result("request-levers", [table(rows, args)], raw=rows)
    return 0


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> bl.Table:
    full = next((r["instructions_per_request"] for r in rows if r["case"] == "full"), None)
    body = [
        [
            r["case"],
            r["instructions_per_request"],
            full - r["instructions_per_request"] if full is not None else None,
            r["errors"],
        ]
        for r in rows
    ]
    title = "Instructions per request with one concern switched off"
    title += f" ({args.setup}, c={args.concurrency})"
    notes = (
        f"{args.requests} requests counted after {args.warm} warm-up requests, per case. "
        "What a concern costs is full minus its case."
    )
    columns = ["case", "instructions per request", "the concern's cost", "errors"]
    return bl.Table(title, columns, body, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
