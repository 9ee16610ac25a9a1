"""`llmfleet logs [-i INV] [DEPLOYMENT] [-n N] [--first-failed]`: journal tails of the deployment's units on every
node (journalctl -u UNIT -n N -o short-iso). With --first-failed: which node and rank failed first, and that
node's journal up to just after the failure, with a header saying why it was picked.

The pick: the termination records (current and rotated, every node) that show a failure not asked for; of the
latest incident (failures chained by gaps under INCIDENT_GAP_S, so a restart loop is one incident) the earliest,
timed by its first error line (else its end). Without such a record (a unit llmfleet did not launch, records
lost): the earliest error-looking line in the last --scan-lines journal lines of every node. Times are each
node's clock: skew between nodes shifts the pick (keep the nodes on NTP; preflight checks it).
"""

from __future__ import annotations

import argparse
import re
import sys
from datetime import datetime
from typing import Any

from ..engine.logobserver import is_error_line, rank_of
from ..fleet_inventory import Fleet
from . import common
from .common import AutoTransport, NodeResult, describe, iso, short
from .status import rank_text, record_failed

INCIDENT_GAP_S = 900.0  # failures closer than this belong to one incident (vLLM's dist timeout is 600 s)
AFTER_FAILURE_S = 10  # the picked node's journal runs this long past the failure
_JOURNAL_LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?)(Z|[+-]\d\d:?\d\d)\s+\S+\s+[^:]+?:\s?(.*)$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_fleet_arguments(p, timeout=60.0)
    p.add_argument("-n", "--lines", type=_count, default=50, help="journal lines per unit (default 50)")
    p.add_argument("--first-failed", action="store_true", help="only the node and rank that failed first, and why")
    p.add_argument(
        "--scan-lines", type=_count, default=5000, help="--first-failed without records: lines scanned per unit"
    )


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= 1")
    return int(text)


def run(args: argparse.Namespace, transport: Any = None) -> int:
    return common.guarded("logs", lambda: _run(args, transport))


def journal_time(line: str) -> tuple[float | None, str]:
    """(epoch, message) of a `journalctl -o short-iso` line; (None, line) for other lines."""
    m = _JOURNAL_LINE.match(line)
    if not m:
        return None, line
    tz = m.group(2).replace("Z", "+00:00")
    tz = tz if ":" in tz else f"{tz[:3]}:{tz[3:]}"
    try:
        return datetime.fromisoformat(m.group(1).replace(",", ".") + tz).timestamp(), m.group(3)
    except ValueError:
        return None, line


def failure_records(results: list[NodeResult]) -> list[dict]:
    """Every failure record of every node, with its time: the first error line's, else the end."""
    out = []
    for r in results:
        for unit, u in ((r.data or {}).get("units") or {}).items():
            for entry in u.get("records") or []:
                rec = entry.get("record")
                if not record_failed(rec):
                    continue
                fe = rec.get("first_error") or {}
                t = fe.get("at") or rec.get("ended_at")
                if t:
                    out.append({"node": r.node.name, "rank_of_node": r.node.rank, "unit": unit, "t": float(t),
                                "file": entry["file"], "record": rec})  # fmt: skip
    return out


def latest_incident(failures: list[dict]) -> list[dict]:
    """The failures of the latest incident, oldest first."""
    chain: list[dict] = []
    for f in sorted(failures, key=lambda f: f["t"], reverse=True):
        if chain and chain[-1]["t"] - f["t"] > INCIDENT_GAP_S:
            break
        chain.append(f)
    return chain[::-1]


def first_error_in_journals(results: list[NodeResult]) -> dict | None:
    best = None
    for r in results:
        for unit, u in ((r.data or {}).get("units") or {}).items():
            for line in (u.get("journal") or "").splitlines():
                t, msg = journal_time(line)
                if t is not None and is_error_line(msg):
                    if best is None or t < best["t"]:
                        best = {"node": r.node.name, "unit": unit, "t": t, "line": line, "message": msg}
                    break  # the first error line of this unit
    return best


