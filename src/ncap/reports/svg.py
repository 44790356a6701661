"""Server-side SVG charts for the HTML report and the dashboard (no JavaScript, no CDN).

Every label goes through ``markupsafe.escape``; numbers are formatted here. Each bar
carries ``data-label`` and ``data-value`` so a test (or a curious operator) can read
the chart's numbers from the DOM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from markupsafe import Markup, escape

__all__ = ["bar_chart", "budget_chart", "column_series", "paired_bar_chart"]

_ROW = 22
_LABEL_W = 190
_VALUE_W = 110


def _plain(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.3f}"


def bar_chart(
    chart_id: str,
    title: str,
    bars: Sequence[tuple[str, float]],
    *,
    fmt: Callable[[float], str] = _plain,
    width: int = 640,
    limit: float | None = None,
) -> Markup:
    """Horizontal bars, longest = full width (or ``limit`` when given, drawn as a line)."""
    if not bars:
        return Markup('<p class="empty">no data</p>')
    top = max([limit or 0.0, *(v for _, v in bars)]) or 1.0
    label_w = _label_width(label for label, _ in bars)
    span = width - label_w - _VALUE_W
    height = _ROW * len(bars) + 8
    parts = [
        f'<svg id="{escape(chart_id)}" class="chart" role="img" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">'
        f"<title>{escape(title)}</title>"
    ]
    for i, (label, value) in enumerate(bars):
        y = 4 + i * _ROW
        w = max(1.0, span * value / top) if value > 0 else 0.0
        parts.append(
            f'<g class="bar" data-label="{escape(label)}" data-value="{value}">'
            f"<title>{escape(label)}: {escape(fmt(value))}</title>"
            f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end">'
            f"{escape(_clip(label, label_w))}</text>"
            f'<rect x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{_ROW - 6}" rx="2"/>'
            f'<text x="{label_w + w + 6:.1f}" y="{y + 15}">{escape(fmt(value))}</text></g>'
        )
    if limit:
        x = label_w + span * limit / top
        parts.append(f'<line class="limit" x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="{height}"/>')
    parts.append("</svg>")
    return Markup("".join(parts))


def paired_bar_chart(
    chart_id: str,
    title: str,
    rows: Sequence[tuple[str, float, float]],
    *,
    names: tuple[str, str] = ("this window", "previous"),
    width: int = 640,
) -> Markup:
    """Two bars per label (shares in 0..1): this window against the previous one."""
    if not rows:
        return Markup('<p class="empty">no data</p>')
    top = max(max(a, b) for _, a, b in rows) or 1.0
    span = width - _LABEL_W - _VALUE_W
    pair = _ROW * 2
    height = pair * len(rows) + 30
    parts = [
        f'<svg id="{escape(chart_id)}" class="chart" role="img" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">'
        f"<title>{escape(title)}</title>"
        f'<rect class="key-a" x="{_LABEL_W}" y="4" width="12" height="12"/>'
        f'<text x="{_LABEL_W + 16}" y="15">{escape(names[0])}</text>'
        f'<rect class="key-b" x="{_LABEL_W + 130}" y="4" width="12" height="12"/>'
        f'<text x="{_LABEL_W + 146}" y="15">{escape(names[1])}</text>'
    ]
    for i, (label, a, b) in enumerate(rows):
        y = 26 + i * pair
        parts.append(
            f'<g class="pair" data-label="{escape(label)}">'
            f'<text x="{_LABEL_W - 6}" y="{y + 22}" text-anchor="end">{escape(_clip(label))}</text>'
        )
        for j, (cls, value) in enumerate((("a", a), ("b", b))):
            w = max(1.0, span * value / top) if value > 0 else 0.0
            yy = y + j * (_ROW - 4)
            parts.append(
                f'<rect class="bar-{cls}" data-value="{value}" x="{_LABEL_W}" y="{yy}" '
                f'width="{w:.1f}" height="{_ROW - 8}" rx="2"/>'
                f'<text x="{_LABEL_W + w + 6:.1f}" y="{yy + 12}">{value:.1%}</text>'
            )
        parts.append("</g>")
    parts.append("</svg>")
    return Markup("".join(parts))


_CHAR_W = 7.2  # px per character of the 12px chart font (a generous average)


def _label_width(labels: Iterable[str]) -> int:
    """Room for the longest label (denial reasons run to 30-odd characters), within
    bounds so the bars keep most of the width."""
    longest = max((len(label) for label in labels), default=0)
    return int(min(max(_LABEL_W, longest * _CHAR_W + 14), 340))


def _clip(label: str, label_w: int = _LABEL_W) -> str:
    """Cut only what does not fit the label column (the full text is in the <title>)."""
    size = round((label_w - 14) / _CHAR_W)
    return label if len(label) <= size else label[: size - 1] + "…"


def column_series(
    chart_id: str,
    title: str,
    points: Sequence[tuple[str, float, float, bool]],
    *,
    fmt: Callable[[float], str] = _plain,
    width: int = 640,
    height: int = 150,
    limit: float | None = None,
    previous: bool = True,
) -> Markup:
    """Columns over time (bucket, value, previous, flagged): this window's values as
    columns, the previous window's as a grey step line over them (unless
    ``previous`` is False), a flagged bucket in red with its change written above it,
    ``limit`` as a dashed horizontal line."""
    if not points:
        return Markup('<p class="empty">no data</p>')
    top = max([limit or 0.0, *(max(v, p) for _, v, p, _ in points)]) or 1.0
    left, bottom, head = 70, 22, 18
    plot_w, plot_h = width - left - 8, height - bottom - head
    step = plot_w / len(points)
    every = max(1, round(len(points) / 8))  # at most about 8 axis labels

    def y(value: float) -> float:
        return head + plot_h * (1 - value / top)

    parts = [
        f'<svg id="{escape(chart_id)}" class="chart series" role="img" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">'
        f"<title>{escape(title)}</title>"
        f'<text x="{left - 6}" y="{head + 4}" text-anchor="end">{escape(fmt(top))}</text>'
        f'<text x="{left - 6}" y="{head + plot_h}" text-anchor="end">0</text>'
        f'<line class="axis" x1="{left}" x2="{width - 8}" y1="{head + plot_h}" '
        f'y2="{head + plot_h}"/>'
    ]
    previous_path = []
    for i, (bucket, value, before, flagged) in enumerate(points):
        x = left + i * step
        cls = "col flag" if flagged else "col"
        parts.append(
            f'<g class="{cls}" data-bucket="{escape(bucket)}" data-value="{value}" '
            f'data-previous="{before}" data-flag="{str(flagged).lower()}">'
            f"<title>{escape(bucket)}: {escape(fmt(value))} (previous {escape(fmt(before))})"
            f"</title>"
            f'<rect x="{x + 1:.1f}" y="{y(value):.1f}" width="{max(step - 2, 1):.1f}" '
            f'height="{head + plot_h - y(value):.1f}"/>'
        )
        if flagged and previous:
            change = "new" if not before else f"{(value - before) / before:+.0%}"
            parts.append(
                f'<text class="flag" x="{x + step / 2:.1f}" y="{max(y(value) - 3, 11):.1f}" '
                f'text-anchor="middle">{escape(change)}</text>'
            )
        parts.append("</g>")
        previous_path.append(f"{x:.1f},{y(before):.1f} {x + step:.1f},{y(before):.1f}")
        if i % every == 0:
            parts.append(
                f'<text class="tick" x="{x + step / 2:.1f}" y="{height - 6}" '
                f'text-anchor="middle">{escape(_short(bucket))}</text>'
            )
    if previous:
        parts.append(f'<polyline class="previous" points="{" ".join(previous_path)}"/>')
    if limit:
        parts.append(
            f'<line class="limit" x1="{left}" x2="{width - 8}" y1="{y(limit):.1f}" '
            f'y2="{y(limit):.1f}"/>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def _short(bucket: str) -> str:
    """``2026-12-01`` -> ``12-01``; ``2026-12-01T14`` -> ``14h``."""
    return f"{bucket[11:13]}h" if "T" in bucket else bucket[5:]


def budget_chart(
    chart_id: str,
    title: str,
    rows: Sequence[tuple[str, int, int, int, str]],
    *,
    width: int = 640,
) -> Markup:
    """One bar per budget (label, spent, held, limit, status), each on its own scale:
    spent and held stacked against the limit line, the share used written after it."""
    if not rows:
        return Markup('<p class="empty">no USD budget configured</p>')
    label_w = _label_width(label for label, *_ in rows)
    span = width - label_w - 150
    parts = [
        f'<svg id="{escape(chart_id)}" class="chart budgets" role="img" width="{width}" '
        f'height="{_ROW * len(rows) + 8}" viewBox="0 0 {width} {_ROW * len(rows) + 8}" '
        f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>'
    ]
    for i, (label, spent, held, limit, status) in enumerate(rows):
        y = 4 + i * _ROW
        top = max(limit, spent + held) * 1.1 or 1
        ws, wh, wl = span * spent / top, span * held / top, span * limit / top
        used = (spent + held) / limit if limit else 0.0
        parts.append(
            f'<g class="budget {escape(status)}" data-label="{escape(label)}" '
            f'data-spent="{spent}" data-held="{held}" data-limit="{limit}" '
            f'data-status="{escape(status)}"><title>{escape(label)}: {status}</title>'
            f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end">'
            f"{escape(_clip(label, label_w))}</text>"
            f'<rect class="spent" x="{label_w}" y="{y + 2}" width="{ws:.1f}" '
            f'height="{_ROW - 6}"/>'
            f'<rect class="held" x="{label_w + ws:.1f}" y="{y + 2}" width="{wh:.1f}" '
            f'height="{_ROW - 6}"/>'
            f'<line class="limit" x1="{label_w + wl:.1f}" x2="{label_w + wl:.1f}" y1="{y}" '
            f'y2="{y + _ROW}"/>'
            f'<text x="{label_w + span + 8}" y="{y + 15}">{used:.0%} · {escape(status)}</text>'
            "</g>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))
