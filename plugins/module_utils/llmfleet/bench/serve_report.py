"""The serving benchmark's report: Markdown tables and a hand-written SVG chart (latency and
throughput against concurrency), from servebench's results dict. Standard library only, Python >= 3.8."""

from __future__ import annotations

import math
from typing import Any
from xml.sax.saxutils import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
LATENCY_COLUMNS = [(m, p) for m in ("ttft", "tpot", "itl", "e2e") for p in (50, 95, 99)]
_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}


def fmt(x: float | None) -> str:
    """A number with about 3 significant digits, no exponent ("-" for none)."""
    if x is None:
        return "-"
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def cell(s: dict[str, Any] | None) -> str:
    """`median (min-max)`; the median alone when the rounds agree or there is one."""
    if not s:
        return "-"
    med, lo, hi = fmt(s["median"]), fmt(s["min"]), fmt(s["max"])
    return med if lo == hi else f"{med} ({lo}-{hi})"


def _success(c: dict[str, Any]) -> str:
    if not c.get("requests"):
        return "-"
    return f"{c['completed']}/{c['requests']} ({100.0 * c['completed'] / c['requests']:.1f}%)"


def render_tables(results: dict[str, Any]) -> str:
    """The two tables and the problem list (the terminal output of `llmfleet bench`)."""
    cases = results.get("cases", [])
    gpus = (results.get("settings") or {}).get("gpus")
    lines = [
        "## Throughput and success",
        "",
        "| input | output | concurrency | status | success (all rounds) | output tok/s | req/s | GPU-h / 1M out tok |",
        "|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for c in cases:
        s = c.get("summary") or {}
        cost = cell(s.get("gpu_h_per_mtok")) if gpus else "(--gpus not given)"
        lines.append(
            f"| {c['input_len']} | {c['output_len']} | {c['concurrency']} | {c['status']} | {_success(c)} "
            f"| {cell(s.get('output_tok_s'))} | {cell(s.get('request_s'))} | {cost} |"
        )
    lines += [
        "",
        "## Latency (ms)",
        "",
        "| input | output | concurrency | " + " | ".join(f"{_NAMES[m]} p{p}" for m, p in LATENCY_COLUMNS) + " |",
        "|---:|---:|---:|" + "---:|" * len(LATENCY_COLUMNS),
    ]
    for c in cases:
        s = c.get("summary") or {}
        cells = " | ".join(cell(s.get(f"{m}_ms_p{p}")) for m, p in LATENCY_COLUMNS)
        lines.append(f"| {c['input_len']} | {c['output_len']} | {c['concurrency']} | {cells} |")
    problems = [f"- `{c['id']}` {c['status']}: {c['why']}" for c in cases if c["status"] != "OK"]
    problems += [f"- `{c['id']}` warning: {w}" for c in cases for w in c.get("warnings", [])]
    if problems:
        lines += ["", "## Problems", "", *problems]
    return "\n".join(lines) + "\n"


def render_markdown(results: dict[str, Any], svg: str) -> str:
    """The whole report: what ran and how, the tables, the chart inline, where the raw outputs are."""
    st = results.get("settings") or {}
    ep = results.get("endpoint") or {}
    method = results.get("method") or {}
    cases = results.get("cases", [])
    n_ok = sum(1 for c in cases if c["status"] == "OK")
    version = f" {ep['version']}" if ep.get("version") else ""
    rows = [
        ("endpoint", f"{st.get('base_url')} ({st.get('engine')}{version}{' from /version' if version else ''})"),
        ("model / tokenizer", f"`{st.get('model')}` / `{st.get('tokenizer')}`"),
        ("tool", f"`{method.get('tool')}`"),
        ("prompts", f"{method.get('prompts')}; EOS ignored ({method.get('eos')}); temperature 0; {method.get('api')}"),
        ("load", f"{method.get('arrival')}; requests per round per case in results.json"),
        ("rounds", f"{st.get('rounds')} per case, after a separate warm-up run per case (not aggregated)"),
        ("GPUs", str(st.get("gpus")) if st.get("gpus") else "not given (no cost column)"),
        ("started / wall", f"{results.get('started')} / {fmt(results.get('wall_s'))} s"),
        ("result", f"{n_ok} of {len(cases)} cases OK"),
    ]
    if results.get("command"):
        rows.append(("command", f"`{results['command']}`"))
    out = [
        f"# Serving benchmark: {st.get('engine')} at {st.get('base_url')}",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
        "Each cell: median over rounds (min-max). Success: completed / sent over all rounds (a failed request "
        "stays in the denominator). Latencies: the tool's own percentiles over the requests that succeeded.",
        "",
        render_tables(results).rstrip("\n"),
        "",
        "## Chart",
        "",
        "Also in `chart.svg` (GitHub's Markdown view strips inline SVG).",
        "",
        svg.strip(),
        "",
        "## Raw outputs",
        "",
        "`raw/<case>.warmup.*` and `raw/<case>.r<N>.*`: each run's result file as the tool wrote it and its "
        "stdout+stderr (`.log`); the exact argv of every run is in `results.json`.",
        "",
    ]
    return "\n".join(out)


# ---- SVG ------------------------------------------------------------------------------------------------


def _nice_top(vmax: float) -> tuple[float, float]:
    """(axis top, tick step) with about 5 round-number ticks."""
    if vmax <= 0 or not math.isfinite(vmax):
        return 1.0, 0.2
    raw = vmax / 5.0
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return step * math.ceil(vmax / step - 1e-9), step


def _series(results: dict[str, Any]) -> tuple[list[int], list[tuple[tuple[int, int], list[dict[str, Any]]]]]:
    cases = results.get("cases", [])
    xs = sorted({c["concurrency"] for c in cases})
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for c in cases:
        groups.setdefault((c["input_len"], c["output_len"]), []).append(c)
    return xs, [(k, sorted(v, key=lambda c: c["concurrency"])) for k, v in sorted(groups.items())]


def _panel(  # noqa: PLR0917 (the panel's box, title and data)
    x0: float, y0: float, w: float, h: float, title: str, xs: list[int], lines: list[dict[str, Any]]
) -> list[str]:
    """One plot: axes, ticks, grid, and each line's points with min-max bars. A line is
    {"color", "dash", "points": [(concurrency, spread)]}."""
    left, right, top, bottom = 56.0, 12.0, 28.0, 40.0
    pw, ph = w - left - right, h - top - bottom
    px0, py0 = x0 + left, y0 + top
    vmax = max([p[1]["max"] for ln in lines for p in ln["points"]] or [0.0])
    ytop, step = _nice_top(vmax)

    def sx(c: int) -> float:
        i = xs.index(c)
        return px0 + (pw * (i + 0.5) / len(xs) if xs else pw / 2)

    def sy(v: float) -> float:
        return py0 + ph - ph * (v / ytop)

    out = [
        f'<text x="{x0 + w / 2:.1f}" y="{y0 + 16:.1f}" text-anchor="middle" font-weight="bold">{escape(title)}</text>'
    ]
    k = 0
    while k * step <= ytop + 1e-9:
        v = k * step
        y = sy(v)
        out.append(f'<line x1="{px0:.1f}" y1="{y:.1f}" x2="{px0 + pw:.1f}" y2="{y:.1f}" stroke="#e0e0e0"/>')
        out.append(f'<text x="{px0 - 6:.1f}" y="{y + 4:.1f}" text-anchor="end">{escape(_tick(v, step))}</text>')
        k += 1
    out.append(f'<line x1="{px0:.1f}" y1="{py0 + ph:.1f}" x2="{px0 + pw:.1f}" y2="{py0 + ph:.1f}" stroke="#333"/>')
    out.append(f'<line x1="{px0:.1f}" y1="{py0:.1f}" x2="{px0:.1f}" y2="{py0 + ph:.1f}" stroke="#333"/>')
    for c in xs:
        out.append(f'<text x="{sx(c):.1f}" y="{py0 + ph + 16:.1f}" text-anchor="middle">{c}</text>')
    out.append(
        f'<text x="{px0 + pw / 2:.1f}" y="{py0 + ph + 32:.1f}" text-anchor="middle">'
        "concurrency (requests in flight)</text>"
    )
    if not any(ln["points"] for ln in lines):
        out.append(f'<text x="{px0 + pw / 2:.1f}" y="{py0 + ph / 2:.1f}" text-anchor="middle">no data</text>')
    for ln in lines:
        dx = ln.get("dodge", 0.0)  # series side by side, so equal points and bars stay visible
        pts = [(sx(c) + dx, sy(s["median"]), sy(s["min"]), sy(s["max"])) for c, s in ln["points"]]
        dash = ' stroke-dasharray="5,3"' if ln.get("dash") else ""
        if len(pts) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _, _ in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{ln["color"]}" stroke-width="2"{dash}/>')
        for x, y, ylo, yhi in pts:
            if abs(ylo - yhi) > 0.5:
                out.append(f'<line x1="{x:.1f}" y1="{ylo:.1f}" x2="{x:.1f}" y2="{yhi:.1f}" stroke="{ln["color"]}"/>')
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{ln["color"]}"/>')
    return out


def _tick(v: float, step: float) -> str:
    """A tick label with as many decimals as the step needs (0.25 -> 2, 0.5 -> 1, 20 -> 0)."""
    decimals = 0
    while decimals < 6 and abs(step * 10**decimals - round(step * 10**decimals)) > 1e-9:
        decimals += 1
    return f"{v:,.{decimals}f}"


def render_svg(results: dict[str, Any]) -> str:
    """Two panels: output tok/s against concurrency, and latency p50 (E2E solid, TTFT dashed); one
    colour per (input, output) length pair; dots are medians over rounds, bars span min-max."""
    xs, groups = _series(results)
    width, height = 960, 400
    panel_w, panel_h = width / 2, height - 56

    def line(cases: list[dict[str, Any]], key: str, color: str, dodge: float, dash: bool = False) -> dict[str, Any]:
        pts = [(c["concurrency"], (c.get("summary") or {}).get(key)) for c in cases]
        return {"color": color, "dash": dash, "dodge": dodge, "points": [(x, s) for x, s in pts if s]}

    thr, lat = [], []
    legend = []
    for k, ((i, o), cases) in enumerate(groups):
        color = PALETTE[k % len(PALETTE)]
        dodge = 4.0 * (k - (len(groups) - 1) / 2.0)
        thr.append(line(cases, "output_tok_s", color, dodge))
        lat.append(line(cases, "e2e_ms_p50", color, dodge))
        lat.append(line(cases, "ttft_ms_p50", color, dodge, dash=True))
        legend.append((color, f"input {i} / output {o} tokens"))
    st = results.get("settings") or {}
    body = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'font-family="sans-serif" font-size="11">',
        "<title>" + escape(f"{st.get('engine')} serving benchmark: throughput and latency vs concurrency") + "</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        *_panel(0, 0, panel_w, panel_h, "Output throughput (tok/s)", xs, thr),
        *_panel(panel_w, 0, panel_w, panel_h, "Latency p50 (ms): E2E solid, TTFT dashed", xs, lat),
    ]
    lx, ly = 56.0, height - 30.0
    for color, label in legend:
        body.append(f'<rect x="{lx:.1f}" y="{ly - 9:.1f}" width="14" height="10" fill="{color}"/>')
        body.append(f'<text x="{lx + 18:.1f}" y="{ly:.1f}">{escape(label)}</text>')
        lx += 30 + 6.2 * len(label)
        if lx > width - 150:
            lx, ly = 56.0, ly + 16
    body.append(
        f'<text x="{width - 12}" y="{height - 8}" text-anchor="end" fill="#666">'
        "dots: median over rounds; bars: min-max</text>"
    )
    body.append("</svg>")
    return "\n".join(body) + "\n"
