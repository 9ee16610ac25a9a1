#!/usr/bin/env python3
"""Benchmark: the staging fan-out (llmfleet's relay tree) beside libtorrent, on the same lab nodes, in one run.

For each node count: a revision of --gb GiB in 16 shards on the lab's shared storage, seeded from node1, then
1. llmfleet's relay tree: `playbooks/model_stage.yml` (1 seed, the relay tree, cut-through, sha256 of every
   file against the manifest, fdatasync, publish), the manifest cached beforehand;
2. libtorrent 2.1.1 (a v2 SHA-256 torrent of the revision made beforehand, as the manifest is): node1 seeds the
   shared storage in place, every other node downloads to its NVMe over TCP from all the others, then checks
   every landed file against the same manifest's sha256 and fsyncs it (bench/stage_torrent_node.py).
Page cache dropped before each. Reported: wall, bytes read from shared storage, CPU-seconds per node (and per
GiB received), the machine's busy CPU-seconds. Needs root (the lab) and network access for pip the first time
(libtorrent goes into the bench's own venv, $LLMFLEET_BENCH_DIR/torrent-venv, never onto nodes' Python):

    sudo .venv/bin/python bench/stage_fanout.py [--nodes 4 8] [--gb 1] [--repeat 1] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from stage_bench import BIN, FLEET_STAGE_VARS, REV, WORK, GiB, busy_cpu_s, drop_caches, make_revision  # noqa: E402

from tests.lab.labctl import Lab  # noqa: E402

LIBTORRENT = "libtorrent==2.1.1"
VENV = WORK / "torrent-venv"
NODE_SCRIPT = ROOT / "bench" / "stage_torrent_node.py"


def torrent_python() -> str:
    """The bench's own venv with libtorrent (made once; the lab nodes see it: they share the host's files)."""
    py = VENV / "bin" / "python"
    if subprocess.run([str(py), "-c", "import libtorrent"], capture_output=True, check=False).returncode != 0:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", LIBTORRENT], check=True)
    return str(py)


def run_relay(lab: Lab, nodes: int, env: dict, base: list[str]) -> dict:
    ev = dict(FLEET_STAGE_VARS)
    c0, t0 = busy_cpu_s(), time.monotonic()
    cp = subprocess.run(
        [str(BIN / "ansible-playbook"), *base, "-e", json.dumps(ev), "playbooks/model_stage.yml"],
        cwd=ROOT, env=env, check=False, capture_output=True, text=True,
    )  # fmt: skip
    wall, busy = time.monotonic() - t0, busy_cpu_s() - c0
    if cp.returncode:
        raise SystemExit(f"model_stage.yml failed:\n{cp.stdout[-3000:]}")
    res = json.loads((WORK / "stage-fleet.json").read_text())["nodes"]
    return {
        "wall": wall,
        "busy": busy,
        "copy_wall": max(r["elapsed_s"] for r in res.values()),
        "source_read": sum(r["source_bytes_read"] for r in res.values()),
        "cpu": {h: r["cpu_s"] for h, r in res.items()},
        "seeds": sorted(h for h, r in res.items() if r.get("seed")),
    }


def run_torrent(lab: Lab, nodes: int, py: str, torrent: str, manifest: str) -> dict:
    done = lab.shared_rw / "torrent-done"
    shutil.rmtree(done, ignore_errors=True)
    done.mkdir()
    ips = ",".join(lab.node(i).ip for i in range(1, nodes + 1))

    def one(i: int) -> dict:
        n = lab.node(i)
        argv = [py, str(NODE_SCRIPT), "node", "--torrent", torrent, "--me", n.ip, "--peers", ips,
                "--manifest", manifest, "--done", "/mnt/shared-rw/torrent-done", "--nodes", str(nodes)]  # fmt: skip
        argv += ["--save", "/mnt/shared", "--seed"] if i == 1 else ["--save", "/mnt/nvme/torrent"]
        cp = n.nsenter(*argv, timeout=300)
        if cp.returncode:
            raise SystemExit(f"{n.name}: the libtorrent node failed ({cp.returncode}):\n{cp.stderr[-2000:]}")
        return json.loads(cp.stdout.strip().splitlines()[-1])

    c0, t0 = busy_cpu_s(), time.monotonic()
    with ThreadPoolExecutor(nodes) as ex:
        res = {f"node{i}": r for i, r in enumerate(ex.map(one, range(1, nodes + 1)), 1)}
    wall, busy = time.monotonic() - t0, busy_cpu_s() - c0
    return {
        "wall": wall,
        "busy": busy,
        "copy_wall": max(r["done_s"] for r in res.values()),
        "source_read": res["node1"]["rchar"],
        "source_disk": res["node1"]["read_bytes"],
        "cpu": {h: r["cpu_s"] for h, r in res.items()},
        "seeds": ["node1"],
        "sent": {h: r["uploaded"] for h, r in res.items()},
    }


def measure(lab: Lab, nodes: int, gb: float, repeat: int, py: str) -> tuple[str, dict]:
    lab.up(nodes, wipe_nvme=True)
    src = make_revision(lab.shared / "fleet", int(gb * GiB), 16)
    size = sum(f.stat().st_size for f in src.iterdir())
    inv = str(lab.state / "inventory")
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_INVENTORY=str(ROOT / "inventory" / "lab"),
               PATH=f"{BIN}:{os.environ['PATH']}")  # fmt: skip
    base = ["-i", inv, "-e", "ansible_user=ops", "-e", "ansible_become=true",
            "-e", "ansible_python_interpreter=/usr/bin/python3"]  # fmt: skip
    # Both engines' metadata made beforehand (each reads the revision once): the manifest cached on shared
    # storage, the torrent beside it. The timed runs are the copies.
    margs = {"source": "/mnt/shared/fleet", "model": "fleet", "revision": REV, "cache_dir": "/mnt/shared-rw/llmfleet",
             "lease_dir": "/mnt/shared-rw/llmfleet/leases"}  # fmt: skip
    out = subprocess.run(
        [str(BIN / "ansible"), "node1", *base, "-o", "-m", "llmfleet.fleet.llmfleet_model_manifest",
             "-a", json.dumps(margs)],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    manifest = json.loads(out.split("=>", 1)[1])["manifest_path"]
    tdir = lab.shared_rw / "torrent"
    tdir.mkdir(exist_ok=True)
    drop_caches()
    made = subprocess.run(
        [py, str(NODE_SCRIPT), "make", str(src), str(tdir / "fleet.torrent")],
        check=True,
        capture_output=True,
        text=True,
    )
    made = json.loads(made.stdout)

    def wipe() -> None:
        for i in range(1, nodes + 1):
            lab.node(i).nsenter("rm", "-rf", "/mnt/nvme/models", "/mnt/nvme/torrent", check=True)
        drop_caches()

    runs: dict[str, list[dict]] = {"relay": [], "torrent": []}
    for _ in range(repeat):  # interleaved: the machine's load hits both alike
        wipe()
        runs["relay"].append(run_relay(lab, nodes, env, base))
        wipe()
        runs["torrent"].append(run_torrent(lab, nodes, py, "/mnt/shared-rw/torrent/fleet.torrent", manifest))
    wipe()
    gib = size / GiB
    rows = []
    for name, label in (
        ("relay", "llmfleet relay tree (`playbooks/model_stage.yml`: 1 seed, fan-out 2, cut-through)"),
        ("torrent", f"libtorrent {LIBTORRENT.split('==')[1]} (node1 seeds, TCP, v2 torrent) + manifest sha256 + fsync"),
    ):
        for r in runs[name]:
            peers = [c for h, c in r["cpu"].items() if h not in r["seeds"]]
            seed_cpu = sum(c for h, c in r["cpu"].items() if h in r["seeds"])
            rows.append(
                f"| {label} | {r['wall']:.1f} | {r['copy_wall']:.1f} | {r['source_read'] / size:.2f}x "
                f"| {seed_cpu:.1f} | {min(peers):.1f}-{max(peers):.1f} | {sum(peers) / len(peers) / gib:.2f} "
                f"| {r['busy']:.0f} |"
            )
    t = runs["torrent"][-1]
    text = (
        f"Revision: {gib:.2f} GiB in 16 shards, {nodes} lab nodes on one machine ({os.cpu_count()} CPUs, one disk: "
        f"the nodes share them). Torrent made beforehand in {made['make_s']:.1f} s ({made['pieces']} pieces of "
        f"{made['piece_size'] // 1024} KiB), as the manifest is cached beforehand.\n\n"
        "| fan-out | wall s (whole run) | s to the last node verified | source bytes read (x revision) "
        "| seed CPU-s | other nodes' CPU-s | CPU-s per GiB received (mean) | busy CPU-s (machine) |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n\n"
        "Wall (whole run): the relay's includes Ansible (the playbook from start to end); libtorrent's, every node's "
        "process from start to exit. s to the last node verified: the relay's slowest node's staging (`elapsed_s`: "
        "copy, sha256, fdatasync, publish); libtorrent's slowest node to complete, sha256 and fsync. Source bytes "
        "read: the relay's `source_bytes_read`; libtorrent's seed's read calls (`rchar`: a seed in seed mode reads a "
        f"piece to hash it when first asked, then to send it), from the disk {t['source_disk'] / size:.2f}x. "
        "Bytes each libtorrent node sent: "
        + ", ".join(f"{h} {b / GiB:.2f} GiB" for h, b in sorted(t["sent"].items()))
        + "."
    )
    return text, runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[4])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped (SIGTERM): taking the lab down"))
    WORK.mkdir(parents=True, exist_ok=True)
    py = torrent_python()  # before the lab is up: nodes see the host's files as they were at boot
    lab = Lab(name="sf", subnet="10.82.0")
    lab.down()
    parts = []
    try:
        for n in a.nodes:
            body, runs = measure(lab, n, a.gb, a.repeat, py)
            parts.append(f"### {n} nodes\n\n{body}\n")
            print(parts[-1], flush=True)
            print(json.dumps(runs), file=sys.stderr, flush=True)
    finally:
        lab.down()
    cmd = " ".join(["bench/stage_fanout.py", *sys.argv[1:]])
    day = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = f"## Staging fan-out: relay tree vs libtorrent\n\nCommand: `.venv/bin/python {cmd}` ({day})\n\n" + "\n".join(
        parts
    )
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
