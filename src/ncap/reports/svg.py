"""Server-side SVG charts for the HTML report and the dashboard (no JavaScript, no CDN).

Every label goes through ``markupsafe.escape``; numbers are formatted here. Each bar
carries ``data-label`` and ``data-value`` so a test (or a curious operator) can read
the chart's numbers from the DOM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from markupsafe import Markup, escape

__all__ = ["bar_chart", "paired_bar_chart"]

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
    size = int((label_w - 14) / _CHAR_W)
    return label if len(label) <= size else label[: size - 1] + "…"