def pick_first_failed(results: list[NodeResult], scan_lines: int) -> dict | None:
    """The node/unit/rank that failed first and why it was picked (see the module's docstring), or None."""
    chain = latest_incident(failure_records(results))
    # A node the deployment link stopped because another failed (peer-failed) is a consequence, whatever its clock.
    chain.sort(key=lambda c: c["record"].get("verdict") == "peer-failed")
    if chain:
        f, rec = chain[0], chain[0]["record"]
        fr = rec.get("failed_rank") or (rank_of((rec.get("first_error") or {}).get("line") or "") or None)
        nodes = sorted({c["node"] for c in chain})
        which = "termination record" if f["file"] == 0 else f"rotated termination record (.{f['file']})"
        why = (
            f"its {which} ({rec.get('verdict')}, exit {rec.get('exit_code')}) holds the earliest failure of the latest "
            f"incident: {len(chain)} failure record(s) on {len(nodes)} node(s) ({', '.join(nodes)})"
        )
        if len(chain) > 1:
            n = chain[1]
            why += f"; next: {n['node']} {n['t'] - f['t']:+.1f} s ({n['record'].get('verdict')})"
        line = (rec.get("first_error") or {}).get("line") or rec.get("reason")
        return {"source": "record", "node": f["node"], "unit": f["unit"], "t": f["t"], "rank": fr,
                "verdict": rec.get("verdict"), "line": line, "why": why,
                "incident": [{k: c[k] for k in ("node", "unit", "t", "file")} | {"verdict": c["record"].get("verdict")}
                             for c in chain]}  # fmt: skip
    hit = first_error_in_journals(results)
    if hit is None:
        return None
    return {"source": "journal", "node": hit["node"], "unit": hit["unit"], "t": hit["t"],
            "rank": rank_of(hit["message"]), "verdict": None, "line": hit["line"],
            "why": (f"no termination record shows a failure; this is the earliest error-looking line in the last "
                    f"{scan_lines} journal lines of every unit on every node"), "incident": []}  # fmt: skip


def _tails(fleet: Fleet, results: list[NodeResult], lines: int) -> tuple[list[str], list[dict]]:
    out, docs = [], []
    for r in results:
        doc: dict[str, Any] = {"node": r.node.name, "rank": r.node.rank, "error": r.error, "units": {}}
        docs.append(doc)
        if r.data is None:
            out.append(f"==> {describe(r.node)}: UNREACHABLE: {r.error} <==")
            continue
        for spec in common.unit_specs(fleet, r.node):
            u = r.data["units"].get(spec["unit"]) or {}
            if spec["role"] == "router" and (u.get("show") or {}).get("LoadState") != "loaded":
                continue
            text = [ln for ln in (u.get("journal") or "").splitlines()][-lines:]
            doc["units"][spec["unit"]] = {"lines": text, "error": u.get("error"), "dropped": u.get("dropped")}
            out.append(f"==> {describe(r.node)} {spec['unit']}: last {len(text)} line(s) <==")
            out += text + ([f"(journalctl failed: {u['error']})"] if u.get("error") else [])
    return out, docs


def _run(args: argparse.Namespace, transport: Any) -> int:
    fleet = common.fleet_of(args)
    t = transport or AutoTransport()
    try:
        n = max(args.lines, args.scan_lines) if args.first_failed else args.lines

        def probe(node):
            spec = {"op": "logs", "units": common.unit_specs(fleet, node), "lines": n, "records": args.first_failed}
            return common.call_probe(t, node, spec, args.timeout)

        results = common.fan_out(fleet.nodes, probe)
        common.check_deployment_known(fleet, results)
        unreachable = [r for r in results if r.data is None]
        if not args.first_failed:
            text, docs = _tails(fleet, results, args.lines)
            if args.json:
                common.emit_json({"deployment": fleet.deployment, "nodes": docs})
            else:
                print("\n".join(text))
            return 1 if unreachable else 0
        pick = pick_first_failed(results, args.scan_lines)
        tail: list[str] = []
        if pick:
            node = next(x for x in fleet.nodes if x.name == pick["node"])
            spec = {"op": "logs", "units": [s for s in common.unit_specs(fleet, node) if s["unit"] == pick["unit"]],
                    "lines": args.lines, "until": pick["t"] + AFTER_FAILURE_S}  # fmt: skip
            try:
                got = common.call_probe(t, node, spec, args.timeout)
                tail = (got["units"][pick["unit"]].get("journal") or "").splitlines()
            except Exception as e:  # the pick stands; say why the tail is missing
                tail = [f"(cannot read the journal of {node.name} again: {e})"]
    finally:
        if transport is None:
            t.close()
    return _show_pick(args, fleet, pick, tail, unreachable)


def _show_pick(args: argparse.Namespace, fleet: Fleet, pick: dict | None, tail: list[str], unreachable: list) -> int:
    missing = [f"{r.node.name}: unreachable: {r.error}" for r in unreachable]
    if args.json:
        common.emit_json({"deployment": fleet.deployment, "first_failed": pick, "lines": tail, "unreachable": missing})
    elif pick is None:
        print(f"no failure found: no termination record shows one, and no error-looking line in the last "
              f"{args.scan_lines} journal lines of any unit")  # fmt: skip
    else:
        node = next(x for x in fleet.nodes if x.name == pick["node"])
        rank = rank_text(pick["rank"]) if pick["rank"] else "rank unknown (no rank tag in the error lines)"
        print(f"first failed: {describe(node)}, {rank}, {pick['unit']}, at {iso(pick['t'])}")
        print(f"why this one: {pick['why']}")
        print(f"first error: {short(pick['line'], 300)}")
        print(f"==> {node.name} {pick['unit']}: journal up to {AFTER_FAILURE_S} s after the failure <==")
        print("\n".join(tail))
    for m in missing:
        print(f"warning: {m} (its failures, if any, are not in this pick)", file=sys.stderr)
    return 1 if pick or unreachable else 0
