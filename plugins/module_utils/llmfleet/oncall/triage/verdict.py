"""``llmfleet why --bundle DIR [--json]``: why did an engine unit die, from an incident bundle.

A bundle (docs/runbook.md "Why did it die"; layout in BUNDLE_LAYOUT) holds per node the unit's journal, the kernel
log, ``systemctl show`` and the wrapper's termination record. ``analyse(DIR)`` returns one verdict per unit (cause,
time, evidence lines with file:line, red herrings ruled out and why) and, across the nodes of one deployment (the
same unit name), which node failed first: later peers' errors are its consequences. The files are read by
parse.py; one unit is judged by unit.py (how each run ended: run.py; the kernel's events:
kernel.py); what lines mean is in rules.py. Stdlib only, Python >= 3.8.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from .parse import Line, gpu_indices, iso, kernel_events, parse_journal
from .unit import UnitAnalysis, read_text

SCHEMA = "llmfleet.why/1"
BUNDLE_LAYOUT = (
    "DIR/<node>/journal-<unit>.txt (journalctl -u UNIT -o short-iso), DIR/<node>/kernel.txt (journalctl -k -o "
    "short-iso), DIR/<node>/unit-<unit>.show (systemctl show UNIT), DIR/<node>/termination-<unit>.json[.N] "
    "(the wrapper's records, optional), DIR/<node>/nvidia-smi.txt (optional); `llmfleet bundle -o DIR` writes one"
)
FIRST_KEYS = ("node", "unit", "verdict", "label", "at_iso", "cause")
STOPS = ("stopped-by-operator", "stop-timeout")  # how a requested stop ends
FOLLOWERS = (*STOPS, "deployment-stopped")  # stopped because of another node (the deployment link)
SKEW_S = 2  # failures on two nodes closer than this are ordered by two clocks: said so
_FILES = (
    ("journal", re.compile(r"^journal-(.+)\.txt$")),
    ("show", re.compile(r"^unit-(.+)\.show$")),
    ("record", re.compile(r"^termination-(.+)\.json(?:\.(\d+))?$")),  # .N: rotated by a restart (docs/wrapper.md)
)


class BundleError(ValueError):
    """The directory is not a readable incident bundle (exit 2)."""


def _node_files(ndir: str) -> dict[str, dict[str, Any]]:
    units: dict[str, dict[str, Any]] = {}
    try:
        names = sorted(os.listdir(ndir))
    except OSError:
        return units
    for name in names:
        for kind, rx in _FILES:
            m = rx.match(name)
            if not m:
                continue
            u = units.setdefault(m.group(1), {"journal": None, "show": None, "records": []})
            if kind == "record":
                u["records"].append((int(m.group(2) or 0), os.path.join(ndir, name)))
            else:
                u[kind] = os.path.join(ndir, name)
    return units


def scan(bundle: str) -> dict[str, dict[str, Any]]:
    """{node: {"units": {unit: {"journal", "show", "records": [(n, path)]}}, "kernel", "smi"}}; BundleError when
    DIR is missing or holds no node directory with a unit's files."""
    if not os.path.isdir(bundle):
        what = "does not exist" if not os.path.exists(bundle) else "is not a directory"
        raise BundleError(f"--bundle {bundle} {what}. An incident bundle is a directory: {BUNDLE_LAYOUT}")
    try:
        entries = sorted(os.listdir(bundle))
    except OSError as e:
        raise BundleError(f"--bundle {bundle}: cannot list it ({e.strerror or e})") from None
    nodes: dict[str, dict[str, Any]] = {}
    for node in entries:
        ndir = os.path.join(bundle, node)
        if not os.path.isdir(ndir):
            continue
        kernel, smi = os.path.join(ndir, "kernel.txt"), os.path.join(ndir, "nvidia-smi.txt")
        units = _node_files(ndir)
        if units or os.path.isfile(kernel):
            nodes[node] = {"units": units, "kernel": kernel if os.path.isfile(kernel) else None,
                           "smi": smi if os.path.isfile(smi) else None}  # fmt: skip
    if not any(n["units"] for n in nodes.values()):
        flat = [n for n in entries if any(rx.match(n) for _, rx in _FILES) or n == "kernel.txt"]
        hint = (f" It holds {', '.join(flat[:3])} itself: that is one node's directory; give its parent, whose "
                "subdirectories are named after the nodes.") if flat else ""  # fmt: skip
        raise BundleError(
            f"--bundle {bundle} is not an incident bundle: no <node>/journal-<unit>.txt, "
            f"unit-<unit>.show or termination-<unit>.json in it.{hint} Expected: {BUNDLE_LAYOUT}"
        )
    return nodes


