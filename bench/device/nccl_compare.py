#!/usr/bin/env python3
"""Side by side: the NCCL check's own timings (values checked after the timed loop) against nccl-tests
built against the same NCCL, per op, dtype and size; prints a markdown table and the performance goals
(busbw >= 0.9x nccl-tests from 64 KiB, >= 0.95x from 16 MiB, 8 B latency <= 1.5x).

    python3 bench/device/nccl_compare.py --nccl-tests DIR --ours OURS.json [--ours-eager EAGER.json]

DIR holds nccl-tests' stdout as <op>-<dtype>-<eager|graph>.txt (graph: run with -G 1). The ratio is
nccl-tests' time / ours (= our busbw / theirs; also defined for one GPU, where busbw is 0 by
nccl-tests' formula). nccl-tests' column is the placement the check uses: in-place all_reduce and
broadcast (torch reduces and broadcasts in place), out-of-place all_gather and send/recv.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

IN_PLACE = {"all_reduce": True, "broadcast": True, "all_gather": False, "sendrecv": False}
DTYPE = {"fp32": "float", "bf16": "bfloat16"}
KIB, MIB = 1024, 1024**2


def parse_nccl_tests(text: str) -> dict[int, dict[str, float | str]]:
    """{bytes: {time_us, algbw, busbw, wrong, ...}} of each placement from nccl-tests' text output."""
    rows: dict[int, dict[str, float | str]] = {}
    for line in text.splitlines():
        t = line.split()
        if line.startswith("#") or len(t) < 13 or not t[0].isdigit():
            continue
        rows[int(t[0])] = {"oop_time_us": float(t[5]), "oop_busbw": float(t[7]), "oop_wrong": t[8],
                           "ip_time_us": float(t[9]), "ip_busbw": float(t[11]), "ip_wrong": t[12]}  # fmt: skip
    return rows


def ours(path: Path | None) -> dict[tuple[str, str, int], dict]:
    if path is None or not path.exists():
        return {}
    d = json.loads(path.read_text())
    r0 = next(r for r in d["ranks"] if r.get("rank") == 0)
    return {(x["op"], x["dtype"], x["bytes"]): {**x, "world": r0.get("world", 0)} for x in r0.get("results", [])
            if "time_us" in x}  # fmt: skip


def compare(nt_dir: Path, mine: dict, eager: dict) -> tuple[list[dict], list[str]]:
    rows = []
    for (op, dt, size), x in sorted(mine.items(), key=lambda kv: (list(IN_PLACE).index(kv[0][0]), kv[0][1], kv[0][2])):
        place = "ip" if IN_PLACE[op] else "oop"
        ref = {}
        for mode in ("eager", "graph"):
            f = nt_dir / f"{op}-{DTYPE[dt]}-{mode}.txt"
            ref[mode] = parse_nccl_tests(f.read_text()).get(size) if f.exists() else None
        nt = ref["eager"]
        row = {"op": op, "dtype": dt, "bytes": size, "world": x["world"], "ours_us": x["time_us"],
               "ours_busbw": x["busbw_GBps"],
               "wrong": x["wrong"], "timing": x.get("timing", "?"),
               "ours_eager_us": (eager.get((op, dt, size)) or {}).get("time_us")}  # fmt: skip
        if nt:
            row.update(nt_us=nt[f"{place}_time_us"], nt_busbw=nt[f"{place}_busbw"], nt_wrong=nt[f"{place}_wrong"])
            row["ratio"] = row["nt_us"] / x["time_us"] if x["time_us"] else None
        if ref["graph"]:
            row["ntg_us"] = ref["graph"][f"{place}_time_us"]
            row["ratio_g"] = row["ntg_us"] / x["time_us"] if x["time_us"] else None
        rows.append(row)
    return rows, goals(rows)


