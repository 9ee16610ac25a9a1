#!/usr/bin/env python3
"""Benchmark: the engine role on the lab (2 nodes, TP2 x PP2, the engine simulator under the real
wrapper and systemd). Measures (1) readiness detection latency: the gate's first correct answer after
the head actually serves, next to what an "open port" probe would have said; (2) time from an
injected rank crash to every unit stopped and the root cause reported, next to systemd alone (the
surviving node keeps its unit active until its distributed timeout).

    .venv/bin/python bench/engine_bench.py [--out docs/bench-engine.md] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.lab import demo_model  # noqa: E402
from tests.lab.labctl import default_lab  # noqa: E402

BIN = Path(sys.executable).parent
LIMIT = ["--limit", "node1,node2", "-e", "llmfleet_pp_size=2"]
UNIT = "llmfleet-demo.service"


def play(*args: str, json_out: bool = False) -> tuple[int, str]:
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), PATH=f"{BIN}:{os.environ['PATH']}")
    if json_out:
        env["ANSIBLE_CALLBACK_RESULT_FORMAT"] = "json"
    cp = subprocess.run([str(BIN / "ansible-playbook"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                        check=False, timeout=900)  # fmt: skip
    return cp.returncode, cp.stdout


def gate_result(stdout: str) -> dict:
    """The readiness gate's result: the JSON printed under its task (result format json)."""
    at = stdout.find("TASK [engine : Readiness gate from the ops host")
    if at < 0:
        raise SystemExit(f"no readiness-gate task in the play output:\n{stdout[-3000:]}")
    at = stdout.index("failed: [", at)
    obj, _ = json.JSONDecoder().raw_decode(stdout[stdout.index("{", at) :])
    return obj


def ssh(lab, node: str, cmd: str) -> str:
    return subprocess.run(["ssh", "-F", str(lab.ssh_config), node, cmd], capture_output=True, text=True,
                          check=False, timeout=60).stdout  # fmt: skip


def fault(spec: str) -> list[str]:
    env = {"LLMFLEET_SIM_STATE_DIR": "/var/lib/llmfleet/engine/demo/sim", "LLMFLEET_SIM_FAULT": spec}
    return ["-e", json.dumps({"engine_env": env})]


def ready_run() -> dict:
    play("playbooks/engine_stop.yml", *LIMIT)
    rc, out = play("playbooks/engine.yml", *LIMIT, json_out=True)
    if rc != 0:
        raise SystemExit(f"engine did not get ready:\n{out[-3000:]}")
    # A passing gate prints its timeline in the next task (loop items print results only on failure).
    at = out.index("TASK [engine : Cold-start timeline")
    timeline, _ = json.JSONDecoder().raw_decode(out[out.index("{", at) :])
    tl = timeline["msg"][0]
    head = tl["head"]
    node_ready = tl["nodes"]["node1"]["node_ready"]
    return {
        "detect_s": head["first_correct_answer"] - node_ready,
        "port_s": head["port_open"] - node_ready,
        "cold_s": head["first_correct_answer"],
    }


def crash_run(lab) -> dict:
    play("playbooks/engine_stop.yml", *LIMIT)
    rc, out = play("playbooks/engine.yml", *LIMIT, *fault("crash:rank=3:phase=load:exit=3"), json_out=True)
    r = gate_result(out)
    if rc == 0 or r.get("ready") is not False:
        raise SystemExit("the injected crash did not fail the gate")
    rec = r["first_failed"]["record"]
    left = [n for n in ("node1", "node2") if ssh(lab, n, "pgrep -f '[e]ngine_sim.py' || true").strip()]
    return {
        "stop_s": r["reported_at"] - rec["ended_at"],
        "named": r["first_failed"]["node"],
        "all_stopped": all(s["stopped"] for s in r["stop"]) and not left,
    }


def systemd_alone(lab) -> float:
    """Same crash, units started by hand, no gate: how long node1 stays active after node2 failed."""
    play("playbooks/engine.yml", *LIMIT, *fault("crash:rank=3:phase=load:exit=3"), "-e", "engine_ready_deadline=1")
    for n in ("node1", "node2"):
        ssh(lab, n, f"systemctl start --no-block {UNIT}")
    t_fail = None
    end = time.monotonic() + 180
    while time.monotonic() < end:
        s2 = ssh(lab, "node2", f"systemctl show {UNIT} -p SubState --value").strip()
        if t_fail is None and s2 in ("failed", "auto-restart"):
            t_fail = time.monotonic()
        s1 = ssh(lab, "node1", f"systemctl show {UNIT} -p SubState --value").strip()
        if t_fail is not None and s1 not in ("running", "start"):
            break
        time.sleep(0.5)
    gone = time.monotonic() - (t_fail or end)
    play("playbooks/engine_stop.yml", *LIMIT)
    return gone


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    lab = default_lab()
    lab.up(2)
    demo_model.ensure(lab.shared)
    for pb in ("base", "topology", "model_stage"):
        play(f"playbooks/{pb}.yml", *LIMIT)
    ready = [ready_run() for _ in range(a.runs)]
    crash = [crash_run(lab) for _ in range(a.runs)]
    alone = systemd_alone(lab)
    play("playbooks/engine_stop.yml", *LIMIT)
    # A lab left up keeps this checkout's bind mounts; another checkout's `up` would reuse it.
    lab.down()
    med = statistics.median
    lines = [
        "# Benchmark: engine readiness and crash handling (lab, 2 nodes, TP2 x PP2, engine simulator)",
        "",
        f"Command: `.venv/bin/python bench/engine_bench.py --runs {a.runs}` ({time.strftime('%Y-%m-%d')}, "
        f"{os.cpu_count()} CPUs). Medians of {a.runs} runs.",
        "",
        "| what | llmfleet | alternative | goal |",
        "|---|---|---|---|",
        f"| readiness detected after the head serves | {med(r['detect_s'] for r in ready):.2f} s (correct answer) | "
        f"port open after {med(r['port_s'] for r in ready):.2f} s (proves nothing about the answer) | < 2 s |",
        f"| rank crash → all units stopped + root cause | {med(c['stop_s'] for c in crash):.2f} s "
        f"(named {', '.join(sorted({c['named'] for c in crash}))}; all stopped: "
        f"{all(c['all_stopped'] for c in crash)}) | systemd alone: surviving node active "
        f"{alone:.1f} s more (its dist timeout; 600 s by default) | < 15 s |",
        "",
        f"Cold start to first correct answer (median): {med(r['cold_s'] for r in ready):.1f} s.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
