"""The report as rich tables, JSON, or one self-contained HTML page (inline CSS and
SVG, nothing fetched; Jinja2 with autoescaping, so a workload called ``<script>``
is shown as text). The dashboard renders the same template with its own header.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ncap.domain.money import format_usd
from ncap.reports.model import CandidateEvidence, Report, report_dict
from ncap.reports.svg import bar_chart, budget_chart, column_series, paired_bar_chart
from ncap.reports.timeline import CandidateSpend, Timeline

__all__ = [
    "evidence_tables",
    "render_html",
    "render_json",
    "render_tables",
    "render_tsv",
    "template_environment",
]


def render_json(report: Report) -> str:
    return json.dumps(report_dict(report), indent=2, sort_keys=False)


def _n(value: int | float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.2f}"


def _usd(micros: int | None) -> str:
    return "–" if micros is None else format_usd(micros)


def _when(value: datetime | None) -> str:
    return "–" if value is None else value.strftime("%Y-%m-%d %H:%M:%S UTC")


def _req(value: int | None) -> str:
    return "omitted" if value is None else str(value)


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


@dataclass(frozen=True, slots=True)
class Section:
    """One table of the report: a title, its column names and its rows as text."""

    title: str
    headers: Sequence[str]
    rows: list[list[str]]

    def rich(self) -> Table:
        table = Table(*self.headers, title=Text(self.title), title_justify="left", expand=False)
        for row in self.rows:
            table.add_row(*(Text(cell) for cell in row))  # values are data, not markup
        return table


def _table(title: str, headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> Section:
    return Section(title, headers, [[str(cell) for cell in row] for row in rows])


def render_tables(report: Report, console: Console) -> None:
    """Print every section as a rich table (markup in values is not interpreted)."""
    for table in _tables(report):
        console.print(table.rich())
    console.print(f"report built in {report.elapsed_ms:,.0f} ms", highlight=False)


def render_tsv(report: Report) -> str:
    """Every section as tab-separated lines, for a pipe or a file: a ``# title`` line,
    the column names, the rows (nothing cut to a terminal's width), a blank line."""
    out: list[str] = []
    for table in _tables(report):
        out.append(f"# {table.title}")
        for row in (table.headers, *table.rows):
            out.append("\t".join(" ".join(cell.split()) for cell in row))
        out.append("")
    return "\n".join(out)


def _tables(r: Report) -> list[Section]:
    """One table per section, in the order of the HTML page."""
    return [*_overview(r), *_candidates(r), *_money(r), *evidence_tables(r.candidates)]


def _overview(r: Report) -> list[Section]:
    t = r.totals
    totals = [
        t.requests,
        t.attempts,
        t.denied_requests,
        t.cost_micros,
        t.input_tokens,
        t.output_tokens,
    ]
    head = _table(
        f"ncap {r.kind}: {_when(r.window.start)} → {_when(r.window.end)}",
        ["requests", "attempts", "denied", "spend", "input tokens", "output tokens"],
        [[_n(v) if i != 3 else _usd(v) for i, v in enumerate(totals)]],
    )
    alerts = _table(
        "alerts",
        ["severity", "source", "code", "message"],
        [[a.severity, a.source, a.code, a.message] for a in r.alerts],
    )
    return [head, alerts]


def _candidates(r: Report) -> list[Section]:
    return [
        _table(
            "requested-candidate distribution",
            ["workload", "route", "requested n", "requests"],
            [
                [d.workload_id, d.route_id or "–", _req(d.requested), _n(d.requests)]
                for d in r.distribution
            ],
        ),
        _table(
            "distribution shift (PSI vs previous window)",
            ["workload", "PSI", "requests", "previous", "status"],
            [
                [
                    s.workload_id,
                    _n(s.psi),
                    _n(s.current_requests),
                    _n(s.previous_requests),
                    s.status,
                ]
                for s in r.shift
            ],
        ),
        _table(
            "requested vs effective vs returned (requests)",
            ["workload", "kind", "requests"],
            [[m.workload_id, m.kind, _n(m.requests)] for m in r.mismatches],
        ),
        _table(
            "returned-count mismatches by route (attempts)",
            ["route", "attempts", "returned_mismatch"],
            [
                [m.route_id or "–", _n(m.attempts), _n(m.returned_mismatch)]
                for m in r.route_mismatches
            ],
        ),
        _table(
            "aggregate output tokens",
            ["workload", "requests", "mean / request", "p50", "p95", "per returned choice"],
            [
                [o.workload_id, _n(o.requests), _n(o.mean), _n(o.p50), _n(o.p95), _n(o.per_choice)]
                for o in r.output
            ],
        ),
        _table(
            "cost per choice (routes that reveal each choice's output tokens)",
            ["route", "attempts", "choices", "tokens mean", "p50", "p95", "max", "cost / choice"],
            [
                [
                    c.route_id or "–",
                    _n(c.attempts),
                    _n(c.choices),
                    _n(c.tokens_mean),
                    _n(c.tokens_p50),
                    _n(c.tokens_p95),
                    _n(c.tokens_max),
                    _n(c.cost_per_choice_micros) + " µ$",
                ]
                for c in r.per_choice
            ],
        ),
        _table(
            "denials by reason",
            ["reason", "workload", "requests"],
            [[d.reason, d.workload_id, _n(d.requests)] for d in r.denials],
        ),
    ]


def evidence_tables(rows: list[CandidateEvidence]) -> list[Section]:
    """How different the candidates were per workload and exception, and the what-if of
    n (also the exception review's view, ``ncap report candidates``)."""
    evidence = _table(
        "candidate evidence (requests returning two or more candidates)",
        [
            "workload",
            "exception",
            "requests",
            "distinct / returned",
            "agreement",
            "agreement 1.0 | .75-1 | .5-.75 | <.5",
            "tool calls",
            "duplicate output",
        ],
        [
            [
                e.workload_id,
                e.exception_id or "–",
                _n(e.requests),
                _n(e.distinct_share_mean),
                _n(e.agreement_mean),
                " | ".join(str(v) for v in e.agreement.values()),
                _n(e.tool_call_share_mean),
                _pct(e.duplicate_output_share),
            ]
            for e in rows
        ],
    )
    what_if = _table(
        "what-if of n (measured prompt P and completion C per request, route prices)",
        [
            "workload",
            "exception",
            "priced",
            "spent",
            "at n=1",
            "saving at n=1",
            "cost(n)",
            "emulated spent",
            "same on native",
        ],
        [
            [
                e.workload_id,
                e.exception_id or "–",
                _n(e.priced_requests),
                _usd(e.spent_micros),
                _usd(e.what_if.get(1)),
                _usd(e.saving_at_one_micros),
                ", ".join(f"{n}: {format_usd(c)}" for n, c in e.what_if.items()),
                _usd(e.emulated_spent_micros),
                _usd(e.native_equivalent_micros),
            ]
            for e in rows
        ],
    )
    return [evidence, what_if]


_EXCEPTION_HEADERS = [
    "id",
    "workload",
    "owner",
    "max n",
    "expires",
    "status",
    "requests (window)",
    "spent",
    "held",
    "budget",
    "used",
    "after expiry",
]


def _money(r: Report) -> list[Section]:
    pend = r.pending_total
    exceptions = _table(
        "exceptions",
        _EXCEPTION_HEADERS,
        [
            [
                e.id,
                e.workload or "–",
                e.owner or "–",
                _n(e.max_candidates),
                _when(e.expires),
                e.status,
                _n(e.requests_window),
                _usd(e.spent_micros),
                _usd(e.held_micros),
                _usd(e.budget_micros),
                _pct(e.used_fraction),
                _n(e.requests_after_expiry),
            ]
            for e in r.exceptions
        ],
    )
    pending = _table(
        f"pending reconciliation: {_n(pend.count)} rows, {_usd(pend.reserved_cost_micros)}"
        f" held, oldest {_when(pend.oldest)}",
        ["state", "reason", "count", "reserved cost held", "oldest"],
        [
            [p.state, p.reason or "–", _n(p.count), _usd(p.reserved_cost_micros), _when(p.oldest)]
            for p in r.pending
        ],
    )
    sections = (
        ("workload", r.spend_by_workload),
        ("route", r.spend_by_route),
        ("model", r.spend_by_model),
    )
    spend = [
        _table(
            f"spend by {name}",
            [name, "requests started", "answered", "attempts", "spend", "held", "output tokens"],
            [
                [
                    s.key or "–",
                    _n(s.requests),
                    _n(s.answered),
                    _n(s.attempts),
                    _usd(s.cost_micros),
                    _usd(s.held_micros),
                    _n(s.output_tokens),
                ]
                for s in rows
            ],
        )
        for name, rows in sections
    ]
    return [exceptions, pending, *spend]


def template_environment() -> Environment:
    env = Environment(
        loader=PackageLoader("ncap.reports", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
    )
    env.filters.update(
        n=_n, usd=_usd, when=_when, req=_req, pct=_pct, chg=_chg, money=_chart_usd, cnt=_plain_count
    )
    return env


def charts(r: Report) -> dict[str, Markup]:
    """The report's SVG charts, keyed by section."""
    overall = next((s for s in r.shift if s.workload_id == "*"), None)
    mix: list[tuple[str, float, float]] = []
    if overall:
        cur_n = sum(overall.current.values()) or 1
        prev_n = sum(overall.previous.values()) or 1
        buckets = sorted(set(overall.current) | set(overall.previous), key=_bucket_order)
        mix = [
            (f"n={b}", overall.current.get(b, 0) / cur_n, overall.previous.get(b, 0) / prev_n)
            for b in buckets
        ]
    by_workload: dict[str, int] = defaultdict(int)
    for d in r.distribution:
        if d.requested is not None and d.requested > 1:
            by_workload[d.workload_id] += d.requests
    return {
        "mix": paired_bar_chart("chart-mix", "requested-candidate mix", mix),
        "multi": bar_chart(
            "chart-multi",
            "requests with n > 1 by workload",
            sorted(by_workload.items(), key=lambda kv: -kv[1]),
        ),
        "spend": bar_chart(
            "chart-spend",
            "spend by workload (USD)",
            [(s.key or "–", s.cost_micros / 1e6) for s in r.spend_by_workload],
            fmt=lambda v: f"${v:,.2f}",
        ),
        "output": bar_chart(
            "chart-output",
            "output tokens per request, p95",
            [
                (o.workload_id if o.workload_id != "*" else "all workloads", float(o.p95 or 0))
                for o in r.output
            ],
        ),
        "denials": bar_chart(
            "chart-denials",
            "denials by reason",
            _sum_by((d.reason, d.requests) for d in r.denials),
        ),
        "exceptions": bar_chart(
            "chart-exceptions",
            "exception budget used",
            [(e.id, e.used_fraction) for e in r.exceptions if e.used_fraction is not None],
            fmt=lambda v: f"{v:.0%}",
            limit=1.0,
        ),
    }


def _bucket_order(bucket: str) -> tuple[int, int]:
    return (0, 0) if bucket == "omitted" else (1, int(bucket))


def _sum_by(pairs: Iterable[tuple[str, int]]) -> list[tuple[str, float]]:
    sums: dict[str, int] = defaultdict(int)
    for key, value in pairs:
        sums[key] += value
    return sorted(((k, float(v)) for k, v in sums.items()), key=lambda kv: -kv[1])


def render_html(
    report: Report, *, dashboard: dict[str, Any] | None = None, timeline: Timeline | None = None
) -> str:
    """One self-contained page; ``dashboard`` adds the window picker and sign-out,
    ``timeline`` the time views (series, changes, budgets, pending by route)."""
    template = template_environment().get_template("report.html")
    return template.render(
        r=report,
        charts=charts(report),
        dashboard=dashboard,
        t=timeline,
        tc=timeline_charts(timeline) if timeline else None,
    )


def _chart_usd(v: float) -> str:
    """Micro-USD for a chart: cents from a dollar up, four decimals below."""
    usd = v / 1e6
    return f"${usd:,.2f}" if usd >= 1 else f"${usd:.4f}"


def _chg(value: float | None) -> str:
    return "new" if value is None else f"{value:+.0%}"


def timeline_charts(t: Timeline) -> dict[str, Any]:
    """Small multiples (one column chart per workload) for each metric, the budgets,
    the spend by candidate count and the pending rows by workload and route."""
    out: dict[str, Any] = {}
    for metric in ("requests", "denials", "spend"):
        fmt = _chart_usd if metric == "spend" else _plain_count
        out[metric] = [
            {
                "workload": s.workload_id,
                "series": s,
                "chart": column_series(
                    f"series-{metric}-{i}",
                    f"{metric} of {s.workload_id}",
                    [(p.bucket, p.value, p.previous, p.flagged) for p in s.points],
                    fmt=fmt,
                    width=440,
                ),
            }
            for i, s in enumerate(x for x in t.series if x.metric == metric)
        ]
    out["budgets"] = budget_chart(
        "chart-budgets",
        "budget limits against spend and holds",
        [
            (
                f"{b.workload_id} · {b.window} {b.period}",
                b.spent_micros,
                b.held_micros,
                b.limit_micros,
                b.status,
            )
            for b in t.budgets
        ],
    )
    out["budget_days"] = [
        {
            "budget": b,
            "chart": column_series(
                f"budget-days-{i}",
                f"daily spend and holds of {b.workload_id} against its day budget",
                [
                    (d, float(spent + held), 0.0, spent + held >= b.limit_micros)
                    for d, spent, held in b.days
                ],
                fmt=_chart_usd,
                width=440,
                limit=float(b.limit_micros),
                previous=False,
            ),
        }
        for i, b in enumerate(x for x in t.budgets if x.days)
    ]
    out["by_candidates"] = paired_bar_chart(
        "chart-by-candidates",
        "spend by requested candidate count (share of spend)",
        _shares(t.by_candidates),
    )
    out["pending"] = bar_chart(
        "chart-pending-by-route",
        "pending reconciliation by workload and route",
        [(f"{c.workload_id} · {c.route_id or '–'}", float(c.count)) for c in t.pending],
    )
    return out


def _plain_count(v: float) -> str:
    return f"{v:,.0f}"


def _shares(rows: Sequence[CandidateSpend]) -> list[tuple[str, float, float]]:
    now = sum(r.spend_micros for r in rows) or 1
    before = sum(r.previous_spend_micros for r in rows) or 1
    return [
        (f"n={r.requested}", r.spend_micros / now, r.previous_spend_micros / before) for r in rows
    ]
