"""The deployment report's sections: pure functions from the record files' JSON (already loaded) to the
numbers each section shows. llmfleet.report.build loads the records, guards every builder (an unexpected shape
becomes a section error, never a traceback) and decides what is missing or stale.

Each builder returns the section's own keys; build.py adds id, title, question, sources and times.
Every builder sets ``status`` (pass / warn / fail) and ``summary`` (one line for the terminal and the top
of the page).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import engines
from ..checks.nccl_verdict import floor_for
from ..engine import specdecode

GiB = 2**30

# The cold start, in the order it happens (docs/report.md): per node, then the deployment's API.
NODE_EVENTS = (("unit_start", "unit start"), ("weights_loaded", "weights loaded"), ("node_ready", "ready"))
API_EVENTS = (
    ("port_open", "port"),
    ("models_listed", "models"),
    ("first_correct_answer", "first correct answer"),
    ("kv_transfer_proven", "KV transfer proven"),
)
EVENT_LABELS = dict(NODE_EVENTS + API_EVENTS)


def _dict(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


def _list(v: Any) -> list:
    return v if isinstance(v, list) else []


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def size_text(n: Any) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 ("8.01 MiB")."""
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return "—"
    for unit, k in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def value_text(check: str, v: Any, limit: int = 80) -> str:
    """A preflight value as a short cell text (bytes of free space in GiB)."""
    if v is None or v in ([], ""):
        return "—"
    if check.endswith("_free") and isinstance(v, int):
        return size_text(v)
    if isinstance(v, list):
        text = ", ".join(str(x) for x in v)
    elif isinstance(v, dict):
        text = ", ".join(f"{k}={x}" for k, x in v.items())
    else:
        text = str(v)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def rank_text(rank: Any) -> str | None:
    """A failed rank (the wrapper's failed_rank dict {tp, pp, rank, line}, a number, or text) as words."""
    if rank is None or rank == {}:
        return None
    if isinstance(rank, Mapping):
        place = " ".join(f"{k.upper()}{rank[k]}" for k in ("tp", "pp") if rank.get(k) is not None)
        who = f"rank {rank['rank']}" if rank.get("rank") is not None else ""
        text = f"{who} ({place})" if who and place else who or place
        return text or None
    return f"rank {rank}" if isinstance(rank, int) and not isinstance(rank, bool) else str(rank)


# ---- inventory and versions ---------------------------------------------------------------------------


VERSION_CHECKS = {"gpu_models": "gpu_model", "driver_version": "driver", "cuda_version": "cuda", "nccl_version": "nccl"}


def inventory(
    fleet: dict | None, preflight: dict | None, endpoint: dict | None, engine: dict | None, stage: dict | None
) -> dict[str, Any]:
    nodes: dict[str, dict[str, Any]] = {}
    for name, raw in sorted(_dict((fleet or {}).get("nodes")).items()):
        info = _dict(raw)
        nvme, shared = _dict(info.get("nvme")), _dict(info.get("shared"))
        nodes[name] = {
            "node": name,
            "hostname": info.get("hostname"),
            "gpus": len(_list(info.get("gpus"))),
            "kernel": info.get("kernel"),
            "python": info.get("python"),
            "llmfleet": info.get("llmfleet_version"),
            "cpus": info.get("cpus"),
            "mem_bytes": info.get("mem_total_bytes"),
            "nvme_free_bytes": nvme.get("free_bytes"),
            "nvme_total_bytes": nvme.get("total_bytes"),
            "shared": ("read-only" if shared.get("read_only") else "mounted")
            if shared.get("mounted")
            else "not mounted",
        }
    for row in _list((preflight or {}).get("rows")):
        key = VERSION_CHECKS.get(_dict(row).get("check"))
        if key and row.get("node"):
            node = nodes.setdefault(row["node"], {"node": row["node"]})
            node[key] = value_text(row["check"], row.get("value"))
            if row.get("status") == "fail":
                node.setdefault("odd", []).append(key)
    keys = (
        "hostname",
        "gpus",
        "gpu_model",
        "driver",
        "cuda",
        "nccl",
        "kernel",
        "python",
        "llmfleet",
        "cpus",
        "mem_bytes",
        "nvme_free_bytes",
        "nvme_total_bytes",
        "shared",
    )
    for node in nodes.values():
        for k in keys:
            node.setdefault(k, None)
        node.setdefault("odd", [])
    endpoint, engine = endpoint or {}, engine or {}
    model_path = engine.get("model_path") or endpoint.get("model_path")
    dep = {
        "engine": engine.get("engine") or endpoint.get("engine"),
        "engine_version": engine.get("engine_version"),
        "profile": engine.get("profile") or endpoint.get("profile"),
        "model": engine.get("model") or endpoint.get("model"),
        "model_path": model_path,
        # The engine role records the revision it loads (the fleet contract's); the staging record's otherwise.
        "revision": engine.get("revision") or endpoint.get("revision") or (stage or {}).get("revision"),
        "url": endpoint.get("url"),
        "head": endpoint.get("head"),
    }
    warnings = [str(w) for w in _list((fleet or {}).get("warnings"))]
    n = len(nodes)
    summary = f"{n} node(s)" + (f", {dep['engine']} serving {dep['model']}" if dep["engine"] else "")
    if dep["revision"]:
        summary += f" at revision {dep['revision'][:12]}"
    return {
        "status": "warn" if warnings else "pass",
        "summary": summary,
        "deployment": dep,
        "nodes": [nodes[k] for k in sorted(nodes)],
        "warnings": warnings,
    }


