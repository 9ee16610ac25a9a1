"""`llmfleet rdma-proof [-i INV] [--sysfs-root DIR] [--duration S] [-- CMD...]`: did the traffic go over RDMA?

Reads every HCA port's `port_xmit_data` / `port_rcv_data` (sysfs, in units of 4 bytes: multiplied by 4 here)
on all nodes before and after CMD (run on this ops host, e.g. a benchmark or the NCCL check playbook) or a sleep
of --duration seconds, and prints the bytes per port per node. The rails that should carry the traffic are the
ports the node's fabric env selects (llmfleet_fabric_env: NCCL_IB_HCA, with NCCL's syntax: prefixes, `=` exact,
`^` exclude, `:port`; and UCX_NET_DEVICES `hca:port` entries, the P/D KV path); a zero delta on one of them, or a
rail the env names that sysfs does not have, is called out, and the exit status is 1. Also 1 when CMD fails
or a node cannot be read. Without NCCL_IB_HCA there is no rail to hold to account: the deltas are printed only.
The counters are the port's, not the engine's: other traffic on the same ports counts too.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from typing import Any

from ..cli_grammar import positive_seconds
from . import common
from .common import AutoTransport, NodeResult, UsageError, quote, table, where

WORD = 4  # port_xmit_data / port_rcv_data count 4-byte words (octets divided by 4)


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_fleet_arguments(p, deployment=False, timeout=30.0)
    p.add_argument("--sysfs-root", default="/sys", help="sysfs root on the nodes (default /sys; tests use fake trees)")
    p.add_argument(
        "--duration", type=positive_seconds, default=10.0, help="without CMD: seconds between the readings (default 10)"
    )
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD", help="run CMD here between the readings")


def run(args: argparse.Namespace, transport: Any = None) -> int:
    return common.guarded("rdma-proof", lambda: _run(args, transport))


def hca_filter(text: str) -> tuple[bool, bool, list[tuple[str, str | None]]]:
    """NCCL_IB_HCA -> (exclude, exact, [(name, port or None)])."""
    s = text.strip()
    exclude = s.startswith("^")
    s = s[1:] if exclude else s
    exact = s.startswith("=")
    s = s[1:] if exact else s
    entries = []
    for item in s.split(","):
        name, _, port = item.strip().partition(":")
        if name:
            entries.append((name, port or None))
    return exclude, exact, entries


def rails(env: dict, ports: list[tuple[str, str]]) -> tuple[set[tuple[str, str]], list[str]]:
    """(the ports that should carry traffic, names the env gives that sysfs lacks)."""
    want: set[tuple[str, str]] = set()
    missing = []
    if env.get("NCCL_IB_HCA"):
        exclude, exact, entries = hca_filter(env["NCCL_IB_HCA"])

        def match(h: str, p: str, name: str, port: str | None) -> bool:
            return (h == name if exact else h.startswith(name)) and port in (None, p)

        for h, p in ports:
            if any(match(h, p, n, q) for n, q in entries) != exclude:
                want.add((h, p))
        if not exclude:
            missing += [f"{n}{':' + q if q else ''} (NCCL_IB_HCA)" for n, q in entries
                        if not any(match(h, p, n, q) for h, p in ports)]  # fmt: skip
    for item in (env.get("UCX_NET_DEVICES") or "").split(","):
        name, sep, port = item.strip().partition(":")
        if sep and name:  # hca:port entries; `all` and plain netdevs name no HCA port
            if (name, port) in ports:
                want.add((name, port))
            else:
                missing.append(f"{name}:{port} (UCX_NET_DEVICES)")
    return want, missing


def compare(before: NodeResult, after: NodeResult) -> tuple[dict, list[str]]:
    """One node's per-port deltas and its call-outs."""
    n = before.node
    doc: dict[str, Any] = {"node": n.name, "rank": n.rank, "error": before.error or after.error, "ports": []}
    if before.data is None or after.data is None:
        return doc, [f"{n.name}: cannot read the counters: {doc['error']}"]
    b, a = before.data, after.data
    ports = [(h, p) for h in sorted(a["hcas"]) for p in sorted(a["hcas"][h])]
    env = b.get("env") or {}
    want, missing = rails(env, ports)
    doc.update(env=env, env_error=b.get("env_error"), sysfs=b.get("root"), missing=missing)
    calls = [f"{n.name}: the fabric env names {m}, but {b.get('root')} has no such HCA port" for m in missing]
    for h, p in ports:
        x0, x1 = b["hcas"].get(h, {}).get(p, {}), a["hcas"][h][p]
        row: dict[str, Any] = {"port": f"{h}:{p}", "rail": (h, p) in want, "state": x1.get("state"),
                               "link_layer": x1.get("link_layer")}  # fmt: skip
        for k in ("xmit", "rcv"):
            v0, v1 = x0.get(k), x1.get(k)
            row[f"{k}_bytes"] = (v1 - v0) * WORD if isinstance(v0, int) and isinstance(v1, int) else None
        doc["ports"].append(row)
        if row["xmit_bytes"] is None or row["rcv_bytes"] is None:
            if row["rail"]:
                calls.append(f"{n.name}: {row['port']}: counters unreadable (port_xmit_data/port_rcv_data)")
        elif row["xmit_bytes"] < 0 or row["rcv_bytes"] < 0:
            row["note"] = "counter went backwards (reset or 32-bit wrap): delta not meaningful"
        elif row["rail"] and row["xmit_bytes"] + row["rcv_bytes"] == 0:
            row["note"] = "ZERO: a rail of the fabric env, but it carried nothing"
            calls.append(f"{n.name}: {row['port']} carried no traffic although the fabric env selects it")
    return doc, calls


