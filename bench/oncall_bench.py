#!/usr/bin/env python3
"""Benchmark: `llmfleet status` on 2, 4, 8, 16 lab nodes, beside plain Ansible asking the same nodes the same
question (`ansible -m command -a 'systemctl show UNIT'`, become, cold SSH connections like the CLI's).

Each node runs a unit `llmfleet-bench.service` (a transient `python3 -m http.server` on the API port: the probe
reads its state, records and processes as it would an engine's). The operator is `ops` with `sudo -n`, as in
every lab test. Every `llmfleet status` run is a cold one (the CLI keeps no connections between runs);
`--runs` runs per size, medians. Runs on its own lab (name "bench", subnet 10.79.0).

    .venv/bin/python bench/oncall_bench.py [--nodes 2 4 8 16] [--runs 3] [--out docs/measurements/bench-oncall.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's llmfleet and ansible, also when PATH lacks them
sys.path.insert(0, str(ROOT))

from tests.lab.labctl import Lab  # noqa: E402

UNIT = "llmfleet-bench.service"


def inventory(lab: Lab, n: int, path: Path) -> None:
    nodes = [lab.node(i) for i in range(1, n + 1)]
    hosts = {nd.name: {"ansible_host": nd.ip} for nd in nodes}
    path.write_text(json.dumps({"all": {
        "vars": {"ansible_user": "ops", "ansible_become": True, "ansible_ssh_common_args": f"-F {lab.ssh_config}",
                 "llmfleet_deployment": "bench", "ansible_python_interpreter": "/usr/bin/python3"},
        "children": {"llmfleet_nodes": {"children": {
            "head": {"hosts": {nodes[0].name: hosts[nodes[0].name]}},
            "worker": {"hosts": {nd.name: hosts[nd.name] for nd in nodes[1:]}}}}}}}))  # fmt: skip


def timed(argv: list[str], ok: tuple[int, ...] = (0,)) -> tuple[float, str]:
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_INVENTORY=str(ROOT / "inventory" / "lab"),
               ANSIBLE_DEPRECATION_WARNINGS="0",
               ANSIBLE_SSH_ARGS="-o ControlMaster=no")  # fmt: skip
    t0 = time.monotonic()
    cp = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=300)
    dt = time.monotonic() - t0
    if cp.returncode not in ok:
        raise SystemExit(f"{' '.join(argv)} failed ({cp.returncode}):\n{cp.stdout[-2000:]}\n{cp.stderr[-2000:]}")
    return dt, cp.stdout


def measure(lab: Lab, n: int, runs: int, tmp: Path) -> dict:
    lab.down()
    lab.up(n)
    for i in range(1, n + 1):
        # A listener on the API port: `status` checks the head's port is open, as it is for a serving engine.
        lab.node(i).nsenter("systemd-run", "--unit", UNIT, "--quiet", "python3", "-m", "http.server", "--bind",
                            "127.0.0.1", "30000", check=True)  # fmt: skip
    inv = tmp / f"inv-{n}.json"
    inventory(lab, n, inv)
    walls, fans, slowest = [], [], []
    for _ in range(runs):
        wall, out = timed([str(BIN / "llmfleet"), "status", "-i", str(inv), "--json"])
        doc = json.loads(out)
        if not doc["healthy"]:
            raise SystemExit(f"{n} nodes: status not healthy: {doc['problems']}")
        walls.append(wall)
        fans.append(doc["elapsed_s"])
        slowest.append(max(x["seconds"] for x in doc["nodes"]))
    ansible = [
        timed([str(BIN / "ansible"), "llmfleet_nodes", "-i", str(inv), "-b", "-m", "ansible.builtin.command",
               "-a", f"systemctl show {UNIT} -p ActiveState"])[0]
        for _ in range(runs)
    ]  # fmt: skip
    med = statistics.median
    return {"nodes": n, "wall": med(walls), "fan": med(fans), "slowest": med(slowest), "ansible": med(ansible)}


def table(rows: list[dict]) -> str:
    ref = rows[0]
    out = [
        "| nodes | `llmfleet status` wall s (ratio) | its fan-out s (ratio) | slowest node s | "
        "`ansible -m command` s (ratio) | status / ansible |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['nodes']} | {r['wall']:.2f} ({r['wall'] / ref['wall']:.2f}x) | {r['fan']:.2f} "
            f"({r['fan'] / ref['fan']:.2f}x) | {r['slowest']:.2f} | {r['ansible']:.2f} "
            f"({r['ansible'] / ref['ansible']:.2f}x) | {r['wall'] / r['ansible']:.2f} |"
        )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, help="write the results (markdown) to this file")
    a = ap.parse_args()
    lab = Lab(name="bench", subnet="10.79.0")
    with tempfile.TemporaryDirectory(prefix="oncall-bench-") as d:
        try:
            rows = [measure(lab, n, a.runs, Path(d)) for n in a.nodes]
        finally:
            lab.down()
    text = table(rows)
    print(text)
    if a.out:
        cmd = f".venv/bin/python bench/oncall_bench.py --nodes {' '.join(map(str, a.nodes))} --runs {a.runs}"
        a.out.write_text(
            "# Benchmark: `llmfleet status` fan-out on the lab\n\n"
            f"Command: `{cmd} --out {a.out}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs; medians of "
            f"{a.runs} cold runs). Ratios are to the {ref_nodes(rows)}-node row. Every node's sshd, sudo and probe "
            "run on the same CPUs as the ops host's client.\n\n" + text + "\n"
        )
    return 0


def ref_nodes(rows: list[dict]) -> int:
    return rows[0]["nodes"]


if __name__ == "__main__":
    sys.exit(main())