# ---- preflight -----------------------------------------------------------------------------------------


def preflight(data: dict) -> dict[str, Any]:
    """The check x node table; the odd node (a value that differs from the others, or a failed check) is
    marked per cell and named above the table."""
    rows = [_dict(r) for r in _list(data["rows"])]
    nodes = sorted({str(r.get("node")) for r in rows})
    checks: list[str] = []
    for r in rows:
        if r.get("check") not in checks:
            checks.append(r.get("check"))
    cells = {(r.get("check"), str(r.get("node"))): r for r in rows}
    order = {"pass": 0, "warn": 1, "fail": 2}
    table = []
    odd: dict[str, list[str]] = {}
    counts = {"pass": 0, "warn": 0, "fail": 0}
    for check in checks:
        row_cells = []
        worst = "pass"
        for node in nodes:
            r = cells.get((check, node))
            if r is None:
                row_cells.append({"node": node, "status": "none", "text": "", "message": "", "odd": False})
                continue
            st = r.get("status") if r.get("status") in order else "warn"
            counts[st] += 1
            worst = max(worst, st, key=order.__getitem__)
            msg = str(r.get("message") or "")
            is_odd = st == "fail"
            if is_odd:
                odd.setdefault(node, []).append(f"{check}: {msg or value_text(check, r.get('value'))}")
            row_cells.append(
                {"node": node, "status": st, "text": value_text(check, r.get("value")), "message": msg, "odd": is_odd}
            )
        table.append({"check": check, "status": worst, "cells": row_cells})
    table.sort(key=lambda t: -order[t["status"]])  # problems first, as the play's table
    status = data.get("status") if data.get("status") in order else max(["pass", *[t["status"] for t in table]],
                                                                          key=order.__getitem__)  # fmt: skip
    failed = sorted({str(n) for n in _list(data.get("failed_nodes"))} | set(odd))
    if status == "fail":
        summary = f"FAIL on {', '.join(failed) or '?'}: " + "; ".join(x for n in failed for x in odd.get(n, []))[:300]
    else:
        summary = f"{len(checks)} checks on {len(nodes)} node(s): {counts['pass']} pass, {counts['warn']} warn"
    return {
        "status": status,
        "summary": summary,
        "nodes": nodes,
        "table": table,
        "odd_nodes": [{"node": n, "why": odd.get(n, [])} for n in failed],
        "counts": counts,
    }


# ---- fabric (topology) ---------------------------------------------------------------------------------


def _port_rows(topo: dict) -> list[dict[str, Any]]:
    rails = set(_list(topo.get("rails")))
    rows = []
    for h in map(_dict, _list(topo.get("hcas"))):
        if rails and h.get("name") not in rails:
            continue
        aff = _dict(h.get("affinity"))
        for port, raw in sorted(_dict(h.get("ports")).items(), key=lambda kv: str(kv[0])):
            p = _dict(raw)
            gi = p.get("roce_v2_gid")
            gid = next((g.get("gid") for g in _list(p.get("gids")) if _dict(g).get("index") == gi), None)
            rows.append({
                "hca": h.get("name"), "port": port, "state": p.get("state"), "link_layer": p.get("link_layer"),
                "rate": p.get("rate"), "gid_index": gi, "gid": gid, "ipv4": ", ".join(_list(p.get("ipv4"))),
                "netdevs": ", ".join(_list(h.get("upper_netdevs")) + _list(h.get("netdevs"))),
                "numa": h.get("numa_node"),
                "gpu": f"GPU{aff['gpu']} {aff.get('level', '')}".strip() if aff.get("gpu") is not None else None,
            })  # fmt: skip
    return rows


