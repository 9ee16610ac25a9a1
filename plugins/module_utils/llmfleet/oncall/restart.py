"""`llmfleet restart [-i INV] [DEPLOYMENT] [--timeout S] [--ready-timeout S]`: the deployment as one unit of restart.

`llmfleet stop` (ordered, bounded, stop.py); then, only when every node stopped, start in rank order
(the head's engine first, then each other node, then the P/D router where there is one; `systemctl
reset-failed` + `start --no-block`, since a Type=notify start blocks until READY and the head cannot be READY
before its workers join), then wait until every unit is active (the wrapper sent READY) or one fails, with a
deadline (--ready-timeout, default the inventory's engine_ready_deadline, else engine_start_timeout).
Exit 0: serving again; 1: not stopped, a unit failed, or the deadline passed.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..cli_grammar import positive_seconds
from ..fleet_inventory import Fleet, Node
from . import common
from .common import AutoTransport, NodeResult, TransportError, where
from .stop import assess, render, stop_fleet

POLL_S = 2.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_fleet_arguments(p, timeout=None)
    common.add_stop_timeout(p)
    common.add_replica_argument(p)
    p.add_argument(
        "--ready-timeout",
        type=positive_seconds,
        help="seconds to wait for every unit to be READY (default: engine_ready_deadline, else engine_start_timeout)",
    )


def run(args: argparse.Namespace, transport: Any = None) -> int:
    return common.guarded("restart", lambda: _run(args, transport))


def start_in_order(fleet: Fleet, t: Any, before: list[NodeResult]) -> list[dict]:
    """Engines in rank order, then the router where it was installed; what each start said."""
    router_loaded = any(
        ((r.data or {}).get("units", {}).get(fleet.router_unit()) or {}).get("show", {}).get("LoadState") == "loaded"
        for r in before
        if r.node.head
    )
    steps: list[tuple[Node, dict]] = [(n, s) for n in fleet.nodes for s in common.unit_specs(fleet, n, router=False)]
    if router_loaded:
        steps.append((fleet.head, common.unit_specs(fleet, fleet.head)[0]))
    out = []
    for node, spec in steps:
        try:
            got = common.call_probe(t, node, {"op": "start", "units": [spec]}, 60)["units"][0]
            out.append({"node": node.name, "unit": spec["unit"], "error": got["error"]})
        except TransportError as e:
            out.append({"node": node.name, "unit": spec["unit"], "error": str(e)})
    return out


def wait_ready(fleet: Fleet, t: Any, started: list[dict], deadline_s: float, quiet: bool) -> tuple[bool, list[str]]:
    """Poll every node until all started units are active, one failed, or the deadline; (ok, last states)."""
    want = {(s["node"], s["unit"]) for s in started}
    end = time.monotonic() + deadline_s
    last = None
    while True:
        res = common.fan_out(
            fleet.nodes,
            lambda n: common.call_probe(t, n, {"op": "state", "units": common.unit_specs(fleet, n), "list": False}, 30),
        )
        states, failed, pending = [], [], []
        for r in res:
            for unit, u in ((r.data or {}).get("units") or {}).items():
                if (r.node.name, unit) not in want:
                    continue
                sh, st = u.get("show") or {}, u.get("status") or {}
                s = f"{r.node.name} {unit}: {sh.get('ActiveState')}/{sh.get('SubState')} phase {st.get('phase') or '-'}"
                states.append(s)
                if sh.get("ActiveState") == "failed" or sh.get("SubState") == "auto-restart":
                    failed.append(s)
                elif sh.get("ActiveState") != "active":
                    pending.append(s)
            if r.data is None:
                pending.append(f"{r.node.name}: no answer: {r.error}")
                states.append(pending[-1])
        if not quiet and states != last:
            print("waiting: " + "; ".join(states), file=sys.stderr, flush=True)
            last = states
        if failed:
            return False, [f"FAILED: {s}" for s in failed] + states
        if not pending:
            return True, states
        if time.monotonic() >= end:
            return False, [f"not READY after {deadline_s:g} s: {s}" for s in pending] + states
        time.sleep(POLL_S)


def _run(args: argparse.Namespace, transport: Any) -> int:
    fleet = common.replica_target(args, "restart")
    ready_timeout = args.ready_timeout or fleet.head.ready_deadline
    t = transport or AutoTransport()
    doc: dict[str, Any] = {"action": "restart", "deployment": fleet.deployment}
    try:
        t0 = time.monotonic()
        before, results = stop_fleet(fleet, t, args.timeout)
        docs, problems, kills = assess(fleet, results)
        doc.update(
            stop={"nodes": docs, "problems": problems, "killed": kills, "seconds": round(time.monotonic() - t0, 2)}
        )
        if not args.json:
            print(f"restart {fleet.unit()} ({where(fleet)}): stop in order, start in rank order, wait for READY")
            print("\n".join(render(docs)) + "".join(f"\nhad to kill: {k}" for k in kills))
        if problems:
            doc.update(ok=False, problems=problems)
            return _finish(args, doc, [f"NOT RESTARTED, not all stopped: {p}" for p in problems])
        t1 = time.monotonic()
        started = start_in_order(fleet, t, before)
        doc["start"] = started
        errors = [f"{s['node']} {s['unit']}: start failed: {s['error']}" for s in started if s["error"]]
        if errors:
            doc.update(ok=False, problems=errors)
            return _finish(args, doc, errors)
        ok, states = wait_ready(fleet, t, started, ready_timeout, args.json)
        doc.update(ok=ok, states=states, ready_s=round(time.monotonic() - t1, 2))
        lines = states if ok else [*states, "next: llmfleet logs --first-failed; llmfleet status"]
        if ok:
            lines.append(f"READY: every unit active {doc['ready_s']:.1f} s after the start")
        return _finish(args, doc, lines)
    finally:
        if transport is None:
            t.close()


def _finish(args: argparse.Namespace, doc: dict, lines: list[str]) -> int:
    doc.setdefault("ok", False)
    if args.json:
        common.emit_json(doc)
    else:
        print("\n".join(lines))
    return 0 if doc["ok"] else 1
