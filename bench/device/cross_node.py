#!/usr/bin/env python3
"""The NCCL check's cross-node code path on one machine: two "nodes" of one rank each, started the way
the Ansible module starts a node's share of a world (nccl_check.run_node_ranks), with the fabric
environment the topology code renders on this machine, NCCL's socket transport forced
(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) and, when both ranks must share one GPU, a different
NCCL_HOSTID per node so NCCL treats them as two hosts. Scenarios: healthy (all four ops, exact), a
corrupting rank, data damaged in transit, a rank that never starts; each must be named.

    python3 bench/device/cross_node.py --out DIR [--backend nccl|gloo] [--ip IP]
    python3 bench/device/cross_node.py --out DIR --bench FILE --sizes ... --iters 20 --warmup 5 [--timing ...]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "module_utils"))

from llmfleet.checks.nccl_check import free_port, run_node_ranks  # noqa: E402
from llmfleet.checks.nccl_verdict import judge  # noqa: E402


def node_ip() -> str:
    """The address of the interface that carries the default route (what a node's fabric IP would be)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def fabric_env(ip: str, out: Path) -> dict[str, str]:
    """The env the topology code renders for this machine (as /etc/llmfleet/fabric.env would hold it)."""
    cp = subprocess.run([sys.executable, "-m", "llmfleet", "topology", "--node-ip", ip, "--override",
                         "NCCL_NVLS_ENABLE=0", "--json"], capture_output=True, text=True, check=False,
                        env={**os.environ, "PYTHONPATH": str(ROOT / "module_utils")}, timeout=120)  # fmt: skip
    (out / "topology.json").write_text(cp.stdout)
    (out / "topology.err").write_text(cp.stderr)
    if cp.returncode != 0:
        raise SystemExit(f"topology failed (exit {cp.returncode}): {cp.stderr[-400:]}")
    return json.loads(cp.stdout)["env"]


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def world(a: argparse.Namespace, env: dict[str, str], args: list[str], nodes: int = 2,
          debug_file: str | None = None) -> tuple[list[dict], float]:  # fmt: skip
    """Run the 2-rank world (or only its first `nodes` nodes): node k holds global rank k."""
    port = free_port()
    shared_gpu = a.backend == "nccl" and gpu_count() < 2
    specs = []
    for k in range(nodes):
        extra = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
        if shared_gpu:
            extra["NCCL_HOSTID"] = f"llmfleet-node-{k}"  # two hosts to NCCL: no duplicate-GPU refusal, NET only
        if debug_file:
            extra.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=debug_file)
        specs.append({"python": sys.executable, "pythonpath": str(ROOT / "module_utils"), "env": {**env, **extra},
                      "world": 2, "master": a.ip, "port": port, "ranks": [[k, 0 if shared_gpu else k]],
                      "deadline": a.deadline, "args": ["--backend", a.backend, *args]})  # fmt: skip
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(specs)) as ex:
        ranks = [r for part in ex.map(run_node_ranks, specs) for r in part]
    return ranks, time.monotonic() - t0


COMMON = ["--iters", "5", "--warmup", "2", "--timeout", "30", "--op-timeout", "60"]
SCENARIOS = [
    ("healthy", [*COMMON], 2, lambda v: v["ok"]),
    ("corrupt-rank-1", ["--sizes", "8,1M", "--ops", "all_reduce,all_gather,sendrecv", "--corrupt-rank", "1", *COMMON],
     2, lambda v: v["culprit_ranks"] == [1] and not v["ok"]),
    ("transit-0-to-1", ["--sizes", "1M", "--ops", "all_reduce,all_gather,sendrecv", "--corrupt-transit", "1:0",
                        *COMMON], 2, lambda v: v["bad_transfers"] == [[0, 1]] and v["culprit_ranks"] == []),
    ("rank-1-never-starts", ["--sizes", "8", "--ops", "all_reduce", *COMMON[:4], "--timeout", "10"], 1,
     lambda v: v["missing_ranks"] == [1]),
]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    ap.add_argument("--ip", default=None)
    ap.add_argument("--deadline", type=float, default=240)
    ap.add_argument("--sizes", default="8,64K,16M,128M", help="sizes of the healthy world (all four ops)")
    ap.add_argument("--bench", type=Path, help="only time the healthy world (--sizes, --iters ...) into this JSON")
    ap.add_argument("--iters", default="5")
    ap.add_argument("--warmup", default="2")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--timing", default="eager", choices=["auto", "graph", "eager"])
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    a.ip = a.ip or node_ip()
    env = fabric_env(a.ip, a.out)
    print(f"node ip {a.ip}; GPUs {gpu_count()}; fabric env: {json.dumps(env, sort_keys=True)}")
    if a.bench:  # side by side with nccl-tests over the same transport
        args = ["--sizes", a.sizes, "--iters", a.iters, "--warmup", a.warmup, "--dtypes", a.dtypes, "--timing",
                a.timing, "--timeout", "30", "--op-timeout", "60"]  # fmt: skip
        ranks, took = world(a, env, args)
        v = judge(ranks)
        a.bench.write_text(json.dumps({"ranks": ranks, **v}, indent=1) + "\n")
        print(f"bench ({a.timing} timing) in {took:.1f}s: {v['verdict']}")
        return 0 if v["ok"] else 1
    failures = 0
    for name, args, nodes, expect in SCENARIOS:
        debug = str(a.out / f"nccl-debug-{name}.%h.%p.log") if name == "healthy" and a.backend == "nccl" else None
        sizes = ["--sizes", a.sizes] if name == "healthy" else []
        ranks, took = world(a, env, [*sizes, *args], nodes, debug)
        v = judge(ranks)
        good = bool(expect(v))
        failures += not good
        (a.out / f"cross-node-{name}.json").write_text(json.dumps({"ranks": ranks, **v}, indent=1) + "\n")
        busbw = {f"{x['op']}/{x['dtype']}/{x['bytes']}": x["busbw_GBps"] for x in (ranks[0].get("results") or [])
                 if "busbw_GBps" in x and x["bytes"] >= 16 * 2**20}  # fmt: skip
        print(f"{name}: {'as expected' if good else 'UNEXPECTED'} in {took:.1f}s: {v['verdict']}"
              + (f"; busbw GB/s {busbw}" if busbw else ""))  # fmt: skip
    for log in sorted(glob.glob(str(a.out / "nccl-debug-healthy.*.log"))):
        lines = [ln.strip() for ln in Path(log).read_text(errors="replace").splitlines()
                 if "via NET" in ln or "Using network" in ln or "via P2P" in ln or "via SHM" in ln]  # fmt: skip
        print(f"{Path(log).name}: {'; '.join(sorted(set(x.split(' : ', 1)[-1] for x in lines))[:6])}")
    print("cross-node path:", "PASS" if not failures else f"{failures} scenario(s) not as expected")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