def topology(data: dict) -> dict[str, Any]:
    out = []
    for name, raw in sorted(_dict(data["nodes"]).items()):
        t = _dict(raw)
        env = {str(k): str(v) for k, v in sorted(_dict(t.get("env")).items())}
        numa = {str(k): len(_list(v)) for k, v in sorted(_dict(t.get("numa")).items(), key=lambda kv: str(kv[0]))}
        gpus = [
            {"index": g.get("index"), "bdf": g.get("bdf"), "model": g.get("model"), "numa": g.get("numa_node"),
             "hca": g.get("hca")}
            for g in map(_dict, _list(t.get("gpus")))
        ]  # fmt: skip
        ports = _port_rows(t)
        gids = sorted({str(p["gid_index"]) for p in ports if p["gid_index"] is not None})
        out.append({
            "node": name, "socket_ifname": t.get("socket_ifname"), "rail_rule": t.get("rail_rule"),
            "rails": _list(t.get("rails")), "ports": ports, "gid_indexes": gids, "gpus": gpus, "numa": numa,
            "non_rails": [_dict(x) for x in _list(t.get("non_rail_hcas"))], "env": env,
            "ib_disabled": env.get("NCCL_IB_DISABLE") == "1",
            "warnings": [str(w) for w in _list(t.get("warnings"))],
        })  # fmt: skip
    notes = []
    rails = {n["node"]: len(n["rails"]) for n in out}
    if len(set(rails.values())) > 1:
        most = max(set(rails.values()), key=list(rails.values()).count)
        notes += [f"{n} has {c} rail(s), the others {most}" for n, c in rails.items() if c != most]
    ib_off = [n["node"] for n in out if n["ib_disabled"]]
    warned = [n["node"] for n in out if n["warnings"]]
    summary = f"{len(out)} node(s): " + ", ".join(
        f"{n['node']} {len(n['rails'])} rail(s)" + (f" GID {'/'.join(n['gid_indexes'])}" if n["gid_indexes"] else "")
        for n in out
    )
    if ib_off:
        summary += f"; NCCL_IB_DISABLE=1 (TCP sockets) on {', '.join(ib_off)}"
    return {
        "status": "warn" if warned or notes else "pass",
        "summary": summary,
        "nodes": out,
        "notes": notes,
    }


# ---- staging -------------------------------------------------------------------------------------------


def staging(data: dict) -> dict[str, Any]:
    rows = []
    total = None
    for name, raw in sorted(_dict(data["nodes"]).items()):
        r = _dict(raw)
        total = total if total is not None else _num(r.get("total_bytes"))
        secs = _num(r.get("elapsed_s", r.get("seconds")))
        copied = _num(r.get("bytes_copied")) or 0
        rows.append({
            "node": name, "bytes_copied": int(copied), "total_bytes": r.get("total_bytes"), "seconds": secs,
            "gib_s": copied / secs / GiB if secs and copied else None,
            "source_bytes": int(_num(r.get("source_bytes_read")) or 0),
            "peer_bytes": int(_num(r.get("peer_bytes_read")) or 0),
            "served_bytes": int(_num(r.get("served_bytes")) or 0), "seed": bool(r.get("seed")),
            "state_before": r.get("state_before"), "failed": bool(r.get("failed")),
            "message": str(r.get("msg") or "") if r.get("failed") else "",
            "fallback_files": len(_list(r.get("source_fallback_files"))),
        })  # fmt: skip
    src = sum(r["source_bytes"] for r in rows)
    peer = sum(r["peer_bytes"] for r in rows)
    failed = [r for r in rows if r["failed"]]
    ratio = src / total if total else None
    if failed:
        summary = "FAIL on " + "; ".join(f"{r['node']}: {r['message'][:160] or 'failed'}" for r in failed)
    else:
        summary = f"{data.get('model')} {str(data.get('revision') or '')[:12]} on {len(rows)} node(s)"
        if total and rows and not any(r["bytes_copied"] for r in rows):
            # Every node had the revision already: "read 0.00x" would read like a fault.
            summary += f", {size_text(total)} each; already on every node: nothing copied, shared storage not read"
        elif total:
            summary += f", {size_text(total)} each; shared storage read {ratio:.2f}x the revision"
    return {
        "status": "fail" if failed else "pass",
        "summary": summary,
        "model": data.get("model"),
        "revision": data.get("revision"),
        "total_bytes": total,
        "nodes": rows,
        "source_bytes": src,
        "peer_bytes": peer,
        "source_ratio": ratio,
        "seconds_recorded": any(r["seconds"] is not None for r in rows),
    }


