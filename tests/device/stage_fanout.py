#!/usr/bin/env python3
"""Staging fan-out on one many-core machine: N "nodes" as processes, each with its own staging root, peers over
loopback HTTP (llmfleet's swarm: relay tree, cut-through, status long polls), against one node staging alone
and N nodes each reading the source. The lab's 4 nodes share 2 CPUs, so there 4 nodes do 4x one node's hashing
on the same cores; here each node has cores of its own, the closest this project gets to separate machines.
Roots and source on tmpfs when it is large enough (disk is then not the shared limit either; fsync is a no-op
there, so the figures are hashing, copying and the protocol, not NVMe). Stdlib and llmfleet's module_utils only:
the device machine has no network and no venv of ours.

    python3 tests/device/stage_fanout.py OUT [--gb 4] [--nodes 4] [--threads 4] [--repeat 2] [--base DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "module_utils"))

from llmfleet.stage import staging as stage  # noqa: E402
from llmfleet.stage import swarm  # noqa: E402
from llmfleet.stage.manifest import build_manifest  # noqa: E402

REV = "f" * 40
FABRIC_KEY = b"stage-fanout-fabric-key-0123456789abcdef"  # every peer request proves it, as on nodes
GiB = 1024**3
BLOCK = 16 * 1024 * 1024


def make_source(d: Path, total: int, shards: int) -> None:
    """A valid safetensors checkpoint (publishing checks its structure) of about total bytes, shards differing.
    The same layout as bench/stage_bench.make_revision, written again here: that one needs tests.helpers.ckpt
    (numpy, safetensors) and the lab's code, which the device machine has no venv for."""
    d.mkdir(parents=True, exist_ok=True)
    block = os.urandom(BLOCK)
    rows = max(1, total // shards // (4096 * 2))
    n = rows * 4096 * 2
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        header = json.dumps({f"layers.{i}.w": {"dtype": "F16", "shape": [rows, 4096], "data_offsets": [0, n]}})
        header = header.encode() + b" " * (-len(header) % 8)
        with open(d / name, "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
            left = n
            while left:
                k = min(left, BLOCK)
                f.write(block[:k])
                left -= k
            block = block[1:] + block[:1]  # every shard differs
        weight_map[f"layers.{i}.w"] = name
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (d / "config.json").write_text("{}")
    (d / "tokenizer.json").write_text("{}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(
    h: str, req_kw: dict, cfg_kw: dict, q: mp.Queue, cpus: list[int] | None = None, tune: dict | None = None
) -> None:
    try:
        from llmfleet.stage import peer, transfer

        for k, v in (tune or {}).items():  # experiments: transfer.CHUNK, peer._TICK_S
            setattr(transfer if k == "CHUNK" else peer, k, v)
        if cpus:
            os.sched_setaffinity(0, cpus)
        r = swarm.run_node(stage.StageRequest(**req_kw), swarm.SwarmConfig(me=h, **cfg_kw))
        q.put((h, {k: r.get(k) for k in ("elapsed_s", "source_bytes_read", "peer_bytes_read", "served_bytes",
                                          "cpu_s", "source_fallback_files")}))  # fmt: skip
    except Exception as e:  # reported in the table, not a traceback
        q.put((h, {"error": f"{type(e).__name__}: {e}"}))


def world(base: Path, src: Path, manifest: dict, hosts: list[str], *, peers: bool, seeds: list[str],
          threads: int, pin: int = 0, fanout: int = swarm.RELAY_FANOUT, tune: dict | None = None) -> tuple[float, dict]:  # fmt: skip
    """One staging run of hosts; with pin, node i runs on CPUs [i*pin, (i+1)*pin) alone, the way a node of its own
    has its own cores (its network work included: loopback's softirq runs on the sending and receiving CPUs)."""
    for h in hosts:
        shutil.rmtree(base / "roots" / h, ignore_errors=True)
    shutil.rmtree(base / "leases", ignore_errors=True)
    ports = {h: free_port() for h in hosts}
    urls = {h: f"http://127.0.0.1:{ports[h]}" for h in hosts} if peers else {}
    q: mp.Queue = mp.Queue()
    procs = []
    t0 = time.monotonic()
    for i, h in enumerate(hosts):
        req_kw = {"root": str(base / "roots" / h), "model": "m", "revision": REV, "manifest": manifest,
                  "threads": threads}  # fmt: skip
        cfg_kw = {"source_dir": str(src), "lease_dir": str(base / "leases"), "max_source_readers": len(hosts),
                  "peers": urls, "seeds": seeds, "serve_bind": "127.0.0.1", "serve_port": ports[h] if peers else 0,
                  "finish_wait": 600, "relay_fanout": fanout, "peer_key": FABRIC_KEY}  # fmt: skip
        cpus = list(range(i * pin, (i + 1) * pin)) if pin else None
        p = mp.Process(target=node, args=(h, req_kw, cfg_kw, q, cpus, tune))
        p.start()
        procs.append(p)
    res = dict(q.get(timeout=1800) for _ in hosts)
    for p in procs:
        p.join(60)
    return time.monotonic() - t0, res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--base", type=Path)
    ap.add_argument("--fanout", type=int, default=swarm.RELAY_FANOUT, help="relay tree fan-out (1: a chain per file)")
    ap.add_argument("--chunk-mib", type=int, help="copy block (transfer.CHUNK) in MiB")
    ap.add_argument("--tick-ms", type=float, help="a cut-through sender's look at a growing file (peer._TICK_S)")
    ap.add_argument("--pin", action="store_true", help="give each node CPUs of its own (CPUs / nodes each)")
    a = ap.parse_args()
    pin = (os.cpu_count() or 1) // a.nodes if a.pin else 0
    tune = {}
    if a.chunk_mib:
        tune["CHUNK"] = a.chunk_mib * 1024 * 1024
    if a.tick_ms is not None:
        tune["_TICK_S"] = a.tick_ms / 1000
    need = a.gb * GiB * (a.nodes + 1) * 1.1
    base = a.base
    if base is None:
        shm = Path("/dev/shm")
        base = (
            shm / "llmfleet-fanout"
            if shm.is_dir() and shutil.disk_usage(shm).free > need
            else Path("/tmp/llmfleet-fanout")
        )
    shutil.rmtree(base, ignore_errors=True)
    src = base / "src"
    make_source(src, int(a.gb * GiB), a.shards)
    t0 = time.monotonic()
    manifest = build_manifest(str(src), threads=a.threads, revision=REV)
    build_s = time.monotonic() - t0
    size = manifest["total_bytes"]
    hosts = [f"n{i + 1}" for i in range(a.nodes)]
    rows: dict[str, list] = {"one": [], "fan": [], "every": []}
    for _ in range(a.repeat):
        rows["one"].append(
            world(base, src, manifest, hosts[:1], peers=False, seeds=[], threads=a.threads, pin=pin, tune=tune)
        )
        rows["fan"].append(
            world(base, src, manifest, hosts, peers=True, seeds=hosts[:1], threads=a.threads, pin=pin, fanout=a.fanout)
        )
        rows["every"].append(
            world(base, src, manifest, hosts, peers=False, seeds=[], threads=a.threads, pin=pin, tune=tune)
        )
    shutil.rmtree(base, ignore_errors=True)
    one = min(w for w, _ in rows["one"])

    def line(label: str, key: str) -> str:
        walls = [w for w, _ in rows[key]]
        best = min(rows[key], key=lambda x: x[0])[1]
        src_read = sum(r.get("source_bytes_read") or 0 for r in best.values())
        cpu = ", ".join(
            f"{h} {r.get('cpu_s', 0):.1f} ({r.get('elapsed_s') or 0:.2f} s)" for h, r in sorted(best.items())
        )
        errs = "; ".join(f"{h}: {r['error']}" for h, r in best.items() if "error" in r)
        return (f"| {label} | {min(walls):.2f} | {max(walls):.2f} | {min(walls) / one:.2f}x | {src_read / size:.2f}x "
                f"| {cpu} | {errs or '-'} |")  # fmt: skip

    served = {h: r.get("served_bytes", 0) for h, r in min(rows["fan"], key=lambda x: x[0])[1].items()}
    text = (
        f"Revision {size / GiB:.2f} GiB in {a.shards} files; {a.nodes} nodes as processes on one machine with "
        f"{os.cpu_count()} CPUs; roots and source under {base} ({'tmpfs' if str(base).startswith('/dev/shm') else 'disk'}); "
        f"{a.threads} copy threads per node"
        + (f", each node pinned to {pin} CPUs of its own" if pin else ", nodes not pinned (they share every CPU)")
        + (f"; tuned: {tune}" if tune else "")
        + f"; manifest built in {build_s:.2f} s (not in the rows); {a.repeat} runs "
        "each, interleaved.\n\n"
        "| run | best wall s | worst wall s | x one node | source read (x revision) | CPU s (own wall s) per node | errors |\n"
        "|---|---:|---:|---:|---:|---|---|\n"
        + line("one node alone", "one") + "\n"
        + line(f"{a.nodes} nodes, 1 seed, relay tree (fan-out {a.fanout}) + cut-through", "fan") + "\n"
        + line(f"{a.nodes} nodes, each from the source", "every") + "\n\n"
        + "Bytes each node passed on (best fan-out run): "
        + ", ".join(f"{h} {b / GiB:.2f} GiB" for h, b in sorted(served.items())) + ".\n"
    )  # fmt: skip
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "stage_fanout.md").write_text(text)
    (a.out / "stage_fanout.json").write_text(json.dumps({k: [[w, r] for w, r in v] for k, v in rows.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