def human(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def run_cmd(cmd: list[str], to_stderr: bool) -> int:
    """CMD's exit status; its output passes through (to stderr with --json: stdout stays one JSON document)."""
    try:
        if not to_stderr:
            return subprocess.run(cmd, check=False).returncode
        try:
            fd = sys.stderr.fileno()
        except (AttributeError, ValueError):  # stderr is not a file (captured): copy the output over
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
            sys.stderr.write(p.stdout.decode("utf-8", "replace"))
            return p.returncode
        return subprocess.run(cmd, stdout=fd, check=False).returncode
    except OSError as e:
        raise UsageError(f"CMD {cmd[0]!r}: {e.strerror}") from None


def _run(args: argparse.Namespace, transport: Any) -> int:  # noqa: PLR0912 (read, run, read, report)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if cmd and not shutil.which(cmd[0]):
        raise UsageError(f"CMD {cmd[0]!r}: not found on this host (give a program on PATH, after --)")
    fleet = common.fleet_of(args)
    t = transport or AutoTransport()

    def read(node):
        spec = {"op": "counters", "sysfs_root": args.sysfs_root, "fabric_env": node.fabric_env}
        return common.call_probe(t, node, spec, args.timeout)

    cmd_rc = None
    try:
        before = common.fan_out(fleet.nodes, read)
        t0 = time.monotonic()
        if cmd:
            print(f"running: {quote(cmd)}", file=sys.stderr, flush=True)
            cmd_rc = run_cmd(cmd, args.json)
        else:
            time.sleep(args.duration)
        seconds = time.monotonic() - t0
        after = common.fan_out(fleet.nodes, read)
    finally:
        if transport is None:
            t.close()
    docs, calls = [], []
    for b, a in zip(before, after):
        d, c = compare(b, a)
        docs.append(d)
        calls += c
    if cmd_rc not in (None, 0):
        calls.append(f"CMD exited {cmd_rc}: {quote(cmd)}")
    no_rails = [d["node"] for d in docs if not d.get("error") and not (d.get("env") or {}).get("NCCL_IB_HCA")]
    if args.json:
        common.emit_json({"command": cmd or None, "cmd_rc": cmd_rc, "seconds": round(seconds, 3), "word_bytes": WORD,
                   "ok": not calls, "called_out": calls, "no_nccl_ib_hca": no_rails, "nodes": docs})  # fmt: skip
        return 1 if calls else 0
    around = f"around `{quote(cmd)}`" if cmd else "over a sleep"
    print(
        f"rdma-proof: {len(docs)} node(s), {around} ({seconds:.1f} s); bytes = counter delta x {WORD}; {where(fleet)}"
    )
    rows = [["NODE", "PORT", "RAIL", "XMIT", "RCV", "STATE", "NOTE"]]
    for d in docs:
        if d.get("error"):
            rows.append([d["node"], f"UNREADABLE: {d['error']}"])
        elif not d["ports"]:
            rows.append([d["node"], f"(no HCA under {d.get('sysfs')})"])
        for r in d["ports"]:
            rows.append([d["node"], r["port"], "yes" if r["rail"] else "-", human(r["xmit_bytes"]),
                         human(r["rcv_bytes"]), r["state"] or "?", r.get("note", "")])  # fmt: skip
    print("\n".join(table(rows)))
    if no_rails:
        print(f"note: no NCCL_IB_HCA in the fabric env of {', '.join(no_rails)}: no rail there to hold to account")
    for c in calls:
        print(f"CALLED OUT: {c}")
    print("every rail carried traffic" if not calls else f"{len(calls)} call-out(s)")
    return 1 if calls else 0