# ---- collective check ------------------------------------------------------------------------------------


def _floor_for(model: str | None, floors: Mapping) -> float | None:
    # The check's own rule (longest name first: "H200" is not judged by the "H20" floor).
    return _num(floor_for(model, floors)) if model else None


def _busbw(ranks: list, ref: int | None) -> tuple[float | None, int | None]:
    """all_reduce busbw of the first rank at the reference size (as slow_nodes judges it), else at the
    largest size measured; (GB/s, bytes)."""
    if not ranks:
        return None, None
    res = [x for x in map(_dict, _list(_dict(ranks[0]).get("results"))) if x.get("op") == "all_reduce"
           and _num(x.get("busbw_GBps")) is not None]  # fmt: skip
    if not res:
        return None, None
    size = ref if ref and any(x.get("bytes") == ref for x in res) else max(int(x.get("bytes") or 0) for x in res)
    return min(float(x["busbw_GBps"]) for x in res if int(x.get("bytes") or 0) == size), size


def nccl(data: dict) -> dict[str, Any]:
    single = _dict(data.get("single"))
    floors = _dict(data.get("floors"))
    models = _dict(data.get("models"))
    ref = data.get("reference_bytes") if isinstance(data.get("reference_bytes"), int) else None
    single_ranks = _dict(data.get("single_ranks"))
    full_by_host: dict[str, list] = {}
    for r in map(_dict, _list(data.get("ranks"))):
        full_by_host.setdefault(str(r.get("host")), []).append(r)
    for ranks in full_by_host.values():
        ranks.sort(key=lambda r: r.get("rank") if isinstance(r.get("rank"), int) else 0)
    slow = _dict(data.get("slow_nodes"))
    bad = set(map(str, _list(data.get("bad_nodes"))))
    nodes = []
    for name in sorted(set(single) | set(single_ranks) | set(slow) | bad):
        ranks = _list(single_ranks.get(name))
        source = "single-node world"
        if not ranks and name in full_by_host:
            ranks, source = full_by_host[name], "full world"
        bw, size = _busbw(ranks, ref)
        floor = _floor_for(models.get(name), floors) if size and size == ref else None
        nodes.append({
            "node": name, "alone": single.get(name), "model": models.get(name), "busbw": bw, "bytes": size,
            "busbw_source": source if bw is not None else None, "floor": floor,
            "ratio": bw / floor if bw is not None and floor else None,
            "slow": slow.get(name), "bad": name in bad,
        })  # fmt: skip
    links = set(_list(data.get("bad_links")))
    pairs = []
    for p in map(_dict, _list(data.get("pairs"))):
        a, b = [*map(str, _list(p.get("pair"))), "?", "?"][:2]
        pairs.append({"a": a, "b": b, "ok": bool(p.get("ok")), "bad_link": f"{a}<->{b}" in links})
    full = _dict(data.get("full"))
    ok = bool(data.get("ok"))
    return {
        "status": "pass" if ok else "fail",
        "summary": str(data.get("verdict") or ("PASS" if ok else "FAIL")),
        "ok": ok,
        "verdict": data.get("verdict"),
        "lines": [str(x) for x in _list(data.get("lines"))],
        "nodes": nodes,
        "pairs": pairs,
        "full_ranks": len(_list(data.get("ranks"))),
        "full_verdict": full.get("verdict"),
        "culprit_ranks": _list(full.get("culprit_ranks")),
        "missing_ranks": _list(full.get("missing_ranks")),
        "bad_nodes": sorted(bad),
        "bad_links": sorted(links),
        "reference_bytes": ref,
        "floors": {str(k): v for k, v in floors.items()},
    }


# ---- engine, cold-start timeline ------------------------------------------------------------------------------


def _gate_label(g: dict) -> str:
    items = [x.get("name") for x in map(_dict, _list(g.get("item"))) if x.get("name")]
    names = items or list(_dict(_dict(g.get("timeline")).get("nodes")))
    label = ",".join(str(n) for n in names) or "deployment"
    return f"{g['replica']}: {label}" if g.get("replica") else label


