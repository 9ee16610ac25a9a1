"""Inline SVG charts of the deployment report: the cold-start timeline per node and the benchmark's
throughput per case. Plain strings (no scripts, no external references); every text from a record is
XML-escaped here, since the page embeds the SVG as markup."""

from __future__ import annotations

import math
from html import escape
from typing import Any

from .sections import API_EVENTS, EVENT_LABELS, NODE_EVENTS

# Colour-blind-safe (Okabe-Ito) per event; the bars between events are lighter.
EVENT_COLOURS = {
    "unit_start": "#000000",
    "weights_loaded": "#0072B2",
    "node_ready": "#E69F00",
    "port_open": "#56B4E9",
    "models_listed": "#009E73",
    "first_correct_answer": "#D55E00",
    "kv_transfer_proven": "#CC79A7",
}
SEGMENTS = (  # (from, to, colour, what the bar means)
    ("unit_start", "weights_loaded", "#9ecae1", "start to weights loaded"),
    ("weights_loaded", "node_ready", "#fdd49e", "weights loaded to ready"),
)
API_BAR = "#d9d9d9"
FONT = 'font-family="sans-serif" font-size="12"'


def nice_top(v: float) -> tuple[float, float]:
    """(axis end, tick step): the smallest 1/2/5 x 10^k step with at most 6 ticks covering v."""
    v = max(v, 1e-9)
    for k in range(math.floor(math.log10(v)) - 1, math.floor(math.log10(v)) + 2):
        for m in (1, 2, 5):
            step = m * 10.0**k
            if v / step <= 6:
                return math.ceil(v / step - 1e-9) * step, step
    return v, v


def _tick(v: float) -> str:
    return f"{v:g}" if abs(v) >= 1 or v == 0 else f"{v:.2g}"


def _axis(x0: float, width: float, top: float, bottom: float, *, end: float, step: float, unit: str) -> list[str]:
    out = []
    n = round(end / step)
    for i in range(n + 1):
        x = x0 + width * i / n
        out.append(f'<line x1="{x:.1f}" y1="{top:.1f}" x2="{x:.1f}" y2="{bottom:.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{x:.1f}" y="{top - 6:.1f}" text-anchor="middle" {FONT}>{_tick(step * i)}</text>')
    out.append(f'<text x="{x0 + width:.1f}" y="{top - 20:.1f}" text-anchor="end" {FONT}>{escape(unit)}</text>')
    return out


def timeline_svg(gate: dict[str, Any], width: int = 900) -> str:
    """One row per node: bars from unit start to weights loaded to ready, then the API's port, models and
    first correct answer on the row of the unit serving the API; a marker (with a tooltip) per event."""
    rows = gate.get("rows") or []
    left, right, top, row_h = 170, 20, 40, 30
    plot_w = width - left - right
    end, step = nice_top(max(gate.get("end") or 0.0, 1.0))
    height = top + row_h * max(len(rows), 1) + 56

    def sx(t: float) -> float:
        return left + plot_w * min(max(t, 0.0), end) / end

    out = [
        f'<svg class="chart timeline" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" data-chart="timeline" data-gate="{escape(gate.get("label", ""))}">',
        f"<title>Cold-start timeline of {escape(gate.get('label', ''))}, seconds from the first unit start</title>",
        *_axis(
            left,
            plot_w,
            top,
            top + row_h * max(len(rows), 1),
            end=end,
            step=step,
            unit="seconds from the first unit start",
        ),
    ]
    for i, row in enumerate(rows):
        y = top + i * row_h
        ev = row["events"]
        node = escape(str(row["node"]))
        out.append(f'<text x="{left - 8}" y="{y + row_h / 2 + 4:.1f}" text-anchor="end" {FONT}>{node}</text>')
        for a, b, colour, what in SEGMENTS:
            if a in ev and b in ev:
                out.append(
                    f'<rect x="{sx(ev[a]):.1f}" y="{y + 8}" width="{max(sx(ev[b]) - sx(ev[a]), 1):.1f}" height="14" '
                    f'fill="{colour}"><title>{node}: {what}, {ev[b] - ev[a]:.1f} s</title></rect>'
                )
        api = [k for k, _ in API_EVENTS if k in ev]
        if api:
            start = ev.get("node_ready", max((ev[k] for k, _ in NODE_EVENTS if k in ev), default=0.0))
            last = max(ev[k] for k in api)
            out.append(
                f'<rect x="{sx(start):.1f}" y="{y + 12}" width="{max(sx(last) - sx(start), 1):.1f}" height="6" '
                f'fill="{API_BAR}"><title>{node}: API up to the first correct answer</title></rect>'
            )
        if row.get("failed"):
            last = max(ev.values(), default=0.0)
            out.append(
                f'<text x="{sx(last) + 9:.1f}" y="{y + 19}" fill="#b30000" font-weight="bold" {FONT} '
                f'data-node="{node}" data-failed="true">\u2715 failed</text>'
            )
        for key, label in EVENT_LABELS.items():
            if key in ev:
                out.append(
                    f'<circle cx="{sx(ev[key]):.1f}" cy="{y + 15}" r="5" fill="{EVENT_COLOURS[key]}" stroke="#fff" '
                    f'data-node="{node}" data-event="{key}" data-seconds="{ev[key]:.2f}">'
                    f"<title>{node}: {escape(label)} at {ev[key]:.2f} s</title></circle>"
                )
    ly = top + row_h * max(len(rows), 1) + 24
    x = left
    for key, label in EVENT_LABELS.items():
        out.append(f'<circle cx="{x + 5}" cy="{ly - 4}" r="5" fill="{EVENT_COLOURS[key]}"/>')
        out.append(f'<text x="{x + 14}" y="{ly}" {FONT}>{escape(label)}</text>')
        x += 14 + 7 * len(label) + 16
    out.append("</svg>")
    return "\n".join(out)


