"""`llmfleet stop [-i INV] [DEPLOYMENT] [--timeout S]`: stop a deployment in order, bounded, and say what it did.

Order (as roles/engine/tasks/stop.yml): the P/D router first (it would send requests to stopping instances),
then the head (SGLang workers ignore SIGTERM until rank 0 tells them to shut down), then the other nodes, in
parallel. Per unit: `systemctl stop --no-block`, wait up to --timeout s for inactive/failed, else
`systemctl kill --signal=SIGKILL`; then every process still in the unit's cgroup is SIGKILLed and named.
Exit 0: every unit stopped cleanly; 1: a node was unreachable, a unit did not stop, or something had to be
killed (after the timeout, a leftover process, or the wrapper's own stop timeout).
`llmfleet restart` (oncall_restart.py) is this, then a start in rank order and a wait for READY.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..fleet_inventory import Fleet, Node
from . import common
from .common import AutoTransport, NodeResult, has_router, short, where

STOPPED = ("inactive", "failed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_fleet_arguments(p, timeout=None)
    common.add_stop_timeout(p)
    common.add_replica_argument(p)


def run(args: argparse.Namespace, transport: Any = None) -> int:
    return common.guarded("stop", lambda: _run(args, transport))


def stop_fleet(fleet: Fleet, t: Any, timeout: float) -> tuple[list[NodeResult], list[NodeResult]]:
    """(the state round before, the stop results in stop order: the head, then the workers)."""
    before = common.fan_out(
        fleet.nodes, lambda n: common.call_probe(t, n, {"op": "state", "units": common.unit_specs(fleet, n)}, 60)
    )
    common.check_deployment_known(fleet, before)
    per_call = (timeout + 60) * 2

    def stop(node: Node) -> dict:
        return common.call_probe(
            t, node, {"op": "stop", "units": common.unit_specs(fleet, node), "timeout": timeout}, per_call
        )

    head = common.fan_out([fleet.head], stop)
    return before, head + common.fan_out(fleet.nodes[1:], stop)


def assess(fleet: Fleet, results: list[NodeResult]) -> tuple[list[dict], list[str], list[str]]:
    """(per node documents, problems (not stopped, unreachable), kills (what had to be killed))."""
    docs, problems, kills = [], [], []
    for r in results:
        n = r.node
        doc: dict[str, Any] = {"node": n.name, "rank": n.rank, "head": n.head, "error": r.error, "units": []}
        docs.append(doc)
        if r.data is None:
            problems.append(f"{n.name}: unreachable, not stopped: {r.error}")
            continue
        for u in r.data["units"]:
            if u["before"].get("LoadState") != "loaded" and u["unit"] == fleet.router_unit() and not has_router(n):
                continue
            doc["units"].append(u)
            who = f"{n.name}: {u['unit']}"
            state = (u.get("after") or {}).get("ActiveState")
            if u["before"].get("LoadState") == "loaded" and state not in STOPPED:
                problems.append(f"{who} is still {state}" + (" after SIGKILL" if u.get("sigkill_unit") else ""))
            if u.get("survivors"):
                problems.append(f"{who}: processes survived SIGKILL (stuck in the kernel?): {u['survivors']}")
            if u.get("sigkill_unit"):
                kills.append(f"{who}: did not stop within the timeout: the unit was SIGKILLed")
            rec = u.get("record") or {}
            if rec.get("killed_after_timeout") and u.get("stop_s") is not None:
                why = short(rec.get("reason"), 120)
                kills.append(f"{who}: the engine ignored SIGTERM; the wrapper SIGKILLed it ({why})")
            for k in u.get("killed") or []:
                kills.append(f"{who}: KILLED leftover pid {k['pid']} {k['comm']} ({short(k['cmdline'], 80)})")
    return docs, problems, kills


def render(docs: list[dict]) -> list[str]:
    out = []
    for d in docs:
        if d["error"]:
            out.append(f"{d['node']}: UNREACHABLE: {d['error']}")
            continue
        for u in d["units"]:
            after = u.get("after") or {}
            took = f" in {u['stop_s']:.1f} s" if u.get("stop_s") is not None else ""
            rec = u.get("record") or {}
            ended = f"; record: {rec['verdict']} (exit {rec.get('exit_code')})" if rec.get("verdict") else ""
            state = f" -> {after.get('ActiveState')}/{after.get('SubState')}" if after else ""
            killed = f"; KILLED {len(u['killed'])} leftover process(es)" if u.get("killed") else ""
            out.append(f"{d['node']} {u['unit']}: {'; '.join(u['actions'])}{state}{took}{ended}{killed}")
    return out


def _run(args: argparse.Namespace, transport: Any) -> int:
    fleet = common.replica_target(args, "stop")
    t = transport or AutoTransport()
    try:
        _, results = stop_fleet(fleet, t, args.timeout)
    finally:
        if transport is None:
            t.close()
    docs, problems, kills = assess(fleet, results)
    if args.json:
        common.emit_json({"action": "stop", "deployment": fleet.deployment, "stopped": not problems, "clean": not kills,
                   "problems": problems, "killed": kills, "nodes": docs})  # fmt: skip
    else:
        print(f"stop {fleet.unit()}: router first, then the head {fleet.head.name}, then the other nodes "
              f"(up to {args.timeout:g} s per unit, then SIGKILL; {where(fleet)})")  # fmt: skip
        print("\n".join(render(docs)))
        for k in kills:
            print(f"had to kill: {k}")
        for p in problems:
            print(f"NOT STOPPED: {p}")
        if problems:
            print("NOT all stopped")
        else:
            print("stopped" + (" (after killing, see above)" if kills else " cleanly"))
    return 1 if problems or kills else 0