def replica_engines(records: list[dict]) -> dict:
    """One engine record for a deployment of replicas, from its replicas' (engine-<deployment>-<replica>.json): every
    replica's gates (each labelled with its replica), ok when every replica's gate passed, the first failed
    replica's failure."""
    first = records[0]
    gates = [{**_dict(g), "replica": str(r.get("deployment") or "?")} for r in records for g in _list(r.get("gates"))]
    failed = [r for r in records if not r.get("ok")]
    revisions = sorted({str(r["revision"]) for r in records if r.get("revision")})
    return {**{k: first.get(k) for k in ("engine", "engine_version", "profile", "model", "speculative")},
            "revision": revisions[0] if len(revisions) == 1 else ", ".join(revisions) or None,
            "model_path": first.get("model_path") if len(revisions) <= 1 else None,
            "ok": not failed, "gates": gates, "failure": _dict(failed[0].get("failure")) if failed else None,
            "warmup": first.get("warmup")}  # fmt: skip


def replicas(endpoint: dict, rollout: dict | None, *engines: dict | None) -> dict[str, Any]:
    """The router (kind, node, URL), each replica behind it (its nodes, revision, gate, URL) and the rolling change
    of this run (rollout-<deployment>.json: each replica's step, from and to which revision, how it ended)."""
    by_name = {str(e.get("deployment")): e for e in engines if e}
    rows = []
    for name in map(str, _list(endpoint.get("replicas"))):
        e = by_name.get(name) or {}
        rows.append({"deployment": name, "nodes": [str(n) for n in _list(e.get("nodes"))],
                     "revision": e.get("revision"), "ready": bool(e.get("ok")) if e else None,
                     "in_this_run": bool(e)})  # fmt: skip
    router = {"kind": endpoint.get("router"), "node": endpoint.get("head"), "url": endpoint.get("url")}
    steps, roll = [], _dict(rollout)
    for st in map(_dict, _list(roll.get("steps"))):
        steps.append({"replica": str(st.get("replica") or "?"), "deployment": st.get("deployment"),
                      "nodes": [str(n) for n in _list(st.get("nodes"))], "from": st.get("from"), "to": st.get("to"),
                      "outcome": str(st.get("outcome") or "?"), "seconds": _num(st.get("seconds")),
                      "error": str(st.get("error") or "")})  # fmt: skip
    back = [st for st in steps if st["outcome"] == "rolled back"]
    not_reached = [str(n) for n in _list(roll.get("not_reached"))]
    problems = [f"{r['deployment']} failed its gate" for r in rows if r["ready"] is False]
    text = f"{len(rows)} replica(s) behind {router['kind'] or '?'} on {router['node'] or '?'}"
    if rollout:
        to = str(roll.get("revision") or "?")[:12]
        if back:
            b = back[0]
            problems.append(f"the rollout to {to} stopped at replica {b['replica']} ({', '.join(b['nodes'])}), back on "
                            f"{str(b['from'])[:12]}: {b['error'] or 'no error recorded'}")  # fmt: skip
            if not_reached:
                problems[-1] += f"; not reached: {', '.join(not_reached)}"
        else:
            rolled = sum(st["outcome"] == "rolled" for st in steps)
            text += f"; rollout to {to}: {rolled} rolled, {len(steps) - rolled} already there"
    runs = sorted({str(r["revision"])[:12] for r in rows if r["revision"]})
    if runs:
        text += f"; revision {', '.join(runs)}"
    return {
        "status": "fail" if problems else "pass",
        "summary": "FAIL: " + "; ".join(problems) if problems else text,
        "router": router,
        "replicas": rows,
        "rollout": {"revision": roll.get("revision"), "generated_at": roll.get("generated_at"), "steps": steps,
                    "not_reached": not_reached, "complete": roll.get("complete")} if rollout else None,
        "failed_step": back[0] if back else None,
    }  # fmt: skip


def _first_failed(g: dict) -> dict[str, Any] | None:
    ff = _dict(g.get("first_failed"))
    if not ff:
        return None
    rec = _dict(ff.get("record"))
    first = _dict(rec.get("first_error")).get("line") or _dict(ff.get("rank")).get("line")
    verdict = ff.get("why")
    if rec.get("verdict"):
        verdict = f"{verdict} (termination record: {rec.get('verdict')}, exit {rec.get('exit_code')})"
    return {
        "step": "engine",
        "verdict": verdict,
        "node": ff.get("node"),
        "node_rank": ff.get("node_rank"),
        "rank": rank_text(ff.get("rank")),
        "first_error": first,
        "log_tail": [str(x) for x in _list(ff.get("journal_tail"))],
        "kind": g.get("kind"),
    }