def _node_context(node: str, nd: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    klines: list[Line] = []
    if nd["kernel"]:
        text = read_text(nd["kernel"], warnings) or ""
        text = "" if text.strip() == "-- No entries --" else text  # journalctl's answer for an empty log
        klines, stats = parse_journal(text, os.path.join(node, "kernel.txt"))
        if stats["lines"] and not stats["parsed"]:
            warnings.append(f"{nd['kernel']}: no journalctl short-iso timestamps; collect it with "
                            "`journalctl -k -o short-iso`")  # fmt: skip
    else:
        warnings.append(f"{node}: no kernel.txt: OOM kills, GPU Xids, NFS and I/O errors cannot be seen")
    gpus, gone = gpu_indices(read_text(nd["smi"], warnings) or "") if nd["smi"] else ({}, set())
    return {"events": kernel_events(klines), "gpus": gpus, "gpus_gone": gone}


# ---- across nodes -------------------------------------------------------------------------------------------------


def _at(u: dict[str, Any]) -> float:
    return u["at"] if u["at"] is not None else float("inf")


def _linked(u: dict[str, Any]) -> bool:
    return u["details"].get("mechanism") == "peer-failed" or u["verdict"] == "peer-failed"


def _lost(members: list[dict[str, Any]]) -> tuple[str, list[str]] | None:
    """The node the others lost contact with (the deployment link's words, or a barrier that waited for it in vain),
    with its witnesses: the one most nodes name, when no other is named as often (two nodes that lost each other
    are a tie: nothing says which side failed). The worker's name for the head, "head", is the head's node."""
    head = next((u["node"] for u in members if u["details"].get("link_role") == "head"), "head")
    said: dict[str, set[str]] = {}
    for u in members:
        d = u["details"]
        named = ([d["peer"]] if d.get("peer_lost") and d.get("peer") else []) + list(d.get("missing") or [])
        for n in (head if m == "head" else m for m in named):
            if n != u["node"]:
                said.setdefault(n, set()).add(u["node"])
    ranked = sorted(said.items(), key=lambda kv: -len(kv[1]))
    if not ranked or (len(ranked) > 1 and len(ranked[1][1]) == len(ranked[0][1])):
        return None
    return ranked[0][0], sorted(ranked[0][1])


def _lost_origin(name: str, members: list[dict[str, Any]], units: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where a deployment whose failures are all the link's started: the node the others lost contact with (its
    unit, or one made up for it when nothing of it could be collected: a host down or unreachable)."""
    failed = [u for u in members if u["failed"]]
    if not failed or any(not (_linked(u) or u["verdict"] == "link-failed") for u in failed):
        return None  # a node failed with a cause of its own: the first of those is the story
    found = _lost(members)
    if found is None:
        return None
    node, witnesses = found
    origin = next((u for u in members if u["node"] == node), None)
    ats = [u["at"] for u in members if u["node"] in witnesses and u["at"] is not None]
    said = f"the other nodes lost contact with {node} ({len(witnesses)} witness(es): {', '.join(witnesses)})"
    if origin is None:  # nothing of it in the bundle
        at = min(ats) if ats else None
        origin = {
            "node": node, "unit": name, "launched_by_llmfleet": None, "record": False, "verdict": "node-lost",
            "label": "lost: its host is down or unreachable", "failed": True, "at": at, "at_iso": iso(at),
            "cause": f"{said}, and nothing of it could be collected: its host is down, or unreachable from here too; "
                     "the others wait for it at the deployment link", "strong": True, "evidence": [],
            "details": {"witnesses": witnesses}, "ruled_out": [], "started_at_iso": None, "ended_at_iso": None,
            "state": {}, "cgroup": None, "role": "cause", "consequence_of": None, "runs": [],
        }  # fmt: skip
        units.append(origin)
        members.append(origin)
        return origin
    own = origin["cause"]
    origin.update(role="cause", consequence_of=None, strong=True, label="lost contact with the others",
                  cause=f"{said}: its network or host failed, not its engine; its own view: {own}")  # fmt: skip
    origin["details"]["witnesses"] = witnesses
    return origin


def _relate(units: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Units of one name on several nodes are one deployment: its first failure in time is the cause; later
    failures without a cause of their own (NCCL errors, a dead worker, exit 0) and stops are its consequences.
    A requested stop before a failure that has no cause of its own is where it started (a rank lost its peer).
    When every failure is the deployment link's (no node failed by itself: a partition, a host gone), the node
    the others lost contact with is where it started, however the clocks order the records."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for u in units:
        groups.setdefault(u["unit"], []).append(u)
    deployments = []
    for name, members in groups.items():
        # A node the deployment link stopped because another failed is a consequence whatever the clocks say:
        # both end within the same second, and the link's own line names the node that failed.
        failed = sorted((u for u in members if u["failed"]), key=lambda u: (_linked(u), _at(u), not u["strong"]))
        stopped = sorted((u for u in members if u["details"].get("mechanism") in STOPS), key=_at)
        first = _lost_origin(name, members, units) if len(members) > 1 else None
        first = first or (failed[0] if failed else None)
        origin = first
        if first and not first["strong"] and stopped and _at(stopped[0]) <= _at(first):
            origin = stopped[0]
            origin["role"] = "stopped-first"
        dep: dict[str, Any] = {"unit": name, "nodes": [u["node"] for u in members], "first_failure": None,
                               "origin": None, "note": None}  # fmt: skip
        if first:
            dep["first_failure"] = {k: first[k] for k in ("node", "verdict", "label", "at_iso")}
            dep["origin"] = {k: origin[k] for k in ("node", "verdict", "label", "at_iso")}  # type: ignore[index]
        if origin is None or len(members) == 1:
            deployments.append(dep)
            continue
        for u in members:
            if u is origin:
                continue
            _follow(u, origin, dep)
        deployments.append(dep)
    return deployments


def _follow(u: dict[str, Any], origin: dict[str, Any], dep: dict[str, Any]) -> None:
    """u's role after the deployment's origin (its first failure, or a requested stop before it)."""
    dt = (u["at"] - origin["at"]) if u["at"] is not None and origin["at"] is not None else None
    later = f"; this node {'was stopped' if not u['failed'] else 'failed'} {dt:.0f} s later" if dt is not None else ""
    how = "was stopped on request" if not origin["failed"] else "failed first"
    ref = {"node": origin["node"], "verdict": origin["verdict"], "at_iso": origin["at_iso"]}
    if u["failed"] and u["strong"]:
        u["role"] = "independent"
        u["cause"] += f" (after {origin['node']} {how}{later.replace('; this node', ',')}, with a cause of its own)"
    elif u["failed"] or u["details"].get("mechanism") in FOLLOWERS:
        u["role"], u["consequence_of"] = "consequence", u["consequence_of"] or ref
        u["cause"] = (f"a consequence: {origin['node']} {how} ({origin['label']} at {origin['at_iso']}){later}; "
                      f"a rank whose peer goes away reports exactly this. Its own signs: {u['cause']}")  # fmt: skip
    else:
        u["role"] = "waiting"
        u["cause"] += (f"; {origin['node']} {how} at {origin['at_iso']}: this node's ranks may be stuck in a "
                       "collective until the distributed timeout (600 s in vLLM)")  # fmt: skip
    if dt is not None and abs(dt) < SKEW_S and u["failed"] and origin["failed"] and not _linked(u):
        dep["note"] = (f"{origin['node']} and {u['node']} failed within {abs(dt):.1f} s: the order rests on their "
                       "clocks (check clock sync) and on which signs are causes")  # fmt: skip


def analyse(bundle_dir: str) -> dict[str, Any]:
    """The triage of an incident bundle (raises BundleError for a directory that is not one)."""
    nodes = scan(bundle_dir)
    warnings: list[str] = []
    unreadable: list[str] = []  # files or units nothing could be read from: "no failure" cannot be said
    units: list[dict[str, Any]] = []
    for node, nd in nodes.items():
        ctx = _node_context(node, nd, warnings)
        for unit, files in sorted(nd["units"].items()):
            u = UnitAnalysis(node, unit, files, ctx).analyse()
            warnings.extend(u.pop("warnings"))
            unreadable.extend(u.pop("unreadable"))
            units.append(u)
    deployments = _relate(units)
    causes = [u for u in units if u["failed"] and u["role"] in ("cause", "independent")]
    causes = causes or [u for u in units if u["failed"]]  # every failure follows a requested stop
    same: dict[tuple[str, str], list[str]] = {}
    for u in causes:
        exc = u["details"].get("exception")
        same.setdefault((u["label"], f"{exc['type']}: {exc['message']}" if exc else ""), []).append(
            f"{u['node']} {u['unit']}"
        )
    first = min(causes, key=lambda u: u["at"] if u["at"] is not None else float("inf")) if causes else None
    return {
        "schema": SCHEMA, "bundle": bundle_dir, "failed": any(u["failed"] for u in units),
        "first_failure": {k: first[k] for k in FIRST_KEYS} if first else None,
        "same_cause": [{"label": k[0], "error": k[1] or None, "units": v} for k, v in same.items() if len(v) > 1],
        "deployments": deployments, "units": units, "warnings": warnings, "unreadable": unreadable,
    }  # fmt: skip


# ---- output -------------------------------------------------------------------------------------------------------


def _ref(e: dict[str, Any]) -> str:
    return f"{e['file']}:{e['line']}" if e.get("line") else e["file"]


def _headline(report: dict[str, Any]) -> str:
    ff, bad = report["first_failure"], report.get("unreadable")
    if ff:
        n = sum(u["failed"] for u in report["units"])
        return f"FAILED: {n} unit(s) failed; first: {ff['node']} {ff['unit']}: {ff['label']} at {ff['at_iso']}"
    if bad:
        return (f"NOT JUDGED: no failure in what could be read, but {len(bad)} input(s) could not be read: "
                f"{'; '.join(bad[:3])}")  # fmt: skip
    return "NO FAILURE: every unit is running or was stopped on request"


def render(report: dict[str, Any]) -> str:
    units = report["units"]
    nodes = sorted({u["node"] for u in units})
    out = [f"llmfleet why: {report['bundle']}: {len(nodes)} node(s), {len(units)} unit(s)"]
    out.append(_headline(report))
    for g in report["same_cause"]:
        err = f" ({g['error'][:120]})" if g["error"] else ""
        out.append(f"same cause on {len(g['units'])} units: {g['label']}{err}: {', '.join(g['units'])}")
    for dep in report["deployments"]:
        o = dep["origin"]
        if len(dep["nodes"]) > 1 and o:
            what = "first failure" if o == dep["first_failure"] else "first event: a requested stop"
            out.append(
                f"deployment {dep['unit']} on {len(dep['nodes'])} nodes: {what} on {o['node']} ({o['label']} at "
                f"{o['at_iso']}); failures on the other nodes without a cause of their own are its consequences"
            )
        if dep["note"]:
            out.append(f"  note: {dep['note']}")
    order = sorted(units, key=lambda u: (not u["failed"], u["at"] if u["at"] is not None else float("inf")))
    for u in order:
        role = {
            "cause": "",
            "consequence": f"  [consequence of {(u['consequence_of'] or {}).get('node')}]",
            "independent": "  [independent failure]",
            "waiting": "  [still running]",
            "stopped-first": "  [stopped before the failures]",
        }.get(u["role"] or "", "")
        at = f" at {u['at_iso']}" if u["at_iso"] else ""
        out += ["", f"{u['node']}  {u['unit']}: {u['label'].upper()}{at}{role}", f"  cause:     {u['cause']}"]
        for i, e in enumerate(u["evidence"]):
            out.append(f"  {'evidence:' if i == 0 else '':10} {_ref(e)}  {e['text'][:200]}")
        if u["ruled_out"]:
            out.append("  ruled out:")
            for r in u["ruled_out"]:
                where = f" ({_ref(r['evidence'][0])})" if r["evidence"] else ""
                out.append(f"    - {r['what'][:160]}{where}: {r['why']}")
        if len(u["runs"]) > 1:
            runs = ", ".join(f"{r['started_at'] or '?'} {r['verdict']}" for r in u["runs"])
            out.append(f"  runs:      {len(u['runs'])} in the journal: {runs}")
    if report["warnings"]:
        out.append("")
        out += [f"warning: {w}" for w in report["warnings"]]
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bundle", metavar="DIR", help="incident bundle directory (`llmfleet bundle -o DIR` writes one)"
    )
    parser.add_argument("--json", action="store_true", help="print the JSON report")


def run(args: argparse.Namespace) -> int:
    """`llmfleet why`: 0 no failure (running, or stopped on request), 1 a failure found, 2 not a bundle, or no
    failure found but part of it could not be read (a malformed record, an unreadable file, a unit with nothing)."""
    if not args.bundle:
        print(f"llmfleet why: give --bundle DIR, an incident bundle: {BUNDLE_LAYOUT}", file=sys.stderr)
        return 2
    try:
        report = analyse(args.bundle)
    except BundleError as e:
        print(f"llmfleet why: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else render(report))
    if report["failed"]:
        return 1
    if report["unreadable"]:
        print(f"llmfleet why: cannot say there was no failure: {'; '.join(report['unreadable'][:5])}. Fix or remove "
              "those files, or collect the bundle again (llmfleet bundle -o DIR)", file=sys.stderr)  # fmt: skip
        return 2
    return 0
