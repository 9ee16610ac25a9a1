"""`llmfleet status [-i INVENTORY] [DEPLOYMENT] [--json]`: is it serving? One line per node (and one for the
P/D router; with llmfleet_replicas, one table per replica, each its own deployment, and a line for the replicas'
router): the unit's state, since when, restarts, result and exit status, the termination record's verdict
(failed rank, first error), the wrapper's phase, the API port on the node(s) serving it, the GPU memory held by
the unit's processes, the last serving health probe (ok/FAILED, age, latency). One SSH round per node, all nodes at
once. Exit 1 when anything is unhealthy.
"""

from __future__ import annotations

import argparse
import signal
import time
from typing import Any

from ..fleet_inventory import Fleet, Node
from .common import (
    AutoTransport,
    NodeResult,
    add_fleet_arguments,
    ago,
    call_probe,
    check_deployment_known,
    emit_json,
    fan_out,
    fleet_of,
    guarded,
    has_router,
    iso,
    replica_fleets,
    serves_api,
    short,
    table,
    unit_specs,
    where,
)

# An operator's stop, however it ended (deployment-stopped: the link stopped this node with another one stopped on
# request).
NOT_A_FAILURE = (None, "clean-stop", "stop-timeout", "deployment-stopped")
# Failures the wrapper itself ends by stopping the engine, or the link because a peer failed (the record then says
# stop_requested): still failures.
SELF_STOPPED_FAILURES = ("rank-died", "unhealthy-while-serving", "peer-failed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_fleet_arguments(p, timeout=30.0)


def run(args: argparse.Namespace, transport: Any = None) -> int:
    return guarded("status", lambda: _run(args, transport))


def record_failed(rec: dict | None) -> bool:
    if not rec or rec.get("verdict") in NOT_A_FAILURE:
        return False
    return rec.get("verdict") in SELF_STOPPED_FAILURES or not rec.get("stop_requested")


def rank_text(fr: dict | None) -> str:
    if not fr:
        return ""
    parts = [f"TP{fr['tp']}" if fr.get("tp") is not None else "", f"PP{fr['pp']}" if fr.get("pp") is not None else ""]
    place = " ".join(p for p in parts if p)
    rank = f"rank {fr['rank']}" if fr.get("rank") is not None else "rank ?"
    return f"{rank} ({place})" if place else rank


def exit_text(show: dict) -> str:
    """ExecMainCode 1 = exited (ExecMainStatus is the code); 2/3 = killed/dumped (it is the signal)."""
    code, status = show.get("ExecMainCode", ""), show.get("ExecMainStatus", "")
    if code in ("2", "3") and status.isdigit():
        try:
            return signal.Signals(int(status)).name
        except ValueError:
            return f"signal {status}"
    return status if code == "1" else "-"


def current_and_previous(records: list[dict]) -> tuple[dict | None, dict | None]:
    cur = next((r["record"] for r in records if r["file"] == 0 and r.get("record")), None)
    prev = next((r["record"] for r in records if r["file"] > 0 and r.get("record")), None)
    return cur, prev


def unit_view(node: Node, spec: dict, res: dict) -> tuple[dict, list[str]]:
    """(one unit's normalised view, its problems)."""
    show = res.get("show") or {}
    active, sub = show.get("ActiveState", "?"), show.get("SubState", "?")
    status = res.get("status") or {}
    cur, prev = current_and_previous(res.get("records") or [])
    since = show.get("ActiveEnterTimestampEpoch") if active == "active" else show.get("StateChangeTimestampEpoch")
    running = bool(status.get("running")) and active in ("active", "activating", "deactivating")
    record = None if running else cur  # while the unit runs, termination.json is the previous run's (rotated)
    api = spec["role"] == "router" or serves_api(node)
    v = {
        "unit": spec["unit"], "role": spec["role"], "load_state": show.get("LoadState"), "active_state": active,
        "sub_state": sub, "since": since, "since_iso": iso(since) if since else None,
        "restarts": int(show["NRestarts"]) if show.get("NRestarts", "").isdigit() else None,
        "result": show.get("Result"), "exit": exit_text(show), "main_pid": show.get("MainPID"),
        "record": record, "previous_record": prev if record is None else None,
        "phase": status.get("phase") or (record or {}).get("phase"), "running": status.get("running"),
        "ready": status.get("ready"), "port": res.get("port") if api else None,
        "port_open": res.get("port_open") if api else None, "gpu_mib": res.get("gpu_mib"),
        "gpu_pids": res.get("gpu_pids"), "errors": res.get("errors") or [],
        # the wrapper's serving health probe (llmfleet exec --health-url), this run's only
        "health": status.get("health") if running and isinstance(status.get("health"), dict) else None,
        # the deployment link's barrier this run waits at (no engine started yet), with the nodes it waits for
        "barrier": (status.get("link") or {}).get("barrier") if running and isinstance(status.get("link"), dict)
        else None,
    }  # fmt: skip
    problems = []
    who = f"{node.name}: {spec['unit']}"
    if show.get("_error"):
        problems.append(f"{who}: systemctl show failed: {show['_error']}")
    elif v["load_state"] != "loaded":
        problems.append(f"{who} is not installed (LoadState={v['load_state']})")
    elif active != "active":
        phase = f", phase {v['phase']}" if v["phase"] and active == "activating" else ""
        problems.append(f"{who} is {active}/{sub}{phase}")
    if record_failed(record):
        fr = rank_text(record.get("failed_rank"))
        err = (record.get("first_error") or {}).get("line") or record.get("reason")
        problems.append(f"{who} ended {record['verdict']} (exit {record.get('exit_code')})"
                        f"{': ' + fr if fr else ''}: {short(err, 160)}")  # fmt: skip
    if isinstance(v["barrier"], dict):
        problems.append(f"{who}: no engine started, at the deployment link: {short(v['barrier'].get('what'), 160)}")
    last = (v["health"] or {}).get("last") or {}
    if last and not last.get("ok"):
        h = v["health"]
        problems.append(f"{who}: serving health probe failed {h.get('failures_in_row')}/{h.get('failures_allowed')} "
                        f"in a row: {short(last.get('error'), 120)}")  # fmt: skip
    if api and active == "active" and v["port_open"] is False:
        problems.append(f"{who}: port {v['port']} is CLOSED on {res.get('port_host')} although the unit is active")
    v["healthy"] = not problems
    return v, problems


def assess(fleet: Fleet, results: list[NodeResult]) -> tuple[list[dict], list[str]]:
    nodes, problems = [], []
    for r in results:
        n = r.node
        doc: dict[str, Any] = {
            "node": n.name, "rank": n.rank, "head": n.head, "host": n.ssh.host,
            "reachable": r.data is not None, "error": r.error, "seconds": round(r.seconds, 3),
        }  # fmt: skip
        nodes.append(doc)
        if r.data is None:
            problems.append(f"{n.name}: unreachable: {r.error}")
            continue
        doc["units"] = []
        for spec in unit_specs(fleet, n):
            res = r.data["units"].get(spec["unit"]) or {}
            router_absent = ((res.get("show") or {}).get("LoadState") != "loaded") and spec["role"] == "router"
            if router_absent and not has_router(n):
                continue  # no router: nothing to say
            v, p = unit_view(n, spec, res)
            doc["units"].append(v)
            problems += p
        doc["gpu_error"] = r.data.get("gpu_error")
        doc["gpu_other"] = r.data.get("gpu_other")
    return nodes, missing_nodes(nodes) + problems


def missing_nodes(nodes: list[dict]) -> list[str]:
    """The nodes the others wait for at the deployment link (their barriers' missing), most witnesses first."""
    waiting: dict[str, list[str]] = {}
    for d in nodes:
        for v in d.get("units") or []:
            for m in (v.get("barrier") or {}).get("missing") or []:
                waiting.setdefault(m, []).append(d["node"])
    return [f"{m} is missing at the deployment link: {', '.join(w)} wait{'s' if len(w) == 1 else ''} for it (down, "
            "or cut off from them)" for m, w in sorted(waiting.items(), key=lambda kv: -len(kv[1]))]  # fmt: skip


def probe_text(health: dict | None, now: float) -> str:
    """The last serving health probe: `ok 12s ago 0.31s`, `FAILED 2/3 4s ago`, or `-` (none yet, or no probe)."""
    last = (health or {}).get("last") or {}
    if not last:
        return "-"
    age = ago(last.get("at"), now)
    if last.get("ok"):
        return f"ok {age} ago {last.get('latency_s', 0):.2f}s"
    return f"FAILED {health.get('failures_in_row')}/{health.get('failures_allowed')} {age} ago"


def _row(doc: dict, v: dict, now: float) -> list[str]:
    rec = v["record"]
    if rec:
        verdict = rec.get("verdict") or "-"
    elif v["running"]:
        verdict = "running"
    else:
        verdict = "-"
    since = f"{v['since_iso']} ({ago(v['since'], now)})" if v["since"] else "-"
    port = (
        "-"
        if v["port"] is None or v["active_state"] != "active"
        else f"{v['port']} {'open' if v['port_open'] else 'CLOSED'}"
    )
    gpu = "-" if v["gpu_mib"] is None else f"{v['gpu_mib']} MiB"
    note = ""
    if rec and record_failed(rec):
        fr = rank_text(rec.get("failed_rank"))
        note = f"{fr + ': ' if fr else ''}{short((rec.get('first_error') or {}).get('line') or rec.get('reason'), 90)}"
    elif v["barrier"]:
        note = f"link: {short(v['barrier'].get('what'), 90)}"
    elif v["previous_record"] and record_failed(v["previous_record"]):
        pr = v["previous_record"]
        note = f"previous run: {pr.get('verdict')} {rank_text(pr.get('failed_rank'))}".rstrip()
    rank = "router" if v["role"] == "router" else str(doc["rank"])
    state = f"{v['active_state']}/{v['sub_state']}" if v["load_state"] == "loaded" else f"({v['load_state']})"
    restarts = "-" if v["restarts"] is None else str(v["restarts"])
    result = v["result"] or "-"
    probe = probe_text(v["health"], now)
    return [doc["node"], rank, state, since, restarts, result, v["exit"], verdict, v["phase"] or "-", port, probe, gpu,
            note]  # fmt: skip


def render(fleet: Fleet, nodes: list[dict], problems: list[str], elapsed: float) -> list[str]:
    now = time.time()
    rows = [["NODE", "RANK", "STATE", "SINCE", "RESTARTS", "RESULT", "EXIT", "RECORD", "PHASE", "PORT", "PROBE", "GPU",
             "NOTE"]]  # fmt: skip
    for d in nodes:
        if not d["reachable"]:
            rows.append([d["node"], str(d["rank"]), f"UNREACHABLE: {d['error']}"])
            continue
        for v in d["units"]:
            rows.append(_row(d, v, now))
    out = [f"{fleet.unit()} on {len(nodes)} node(s), head {fleet.head.name} ({where(fleet)})", *table(rows)]
    for d in nodes:
        other = d.get("gpu_other") or []
        if other:
            held = ", ".join(f"pid {o['pid']} {o.get('comm') or '?'} {o['mib']} MiB" for o in other[:5])
            out.append(f"note: {d['node']}: GPU memory held outside the unit: {held}")
    if problems:
        out.append(f"UNHEALTHY: {len(problems)} problem(s):")
        out += [f"  - {p}" for p in problems]
    else:
        out.append("healthy")
    out.append(f"({elapsed:.2f} s)")
    return out


def _router_spec(fleet: Fleet, node: Any) -> dict:
    """The replicas' router unit (llmfleet-<deployment>-router.service, files in the deployment's own directory)."""
    d = f"{node.engine_dir.rsplit('/', 1)[0]}/{fleet.deployment}"
    return {"unit": fleet.router_unit(), "record": f"{d}/router-termination.json", "status": f"{d}/router-status.json",
            "default_port": 0, "host": "", "role": "router", "members": True}  # fmt: skip


def _membership(subs: list, rspec: dict, node: Any, res: dict) -> tuple[list[str], list[str]]:
    """The router's members against the replicas it was launched with (in replica order): lines and problems. A
    replica out of the router (a rollout's step, or the router dropped it) or unhealthy in it is a problem."""
    m = res.get("members")
    if not m:
        return [], []
    who = f"{rspec['unit']} on {node.name}"
    if m.get("listed") is None:
        return [], [f"{who}: its worker list did not answer: {m.get('error')}"]
    listed = {w.get("url"): w.get("healthy") for w in m["listed"]}
    names = [s.deployment for s in subs]
    lines, problems = [], []
    for i, url in enumerate(m.get("expected") or []):
        name = names[i] if i < len(names) and len(names) == len(m["expected"]) else url
        if url not in listed:
            state = "NOT IN THE ROUTER"
            problems.append(f"{who}: {name} ({url}) is not in the router")
        elif listed[url] is False:
            state = "UNHEALTHY in the router"
            problems.append(f"{who}: {name} ({url}) is unhealthy in the router")
        else:
            state = "in the router" + ("" if listed[url] is None else ", healthy")
        lines.append(f"  {name} ({url}): {state}")
    lines += [f"  {u}: in the router, not one of the replicas" for u in listed if u not in (m.get("expected") or [])]
    return lines, problems


def _run_replicas(args: argparse.Namespace, fleet: Fleet, t: Any, t0: float) -> int:
    """status of a deployment of replicas: each replica's table, then the router's line (on the first replica's
    head, the role's default place)."""
    subs = replica_fleets(fleet)
    router_node = subs[0].head if subs else fleet.head

    def probe(sub: Fleet) -> list:
        return fan_out(
            sub.nodes, lambda n: call_probe(t, n, {"op": "status", "units": unit_specs(sub, n)}, args.timeout)
        )

    per = [probe(sub) for sub in subs]
    rspec = _router_spec(fleet, router_node)
    rres = fan_out([router_node], lambda n: call_probe(t, n, {"op": "status", "units": [rspec]}, args.timeout))[0]
    elapsed = time.monotonic() - t0
    blocks, problems, lines = [], [], []
    for sub, results in zip(subs, per):
        nodes, p = assess(sub, results)
        problems += [f"{sub.deployment}: {x}" for x in p]
        blocks.append({"deployment": sub.deployment, "healthy": not p, "problems": p, "nodes": nodes})
        lines += render(sub, nodes, p, elapsed)[:-1]
    router: dict[str, Any] = {"unit": fleet.router_unit(), "node": router_node.name}
    if rres.data is None:
        problems.append(f"{fleet.router_unit()} on {router_node.name}: unreachable: {rres.error}")
        router["reachable"] = False
    else:
        v, p = unit_view(router_node, rspec, rres.data["units"].get(rspec["unit"]) or {})
        router.update(v)
        problems += p
        lines.append(f"{fleet.router_unit()} on {router_node.name}: {v['active_state']}/{v['sub_state']}"
                     + (f" since {v['since_iso']}" if v.get("since_iso") else ""))  # fmt: skip
        res = rres.data["units"].get(rspec["unit"]) or {}
        mlines, mproblems = _membership(subs, rspec, router_node, res)
        lines += mlines + [f"  - {x}" for x in mproblems]
        problems += mproblems
        router["members"] = res.get("members")
    if args.json:
        emit_json({"deployment": fleet.deployment, "router_unit": fleet.router_unit(), "inventory": fleet.sources,
                   "healthy": not problems, "problems": problems, "elapsed_s": round(elapsed, 3),
                   "replicas": blocks, "router": router})  # fmt: skip
    else:
        lines.append("healthy" if not problems else f"UNHEALTHY: {len(problems)} problem(s) (above)")
        lines.append(f"({elapsed:.2f} s)")
        print("\n".join(lines))
    return 1 if problems else 0


def _run(args: argparse.Namespace, transport: Any) -> int:
    fleet = fleet_of(args)
    t = transport or AutoTransport()
    t0 = time.monotonic()
    try:
        if fleet.replicas:
            return _run_replicas(args, fleet, t, t0)
        results = fan_out(
            fleet.nodes, lambda n: call_probe(t, n, {"op": "status", "units": unit_specs(fleet, n)}, args.timeout)
        )
    finally:
        if transport is None:
            t.close()
    elapsed = time.monotonic() - t0
    check_deployment_known(fleet, results)
    nodes, problems = assess(fleet, results)
    if args.json:
        emit_json({"deployment": fleet.deployment, "unit": fleet.unit(), "router_unit": fleet.router_unit(),
                   "inventory": fleet.sources, "healthy": not problems, "problems": problems,
                   "elapsed_s": round(elapsed, 3), "nodes": nodes})  # fmt: skip
    else:
        print("\n".join(render(fleet, nodes, problems, elapsed)))
    return 1 if problems else 0