def engine_failure(data: dict) -> dict[str, Any] | None:
    """The engine record's failure summary (gate.deployment_record: verdict, why, node, rank, first_error,
    log_tail), completed from the failed gate's first_failed where it says less."""
    gates = [_dict(g) for g in _list(data.get("gates"))]
    derived = next((f for f in map(_first_failed, gates) if f), None)
    given = _dict(data.get("failure"))
    if not given:
        return derived
    out = dict(derived or {"step": "engine", "log_tail": []})
    verdict = ": ".join(str(given[k]) for k in ("verdict", "why") if given.get(k))
    if verdict:
        out["verdict"] = verdict
    if given.get("node"):
        out["node"] = str(given["node"])
    if given.get("rank") is not None:
        out["rank"] = rank_text(given["rank"])
    first = given.get("first_error")
    first = _dict(first).get("line") if isinstance(first, dict) else first  # the wrapper's {line, at}
    if first:
        out["first_error"] = str(first)
    if _list(given.get("log_tail")):
        out["log_tail"] = [str(x) for x in given["log_tail"]]
    return out


def engine(data: dict) -> dict[str, Any]:
    gates = []
    for g in map(_dict, _list(data.get("gates"))):
        stop = [_dict(s) for s in _list(g.get("stop"))]
        gates.append({
            "label": _gate_label(g), "ready": bool(g.get("ready")), "answer": g.get("answer"),
            "elapsed_s": _num(g.get("elapsed_s")), "kind": g.get("kind"), "failed_nodes": _list(g.get("failed_nodes")),
            "last_problem": g.get("last_problem") or "", "stop": stop,
            "kv": _dict(g.get("kv_transfer")).get("summary"),
        })  # fmt: skip
    ok = bool(data.get("ok"))
    failure = None if ok else engine_failure(data)
    model_path = data.get("model_path")
    if ok:
        answers = ", ".join(sorted({repr(g["answer"]) for g in gates}))
        summary = f"{data.get('engine')} ready on {len(gates)} gate(s), answered {answers}"
    elif failure:
        where = f"{failure.get('node')}" + (f" {failure['rank']}" if failure.get("rank") else "")
        summary = f"FAIL: first failed node {where}: {failure.get('verdict') or failure.get('first_error') or '?'}"
    else:
        summary = "FAIL (the record names no failed node)"
    return {
        "status": "pass" if ok else "fail",
        "summary": summary,
        "ok": ok,
        "engine": data.get("engine"),
        "engine_version": data.get("engine_version"),
        "profile": data.get("profile"),
        "model": data.get("model"),
        "model_path": model_path,
        "revision": data.get("revision"),
        "gates": gates,
        "failure": failure,
    }


def timeline(data: dict) -> dict[str, Any]:
    """Per gate, per node: seconds from the first unit start of the whole deployment (the gates' own t0s
    aligned), with the API's events on the row of the unit that serves it."""
    raw = [(_dict(g), _dict(_dict(g).get("timeline"))) for g in _list(data.get("gates"))]
    t0s = [_num(t.get("t0")) for _, t in raw if _num(t.get("t0")) is not None]
    first = min(t0s) if t0s else None
    out = []
    for g, t in raw:
        shift = (_num(t.get("t0")) - first) if first is not None and _num(t.get("t0")) is not None else 0.0
        head = {k: _num(v) for k, v in _dict(t.get("head")).items()}
        instances = _dict(t.get("instances"))
        router = any(str(n).endswith("/router") for n in _dict(t.get("nodes")))
        failed = set(map(str, _list(g.get("failed_nodes"))))
        rows = []
        for name, raw_row in sorted(
            _dict(t.get("nodes")).items(), key=lambda kv: (_dict(kv[1]).get("rank") or 0, kv[0])
        ):
            row = _dict(raw_row)
            ev = {k: _num(row.get(k)) for k, _ in NODE_EVENTS}
            if instances:  # P/D: each instance's own API; the router's row gets the deployment's API
                api = _dict(instances.get(name)) if not str(name).endswith("/router") else head
            else:
                api = head if row.get("rank") == 0 and not router else {}
            ev.update({k: _num(api.get(k)) for k, _ in API_EVENTS})
            ev = {k: round(v + shift, 2) for k, v in ev.items() if v is not None}
            rows.append({"node": name, "rank": row.get("rank"), "phase": row.get("phase"), "unit": row.get("unit"),
                         "events": ev, "failed": name in failed})  # fmt: skip
        answer = head.get("first_correct_answer")
        seen = {k for r in rows for k in r["events"]}
        out.append({
            "label": _gate_label(g), "ready": bool(g.get("ready")), "rows": rows,
            "columns": [k for k in EVENT_LABELS if k != "kv_transfer_proven" or k in seen],
            "first_correct_answer": round(answer + shift, 2) if answer is not None else None,
            "all_units_active": round(head["all_units_active"] + shift, 2) if head.get("all_units_active") else None,
            "end": max([v for r in rows for v in r["events"].values()] + [0.0]),
        })  # fmt: skip
    answers = [g["first_correct_answer"] for g in out]
    if out and all(a is not None for a in answers):
        status, summary = "pass", f"first correct answer {max(answers):.1f} s after the first unit start"
    else:
        status = "fail"
        reached = [f"{r['node']} {r['phase'] or '?'}" for g in out for r in g["rows"]]
        summary = "no correct answer; phases reached: " + (", ".join(reached) or "none")
    # The warm-up after the gate (engine_warmup_lengths; docs/warmup.md), when the role ran one.
    warm = _dict(data.get("warmup")) or None
    if warm is not None:
        secs = _num(warm.get("wall_s"))
        summary += f"; then warm-up{f' {secs:.1f} s' if secs is not None else ''}: {warm.get('summary') or '-'}"
        if not warm.get("ok") and status == "pass":
            status = "warn"
    return {"status": status, "summary": summary, "gates": out, "events": EVENT_LABELS, "warmup": warm}