def goals(rows: list[dict]) -> list[str]:
    """One line per goal and op: met or missed, with the worst figure and where."""
    out = []
    world = max([r.get("world", 0) for r in rows] + [0])
    for op, in_place in IN_PLACE.items():
        mine = [r for r in rows if r["op"] == op and r.get("ratio")]
        if world == 1 and in_place:
            out.append(f"{op}: not judged at 1 rank (in place, NCCL has nothing to move)")
            continue
        if not mine:
            out.append(f"{op}: no side-by-side numbers")
            continue
        for lo, floor in ((64 * KIB, 0.9), (16 * MIB, 0.95)):
            sel = [r for r in mine if r["bytes"] >= lo]
            if sel:
                w = min(sel, key=lambda r: r["ratio"])
                verdict = "met" if w["ratio"] >= floor else "MISSED"
                out.append(f"{op}: busbw >= {floor}x nccl-tests from {lo // KIB} KiB: {verdict} "
                           f"(worst {w['ratio']:.2f}x at {w['bytes']} B {w['dtype']})")  # fmt: skip
        smallest = min(r["bytes"] for r in mine)
        lat = [r["ours_us"] / r["nt_us"] for r in mine if r["bytes"] == smallest]
        verdict = "met" if max(lat) <= 1.5 else "MISSED"
        out.append(f"{op}: latency at {smallest} B <= 1.5x nccl-tests: {verdict} (worst {max(lat):.2f}x)")
    return out


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    head = ("| op | dtype | bytes | nccl-tests µs | nccl-tests -G µs | check µs | check eager µs | nccl-tests busbw "
            "| check busbw | ratio | ratio vs -G | wrong (check / nccl-tests) |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")  # fmt: skip
    body = "".join(
        f"| {r['op']} | {r['dtype']} | {r['bytes']} | {fmt(r.get('nt_us'))} | {fmt(r.get('ntg_us'))} | "
        f"{fmt(r['ours_us'])} | {fmt(r.get('ours_eager_us'))} | {fmt(r.get('nt_busbw'))} | {fmt(r['ours_busbw'])} | "
        f"{fmt(r.get('ratio'))} | {fmt(r.get('ratio_g'))} | {r['wrong']} / {r.get('nt_wrong', '')} |\n"
        for r in rows
    )
    return head + body


def wide_table(rows: list[dict]) -> str:
    """One row per message size (bytes per rank), one column per op and dtype: ratio (check us / nccl-tests us)."""
    cols = sorted(
        {(r["op"], r["dtype"]) for r in rows if r.get("ratio")}, key=lambda c: (list(IN_PLACE).index(c[0]), c[1])
    )
    cells: dict[int, dict] = {}
    for r in rows:
        if r.get("ratio"):
            per_rank = r["bytes"] // max(1, r["world"]) if r["op"] == "all_gather" else r["bytes"]
            cells.setdefault(per_rank, {})[(r["op"], r["dtype"])] = (
                f"{r['ratio']:.2f} ({r['ours_us']:.1f} / {r['nt_us']:.1f})"
            )
    head = "| bytes per rank | " + " | ".join(f"{op} {dt}" for op, dt in cols) + " |\n"
    head += "|---:|" + "---:|" * len(cols) + "\n"
    return head + "".join(f"| {b} | " + " | ".join(cells[b].get(c, "") for c in cols) + " |\n" for b in sorted(cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nccl-tests", type=Path, required=True)
    ap.add_argument("--ours", type=Path, required=True)
    ap.add_argument("--ours-eager", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--wide", action="store_true", help="one row per size, one ratio column per op and dtype")
    a = ap.parse_args()
    rows, lines = compare(a.nccl_tests, ours(a.ours), ours(a.ours_eager))
    text = (wide_table(rows) if a.wide else table(rows)) + "\n" + "\n".join(f"- {x}" for x in lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)
        a.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "goals": lines}, indent=1) + "\n")
    return 0 if rows and not any("MISSED" in x or "no side-by-side" in x or "not judged" in x for x in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
