#!/usr/bin/env python3
"""Benchmark: lab bring-up time and Ansible ping/setup fan-out for 2, 4, 8, 16 nodes.

Runs on its own lab (name "bench", subnet 10.79.0) so it never disturbs the default lab.
Prints a table with the ratio to the smallest size and, with --out, writes it to a markdown file.

    .venv/bin/python bench/lab_fanout.py --nodes 2 4 8 16 --out docs/measurements/bench-lab.md
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE = str(Path(sys.executable).parent / "ansible")  # the venv's, also when PATH lacks it
sys.path.insert(0, str(ROOT))

from tests.lab.labctl import Lab  # noqa: E402


def timed(argv: list[str], env: dict) -> float:
    t0 = time.monotonic()
    cp = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    dt = time.monotonic() - t0
    if cp.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({cp.returncode}):\n{cp.stdout[-2000:]}\n{cp.stderr[-2000:]}")
    return dt


def measure(n: int, lab: Lab) -> dict:
    lab.down()
    t0 = time.monotonic()
    lab.up(n)
    up = time.monotonic() - t0
    inv = str(lab.state / "inventory")
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_INVENTORY=str(ROOT / "inventory" / "lab"),
        ANSIBLE_DEPRECATION_WARNINGS="0",
    )
    # As a site runs it: the operator account, root through sudo (the lab nodes have `ops`, tests/lab/node-init.sh).
    base = ["-i", inv, "-e", "ansible_user=ops", "-e", "ansible_become=true",
            "-e", "ansible_python_interpreter=/usr/bin/python3"]  # fmt: skip
    ping_cold = timed([ANSIBLE, "llmfleet_nodes", *base, "-m", "ansible.builtin.ping"], env)
    ping_warm = timed([ANSIBLE, "llmfleet_nodes", *base, "-m", "ansible.builtin.ping"], env)
    setup = timed([ANSIBLE, "llmfleet_nodes", *base, "-m", "ansible.builtin.setup"], env)
    t0 = time.monotonic()
    lab.down()
    down = time.monotonic() - t0
    return {"nodes": n, "up": up, "ping_cold": ping_cold, "ping_warm": ping_warm, "setup": setup, "down": down}


def table(rows: list[dict]) -> str:
    ref = rows[0]
    cols = ["up", "ping_cold", "ping_warm", "setup", "down"]
    out = ["| nodes | " + " | ".join(f"{c} s (ratio)" for c in cols) + " |"]
    out.append("|---:|" + "---:|" * len(cols))
    for r in rows:
        out.append(f"| {r['nodes']} | " + " | ".join(f"{r[c]:.2f} ({r[c] / ref[c]:.2f}x)" for c in cols) + " |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--out", type=Path, help="write the results (markdown) to this file")
    a = ap.parse_args()
    lab = Lab(name="bench", subnet="10.79.0")
    try:
        rows = [measure(n, lab) for n in a.nodes]
    finally:
        lab.down()
    text = table(rows)
    print(text)
    if a.out:
        cmd = ".venv/bin/python bench/lab_fanout.py --nodes " + " ".join(map(str, a.nodes))
        a.out.write_text(
            "## Lab bring-up and Ansible fan-out\n\n"
            f"Command: `{cmd} --out {a.out}` (part of `make bench`)\n\n"
            f"Machine: {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}; measured {time.strftime('%Y-%m-%d', time.gmtime())}. "
            f"Ratios are to the {a.nodes[0]}-node row.\n"
            "`up` = `labctl up N` from nothing (netns + systemd + sshd ready); `ping_cold` = first "
            "`ansible -m ping` (new SSH connections); `ping_warm` = second (ControlPersist); `setup` = fact "
            "gathering; `down` = poweroff + cleanup.\n\n" + text + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