# ---- acceptance, bench, scrape targets ------------------------------------------------------------------------


def acceptance(data: dict) -> dict[str, Any]:
    checks = [
        {"name": c.get("name"), "kind": c.get("kind"), "verdict": c.get("verdict"), "why": c.get("why") or "",
         "fix": c.get("fix") or "", "seconds": _num(c.get("seconds"))}
        for c in map(_dict, _list(data["checks"]))
    ]  # fmt: skip
    ok = bool(data.get("accepted"))
    return {
        "status": "pass" if ok else "fail",
        "summary": str(data.get("summary") or ("ACCEPTED" if ok else "NOT ACCEPTED")),
        "accepted": ok,
        "url": data.get("url"),
        "model": data.get("model"),
        "profile": data.get("profile"),
        "elapsed_s": _num(data.get("elapsed_s")),
        "failed": [str(x) for x in _list(data.get("failed"))],
        "checks": checks,
        "warnings": [str(w) for w in _list(data.get("warnings"))],
    }


def speculative(data: dict) -> dict[str, Any]:
    """Speculative decoding from the engine record (docs/speculative-decoding.md): the configuration the role
    launched (`speculative`: {config, enabled}) and, when the record has it, what the engine measured
    (`speculative.measured`: specdecode.parse_metrics of its /metrics) with the verdict."""
    spec = _dict(data.get("speculative"))
    cfg = {k: v for k, v in _dict(spec.get("config")).items() if v not in (None, "")}
    if not cfg:
        # Off is an answer to the section's question, not a missing record: the section passes.
        return {"status": "pass", "summary": "off (engine_speculative is not set for this deployment)",
                "config": {}, "enabled": False, "measured": None, "verdict": None}  # fmt: skip
    enabled = spec.get("enabled") is not False
    steps = int(cfg.get("num_steps") or 0)
    said = f"{cfg.get('method')}, {steps} draft token(s) per step" + (
        f", draft {cfg['draft_model_path']}" if cfg.get("draft_model_path") else ""
    )
    out: dict[str, Any] = {"config": cfg, "enabled": enabled, "measured": None, "verdict": None}
    if not enabled:
        why = f"configured ({said}) but launched without it: engine_speculative_enabled is false"
        return {**out, "status": "warn", "summary": why}
    measured = _dict(spec.get("measured")) or None
    v = specdecode.verdict(measured, steps)
    out.update(measured=measured, verdict=v)
    if measured is None:
        return {**out, "status": "pass", "summary": f"on: {said}; acceptance not measured in this record"}
    line = specdecode.summary(measured, steps).removeprefix("speculative decoding: ")
    return {**out, "status": "warn" if v["verdict"] == "does not pay" else "pass", "summary": f"on: {said}; {line}"}


def _spread(s: dict, key: str) -> dict[str, float | None]:
    v = _dict(s.get(key))
    return {"median": _num(v.get("median")), "min": _num(v.get("min")), "max": _num(v.get("max"))}