def bench_svg(cases: list[dict[str, Any]], width: int = 900) -> str:
    """Median output tokens/s per case as a bar, the rounds' min-max as a whisker; cases that are not OK
    are labelled with their status instead."""
    left, right, top, row_h = 170, 90, 40, 26
    plot_w = width - left - right
    vals = [c["out_tok_s"]["max"] or c["out_tok_s"]["median"] or 0.0 for c in cases]
    end, step = nice_top(max([*vals, 1.0]))
    height = top + row_h * max(len(cases), 1) + 20

    def sx(v: float) -> float:
        return left + plot_w * min(max(v, 0.0), end) / end

    out = [
        f'<svg class="chart bench" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" data-chart="bench">',
        "<title>Output tokens per second per case (median over rounds, whisker min to max)</title>",
        *_axis(
            left,
            plot_w,
            top,
            top + row_h * max(len(cases), 1),
            end=end,
            step=step,
            unit="output tokens/s (median, min-max)",
        ),
    ]
    for i, c in enumerate(cases):
        y = top + i * row_h
        cid = escape(str(c["id"]))
        out.append(f'<text x="{left - 8}" y="{y + row_h / 2 + 4:.1f}" text-anchor="end" {FONT}>{cid}</text>')
        med, lo, hi = c["out_tok_s"]["median"], c["out_tok_s"]["min"], c["out_tok_s"]["max"]
        if c["status"] != "OK" or med is None:
            out.append(
                f'<text x="{left + 4}" y="{y + row_h / 2 + 4:.1f}" fill="#b30000" {FONT} data-case="{cid}">'
                f"{escape(str(c['status']))}</text>"
            )
            continue
        out.append(
            f'<rect x="{left}" y="{y + 5}" width="{max(sx(med) - left, 1):.1f}" height="{row_h - 10}" fill="#0072B2" '
            f'data-case="{cid}" data-median="{med:.2f}"><title>{cid}: {med:.1f} tokens/s (median)</title></rect>'
        )
        if lo is not None and hi is not None:
            yc = y + row_h / 2
            out.append(f'<line x1="{sx(lo):.1f}" y1="{yc:.1f}" x2="{sx(hi):.1f}" y2="{yc:.1f}" stroke="#000"/>')
            for v in (lo, hi):
                x = sx(v)
                out.append(f'<line x1="{x:.1f}" y1="{yc - 5:.1f}" x2="{x:.1f}" y2="{yc + 5:.1f}" stroke="#000"/>')
        out.append(f'<text x="{sx(max(hi or med, med)) + 6:.1f}" y="{y + row_h / 2 + 4:.1f}" {FONT}>{med:.1f}</text>')
    out.append("</svg>")
    return "\n".join(out)
