#!/usr/bin/env python3
"""Benchmark: the whole `playbooks/site.yml` on 4 lab nodes (the demo's run, engine simulator): wall time per
role and the share spent in Ansible overhead, i.e. time not copying, rendezvousing or waiting for the engine.

Work = the tasks that wait on those (`llmfleet_job_wait`: staging's copies, the NCCL check's ranks, the
engine's start and gate; `llmfleet_engine_ready`; acceptance's `llmfleet accept` run against the endpoint).
Overhead = every other task, plus ansible-playbook's start-up and parsing (its wall time outside any task).
A wait's own polling is counted as work, so the overhead share is a lower bound. Uses the default lab (fresh
nodes), the demo checkpoint and ansible.cfg as an operator would (no test-suite caches).

    .venv/bin/python bench/site_bench.py [--out docs/measurements/bench-site.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORK_ACTIONS = ("llmfleet_job_wait", "llmfleet_engine_ready")
GOAL = 0.20


def is_work(row: dict) -> bool:
    """Whether a task's time is copying, rendezvousing or waiting for the engine (see the module docstring)."""
    action = row["action"].rsplit(".", 1)[-1]
    return action in WORK_ACTIONS or (row["role"] == "acceptance" and action == "command")


def per_role(rows: list[dict], wall: float) -> list[dict]:
    """Wall, work and overhead seconds per role (in order of first appearance), then the start-up gap and the
    total; play-level tasks outside any role count under their play's name."""
    out: dict[str, dict] = {}
    for r in rows:
        key = r["role"] or f"({r['play']})"
        d = out.setdefault(key, {"role": key, "tasks": 0, "wall": 0.0, "work": 0.0})
        d["tasks"] += 1
        d["wall"] += r["seconds"]
        d["work"] += r["seconds"] if is_work(r) else 0.0
    table = list(out.values())
    in_tasks = sum(d["wall"] for d in table)
    table.append({"role": "(ansible-playbook start-up, parsing, play set-up)", "tasks": 0,
                  "wall": max(0.0, wall - in_tasks), "work": 0.0})  # fmt: skip
    for d in table:
        d["overhead"] = d["wall"] - d["work"]
    total = {"role": "**total**", "tasks": sum(d["tasks"] for d in table), "wall": wall,
             "work": sum(d["work"] for d in table)}  # fmt: skip
    total["overhead"] = wall - total["work"]
    return [*table, total]


def render(table: list[dict], settings: str, when: str) -> str:
    lines = [
        "## `site.yml` on 4 lab nodes: wall time per role and Ansible's share",
        "",
        f"Command: `.venv/bin/python bench/site_bench.py` ({when}, 2 CPUs; fresh lab nodes, the demo checkpoint, "
        "the engine simulator as SGLang TP2 x PP4). Work = copying, rendezvousing, waiting for the engine (the "
        "waits of staging, the NCCL check and the engine gate, and acceptance's requests); overhead = all else. "
        f"Ansible settings: {settings}.",
        "",
        "| role | tasks | wall s | work s | overhead s | overhead share |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for d in table:
        share = d["overhead"] / d["wall"] if d["wall"] else 0.0
        lines.append(f"| {d['role']} | {d['tasks']} | {d['wall']:.1f} | {d['work']:.1f} | {d['overhead']:.1f} "
                     f"| {share:.0%} |")  # fmt: skip
    t = table[-1]
    share = t["overhead"] / t["wall"]
    verdict = "met" if share < GOAL else "not met"
    lines += ["", f"Overhead share of the whole run: **{share:.0%}** (goal < {GOAL:.0%}: {verdict})."]
    return "\n".join(lines) + "\n"


def settings_line() -> str:
    cfg = (ROOT / "ansible.cfg").read_text()
    keep = [ln.strip() for ln in cfg.splitlines() if ln.strip().startswith(("forks", "pipelining", "ssh_args"))]
    return "; ".join(keep) + "; strategy linear, gather_facts off, no fact cache"


def main() -> int:
    from tests.lab.labctl import default_lab

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--times", type=Path, help="also keep every task's time (JSON lines) in this file")
    a = ap.parse_args()
    lab = default_lab()
    lab.down()
    lab.up(4)
    subprocess.run([sys.executable, str(ROOT / "tests/lab/demo_model.py"), "--engine", "sim"], check=True)
    fd, times = tempfile.mkstemp(prefix="llmfleet-site-bench-", suffix=".jsonl")
    os.close(fd)
    binp = Path(sys.executable).parent
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_INVENTORY=str(ROOT / "inventory" / "lab"),
               PATH=f"{binp}:{os.environ['PATH']}",
               ANSIBLE_CALLBACK_PLUGINS=str(ROOT / "bench/callback"), ANSIBLE_CALLBACKS_ENABLED="llmfleet_task_times",
               LLMFLEET_TASK_TIMES=times)  # fmt: skip
    t0 = time.monotonic()
    cp = subprocess.run([str(binp / "ansible-playbook"), "playbooks/site.yml"], cwd=ROOT, env=env, capture_output=True,
                        text=True, check=False)  # fmt: skip
    wall = time.monotonic() - t0
    try:
        raw = Path(times).read_text().splitlines()
        if a.times:
            a.times.write_text("\n".join(raw) + "\n")
    finally:
        os.unlink(times)
    if cp.returncode != 0:
        print(cp.stdout[-3000:], file=sys.stderr)
        raise SystemExit(f"site.yml failed (exit {cp.returncode}): no figures")
    rows = [json.loads(ln) for ln in raw[1:]]
    text = render(per_role(rows, wall), settings_line(), datetime.date.today().isoformat())
    print(text)
    top = sorted(rows, key=lambda r: -r["seconds"])[:10]
    print("Slowest tasks:\n" + "\n".join(f"  {r['seconds']:7.2f}  {r['role'] or r['play']}: {r['task']}" for r in top))
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