def bench(data: dict) -> dict[str, Any]:
    cases = []
    for c in map(_dict, _list(data["cases"])):
        s = _dict(c.get("summary"))
        cases.append({
            "id": c.get("id"), "input_len": c.get("input_len"), "output_len": c.get("output_len"),
            "concurrency": c.get("concurrency"), "status": c.get("status"), "why": c.get("why") or "",
            "requests": c.get("requests"), "completed": c.get("completed"), "success_rate": _num(c.get("success_rate")),
            "out_tok_s": _spread(s, "output_tok_s"), "ttft_p50": _spread(s, "ttft_ms_p50")["median"],
            "ttft_p99": _spread(s, "ttft_ms_p99")["median"], "tpot_p50": _spread(s, "tpot_ms_p50")["median"],
            "e2e_p50": _spread(s, "e2e_ms_p50")["median"], "e2e_p99": _spread(s, "e2e_ms_p99")["median"],
            "gpu_h_per_mtok": _spread(s, "gpu_h_per_mtok")["median"],
            "warnings": [str(w) for w in _list(c.get("warnings"))],
        })  # fmt: skip
    settings = _dict(data.get("settings"))
    ok = bool(data.get("ok"))
    bad = [c for c in cases if c["status"] != "OK"]
    summary = f"{len(cases)} case(s), {len(cases) - len(bad)} OK"
    if bad:
        summary += "; " + "; ".join(f"{c['id']} {c['status']}: {c['why'][:120]}" for c in bad[:3])
    return {
        "status": "pass" if ok else "fail",
        "summary": summary,
        "ok": ok,
        "engine": settings.get("engine"),
        "model": settings.get("model"),
        "gpus": settings.get("gpus"),
        "rounds": settings.get("rounds"),
        "tool": " ".join(map(str, _list(settings.get("tool")))),
        "started": data.get("started"),
        "finished": data.get("finished"),
        "wall_s": _num(data.get("wall_s")),
        "cases": cases,
    }


def scrape_targets(endpoint: dict | None, engine: dict | None) -> dict[str, Any]:
    """The engines' own /metrics as Prometheus scrape targets (the deployment's API; P/D: the router's and
    each instance's)."""
    endpoint, engine = endpoint or {}, engine or {}
    kind = engine.get("engine") or endpoint.get("engine")
    profile = engine.get("profile") or endpoint.get("profile")
    url = str(endpoint.get("url") or "").rstrip("/")
    targets = []
    # What the engine's own /metrics is: the profile's words (P/D: the router's address), else its engine's.
    own = engines.PROFILES.get(str(kind)) if kind in engines.engines() else None
    prof = engines.PROFILES.get(str(profile))
    replicas = [_dict(r) for r in _list(endpoint.get("replica_endpoints")) if _dict(r).get("url")]
    if replicas and own is not None and own.metrics:
        # Each replica's own API; the router's port serves no /metrics (its listener is on its node's loopback).
        for r in replicas:
            what = f"replica {r.get('deployment')} (head {r.get('head')}): {own.metrics}"
            targets.append({"url": f"{str(r['url']).rstrip('/')}/metrics", "engine": kind, "what": what})
        targets.append({"url": None, "engine": endpoint.get("router"),
                        "what": f"the router's own metrics: {endpoint.get('router')} on {endpoint.get('head')}, its "
                                "Prometheus listener on that node's loopback (port 29000 unless engine_replica_router"
                                "_extra_args say --prometheus-port): scrape it from the node"})  # fmt: skip
    elif url and endpoint.get("router") and endpoint.get("replicas"):
        targets.append({"url": None, "engine": kind,
                        "what": f"the router ({endpoint.get('router')}) serves no /metrics on {url}, and this "
                                "endpoint record names no replica's own address (written by an older llmfleet): "
                                "run the engine role again"})  # fmt: skip
    elif url and own is not None and own.metrics:
        what = prof.metrics if prof is not None and prof.engine == kind and prof.metrics else own.metrics
        targets.append({"url": f"{url}/metrics", "engine": kind, "what": what})
    elif url:
        what = f"engine {kind!r}: no /metrics endpoint known to llmfleet"
        targets.append({"url": None, "engine": kind, "what": what})
    if not url:
        targets.append({"url": None, "engine": kind,
                        "what": "no endpoint published for this deployment (the engine role publishes it once the "
                                "gate passed)"})  # fmt: skip
    targets.append({"url": None, "engine": None,
                    "what": "llmfleet's own metrics of each node: node_exporter's textfile collector there "
                            "(llmfleet_metrics_dir, docs/metrics.md)"})  # fmt: skip
    summary = ", ".join(t["url"] for t in targets if t["url"]) or "none known"
    return {"status": "pass" if url and summary != "none known" else "warn", "summary": summary, "targets": targets}
