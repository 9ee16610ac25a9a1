"""Replicas on the lab: four nodes as two replicas of the engine SIMULATOR (TP2 across two nodes each), each a
deployment of its own (llmfleet-demo-r0 on node1+node2, llmfleet-demo-r1 on node3+node4), behind the engine's own
router as llmfleet-demo-router.service on node1, under the real wrapper and systemd units, as the operator `ops`
with become: the SGLang profile behind the real sglang-router 0.3.2 (from .venv-vllm, `make vllm-cpu`). The same
behind vllm-router 0.1.17 runs on the real engine (test_real_replicas.py) and in bench/rollout_bench.py.

What it proves: the play gates each replica and then the question through the router; both replicas are router
members; each replica's head unit carries the serving health probe; a rank of replica 0 SIGKILLed stops and heals
replica 0 alone (replica 1's units never restart) while a bounded client keeps asking through the router (the
numbers are printed: sent, failed, longest gap), and both are members again afterwards. Day 2 (the second test):
re-run, a setting change, scale-in and scale-out, a revision change through site.yml and a failed rollout step,
none of which fails a request through the router; the ordered stop leaves no unit active."""

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.router_client import RouterClient
from tests.integration.conftest import ROOT, run_ansible, ssh

NODES = ["node1", "node2", "node3", "node4"]
ROUTER_URL = "http://10.77.0.11:30000"
REPLICAS = [{"name": "r0", "nodes": ["node1", "node2"]}, {"name": "r1", "nodes": ["node3", "node4"]}]
WORKERS = ["http://10.77.0.11:8000", "http://10.77.0.13:8000"]
VARS = {
    "llmfleet_replicas": REPLICAS,
    "engine_profile": "vllm",
    "llmfleet_tp_size": 2,
    "llmfleet_pp_size": 1,
    "engine_ready_deadline": 120,
    "engine_replica_router_command": [str(ROOT / ".venv-vllm/bin/vllm-router")],
    # The lab's client and the test reach the router from the machine (the lab's nodes are private netns hosts).
    "engine_replica_router_host": "0.0.0.0",  # noqa: S104 (the lab's private fabric)
}
# The first test: the SGLang simulator behind sglang-router (the API on 8000 as for vLLM: SGLang's default port,
# 30000, is the router's).
SGLANG = {"engine_profile": "sglang", "engine_port": 8000, "engine_replica_router": "sglang-router",
          "engine_replica_router_command": [str(ROOT / ".venv-vllm/bin/sglang-router")]}  # fmt: skip
REV_A = "5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed"  # inventory/lab/group_vars/all.yml
# The same demo checkpoint staged as two more revisions (staging names a revision, it does not check a hub's).
REV_B = "b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0"
REV_C = "c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0"
QUESTION = "What is 37\u00d719? Reply with only the number."


def playbook(name, check=True, **more):
    return run_ansible("ansible-playbook", f"playbooks/{name}.yml", "-e", json.dumps({**VARS, **more}), timeout=900,
                       check=check)  # fmt: skip


def unit(lab, node, name, prop):
    return ssh(lab, node, f"systemctl show {name} --property={prop} --value").stdout.strip()


def ask(base=ROUTER_URL, timeout=10):
    body = {"model": "demo-model", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0}
    req = urllib.request.Request(  # noqa: S310 (http to the lab)
        f"{base}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (http to the lab)
        return json.loads(r.read())["choices"][0]["message"]["content"]


def workers():
    with urllib.request.urlopen(f"{ROUTER_URL}/workers", timeout=5) as r:  # noqa: S310 (http to the lab)
        return {w["url"]: w["is_healthy"] for w in json.loads(r.read())["workers"]}


def Client():
    """One request at a time through the router, each bounded (10 s)."""
    return RouterClient(ask)


@pytest.fixture(scope="module")
def prepared(lab):
    for pb in ("base", "topology", "model_stage"):
        run_ansible("ansible-playbook", f"playbooks/{pb}.yml")
    yield lab
    # Remove the replicas (units, claims, credentials, state) rather than only stop them: an installed replica is
    # another deployment on the node, and later lab tests (site, reset, trust) would meet its claim.
    if playbook("reset", check=False).returncode != 0:
        playbook("engine_stop", check=False)
    for n in NODES:  # a unit a fault left failed would leave the node's systemd "degraded" for later tests
        ssh(lab, n, "systemctl reset-failed 'llmfleet-demo*' || true")
    for i in range(1, len(NODES) + 1):
        lab.wipe_nvme(lab.node(i))


def status(lab, tmp_path):
    """`llmfleet status --json` from the ops host, over SSH as the lab's operator (become), the replicas in its
    inventory."""
    hosts = {f"node{i}": {"ansible_host": f"10.77.0.1{i}", "llmfleet_fabric_ip": f"10.77.0.1{i}"} for i in range(1, 5)}
    inv = tmp_path / "oncall-inventory.yml"
    inv.write_text(json.dumps({"all": {
        "vars": {"ansible_user": "ops", "ansible_become": True, "ansible_ssh_common_args": f"-F {lab.ssh_config}",
                 "llmfleet_deployment": "demo", "llmfleet_replicas": REPLICAS,
                 "ansible_python_interpreter": "/usr/bin/python3"},
        "children": {"llmfleet_nodes": {"children": {
            "head": {"hosts": {"node1": hosts["node1"]}},
            "worker": {"hosts": {n: hosts[n] for n in NODES[1:]}}}}}}}))  # fmt: skip
    cmd = [str(Path(sys.executable).parent / "llmfleet"), "status", "-i", str(inv), "--json"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


def test_two_replicas_behind_sglang_router_and_one_heals_alone(prepared, tmp_path):
    lab = prepared
    t0 = time.monotonic()
    cp = playbook("engine", **SGLANG)
    deploy_s = time.monotonic() - t0
    assert cp.returncode == 0, cp.stdout[-5000:]
    flat = " ".join(cp.stdout.split())
    assert "answer through the router was correct" in flat, flat[-6000:]  # YAML output doubles the quote
    for node, rep in (("node1", "r0"), ("node2", "r0"), ("node3", "r1"), ("node4", "r1")):
        assert unit(lab, node, f"llmfleet-demo-{rep}.service", "ActiveState") == "active", node
    assert unit(lab, "node1", "llmfleet-demo-router.service", "ActiveState") == "active"
    assert "sglang-router launch" in unit(lab, "node1", "llmfleet-demo-router.service", "ExecStart")
    # Each replica's head unit carries the serving health probe on its own API (a hung replica is healed).
    for node, rep in (("node1", "r0"), ("node3", "r1")):
        assert "--health-url http://127.0.0.1:8000" in unit(lab, node, f"llmfleet-demo-{rep}.service", "ExecStart")
    assert set(workers()) == set(WORKERS) and all(workers().values())
    # status reads the router's membership from the router itself (its worker API on its node's loopback).
    st = status(lab, tmp_path)
    members = json.loads(st.stdout)["router"]["members"] if st.stdout.startswith("{") else None
    assert st.returncode == 0 and members and members["expected"] == WORKERS, st.stdout[-3000:] + st.stderr[-2000:]
    assert {w["url"]: w["healthy"] for w in members["listed"]} == dict.fromkeys(WORKERS, True), members
    assert ask() == "703"
    for base in WORKERS:  # each replica answers on its own
        assert ask(base) == "703"

    r1_before = {n: unit(lab, n, "llmfleet-demo-r1.service", "ExecMainStartTimestampMonotonic") for n in NODES[2:]}
    client = Client()
    client.start()
    time.sleep(3)
    # SIGKILL one rank of replica 0 (node2 runs only replica 0's ranks).
    pid = ssh(lab, "node2", "pgrep -f '[e]ngine_sim.py' | head -1").stdout.strip()
    assert pid, "no rank of replica 0 on node2"
    ssh(lab, "node2", f"kill -9 {pid}")
    killed = time.monotonic()
    out_s = None
    deadline = killed + 240
    healed = False
    while time.monotonic() < deadline:
        state = workers()
        if out_s is None and not state.get(WORKERS[0], True):
            out_s = time.monotonic() - killed
        healed = all(int(unit(lab, n, "llmfleet-demo-r0.service", "NRestarts") or 0) >= 1 for n in NODES[:2]) and all(
            unit(lab, n, "llmfleet-demo-r0.service", "ActiveState") == "active" for n in NODES[:2]
        )
        if healed and all(state.values()):
            break
        time.sleep(1)
    heal_s = time.monotonic() - killed
    time.sleep(5)
    client.stop.set()
    client.join(30)
    print(
        f"\nreplicas: deploy {deploy_s:.0f} s; after SIGKILL of a replica-0 rank: router marked it unhealthy after "
        f"{out_s if out_s is None else round(out_s, 1)} s, replica 0 healed and back in {heal_s:.0f} s; client "
        f"through the router: {client.sent} sent, {client.failed} failed, longest gap without an answer "
        f"{client.gap:.1f} s; errors {client.errors[:3]}"
    )
    assert healed, {n: unit(lab, n, "llmfleet-demo-r0.service", "ActiveState") for n in NODES[:2]}
    assert all(workers().values()) and set(workers()) == set(WORKERS)
    # Replica 1 never restarted: the fault domain is one replica.
    assert {
        n: unit(lab, n, "llmfleet-demo-r1.service", "ExecMainStartTimestampMonotonic") for n in NODES[2:]
    } == r1_before
    assert client.sent > 0 and client.failed <= 1, (client.sent, client.failed, client.errors[:5])
    assert ask() == "703"


def test_day_2_on_serving_replicas_a_rerun_a_setting_a_scale_in_and_out_and_a_revision_never_stop_serving(
    prepared, tmp_path
):
    """Day 2: the replicas serve (started with `-e llmfleet_deployment=demo`, which must not rename them); a plain
    site.yml re-run converges with changed=0 on every node, restarts no unit, and skips preflight and the NCCL check
    (they would bind the engine's ports and take its GPUs), saying so in the output and in the run's report. Then,
    under a steady client through the router that must see no failed request: a changed engine setting rolls the
    replica whose nodes are in the play out of the router and back (r0; r1 serves); a replica listed as absent is
    removed (scale-in); site.yml with it listed again and a new revision adds it (scale-out) and rolls the other onto
    the revision; the router is never restarted. Last, a rollout whose first step fails on a bad revision puts that
    replica back on its revision and stops, naming it; the ordered stop leaves no unit active."""
    lab = prepared
    # The SGLang simulator (acceptance's tools check passes there), the run's report directory made by this first run.
    day2 = {**SGLANG, "llmfleet_report_dir": str(tmp_path)}
    cp = playbook("engine", llmfleet_deployment="demo", **day2)
    assert cp.returncode == 0, cp.stdout[-5000:]
    for node, rep in (("node1", "r0"), ("node2", "r0"), ("node3", "r1"), ("node4", "r1")):
        assert unit(lab, node, f"llmfleet-demo-{rep}.service", "ActiveState") == "active", node
        # No instance named after the deployment runs (an earlier lab module may have left its stopped unit).
        assert unit(lab, node, "llmfleet-demo.service", "ActiveState") in ("inactive", "failed"), node
    # What an earlier site.yml leaves on the ops host: the report directory as acceptance makes it (0755), the
    # report role's file_sd targets (engine.yml runs no report).
    tmp_path.chmod(0o755)
    assert run_ansible("ansible-playbook", "playbooks/report.yml", "-e", json.dumps({**VARS, **day2})).returncode == 0
    before = start_times(lab)
    router_before = unit(lab, "node1", "llmfleet-demo-router.service", "ExecMainStartTimestampMonotonic")

    cp = run_ansible("ansible-playbook", "playbooks/site.yml", "-e", json.dumps({**VARS, **day2}),
                     timeout=900, check=False)  # fmt: skip
    flat = " ".join(cp.stdout.split())
    assert cp.returncode == 0, cp.stdout[-5000:]
    recap = dict(re.findall(r"(node\d) *: ok=\d+ +changed=(\d+)", cp.stdout))
    changed = re.findall(r"TASK \[([^\]]+)\][^\n]*\n(?:(?!TASK \[).*\n)*?changed: \[(node\d)", cp.stdout)
    assert recap == {n: "0" for n in NODES}, f"{recap}\n" + "\n".join(map(str, changed))
    assert start_times(lab) == before
    assert unit(lab, "node1", "llmfleet-demo-router.service", "ExecMainStartTimestampMonotonic") == router_before
    serving = ("demo is serving on node1, node2 (llmfleet-demo-r0.service is running); node3, node4 "
               "(llmfleet-demo-r1.service is running)")  # fmt: skip
    for tag in ("preflight", "nccl_check"):
        assert f"SKIPPED {tag}: {serving}" in flat, flat[-4000:]
    warnings = json.loads((tmp_path / "fleet-summary.json").read_text())["warnings"]
    assert any(w.startswith(f"preflight skipped: {serving}") for w in warnings), warnings
    assert any(w.startswith(f"nccl_check skipped: {serving}") for w in warnings), warnings
    assert not (tmp_path / "preflight.json").exists() and not (tmp_path / "nccl-check.json").exists()
    assert ask() == "703"

    router_pid = unit(lab, "node1", "llmfleet-demo-router.service", "MainPID")
    client = Client()
    client.start()

    # A changed engine setting: each serving replica leaves the router, drains, restarts and is gated, then goes
    # back in, one after the other; the router is never restarted.
    setting = {**day2, "engine_env": {"LLMFLEET_DAY2_SETTING": "1"}}
    spans, t0 = {}, time.monotonic()
    # Limited to r0's nodes: r0 rolls alone, r1 serves meanwhile (its nodes are not in the play).
    cp = run_ansible("ansible-playbook", "playbooks/engine.yml", "--limit", "node1,node2", "-e",
                     json.dumps({**VARS, **setting}), timeout=900, check=False)  # fmt: skip
    spans["setting"], t0 = time.monotonic() - t0, time.monotonic()
    flat = " ".join(cp.stdout.split())
    assert cp.returncode == 0, flat[-5000:]
    assert "demo-r0: drained" in flat and "demo-r1: drained" not in flat, flat[-5000:]
    after_setting = start_times(lab)
    assert all(after_setting[k] != v for k, v in before.items() if k[1] == "r0"), (before, after_setting)
    assert all(after_setting[k] == v for k, v in before.items() if k[1] == "r1"), (before, after_setting)
    assert set(workers()) == set(WORKERS) and all(workers().values())

    # Scale-in: r1 listed with state: absent leaves the router, drains and is removed from node3 and node4; r0 and
    # the router keep running.
    fewer = [REPLICAS[0], {**REPLICAS[1], "state": "absent"}]
    cp = playbook("engine", check=False, **setting, llmfleet_replicas=fewer)
    spans["scale-in"], t0 = time.monotonic() - t0, time.monotonic()
    flat = " ".join(cp.stdout.split())
    assert cp.returncode == 0, flat[-5000:]
    assert "demo: removed replicas demo-r1 (out of the router first, drained)" in flat, flat[-5000:]
    for node in ("node3", "node4"):
        assert unit(lab, node, "llmfleet-demo-r1.service", "LoadState") == "not-found", node
    assert {k: v for k, v in start_times(lab).items() if k[1] == "r0"} == {
        k: v for k, v in after_setting.items() if k[1] == "r0"}  # fmt: skip
    assert set(workers()) == {WORKERS[0]}
    assert ask() == "703"

    # Scale-out together with a revision change, through site.yml: r1 comes back on revision B and joins the router
    # before r0, which serves revision A, rolls onto B (out, drained, restarted, gated, back in); r0 alone answers
    # until r1 joined, r1 alone while r0 rolls. Neither the router nor a replica restarts for the other.
    r0_before = {k: v for k, v in start_times(lab).items() if k[1] == "r0"}
    cp = run_ansible("ansible-playbook", "playbooks/site.yml", "-e",
                     json.dumps({**VARS, **setting, "llmfleet_model_revision": REV_B}), timeout=900, check=False)  # fmt: skip
    spans["scale-out + roll (site.yml)"] = time.monotonic() - t0
    flat = " ".join(cp.stdout.split())
    time.sleep(2)
    client.stop.set()
    client.join(30)
    print(
        f"\nday 2: setting rolled, r1 removed, r1 added + r0 rolled to B: client {client.sent} sent, "
        f"{client.failed} failed, longest gap {client.gap:.1f} s; errors {client.errors[:3]}; "
        + ", ".join(f"{k} {v:.0f} s" for k, v in spans.items())
    )
    assert cp.returncode == 0, flat[-6000:]
    assert f"demo: replicas r0 serve another revision than {REV_B}: rolled one at a time" in flat, flat[-6000:]
    assert set(map(tuple, revisions(lab).values())) == {(REV_B,)}, revisions(lab)
    assert all(v != r0_before[k] for k, v in start_times(lab).items() if k[1] == "r0")
    record = json.loads((tmp_path / "rollout-demo.json").read_text())
    assert [(s["replica"], s["outcome"]) for s in record["steps"]] == [("r0", "rolled")], record
    assert set(workers()) == set(WORKERS) and all(workers().values())
    assert unit(lab, "node1", "llmfleet-demo-router.service", "MainPID") == router_pid  # never restarted
    # Acceptance asked the deployment's address, the router (sglang-router lists the served name on /v1/models).
    accepted = json.loads((tmp_path / "acceptance-demo.json").read_text())
    assert accepted["url"].rstrip("/").endswith(":30000"), accepted["url"]
    # The run's report: the router, both replicas on B, the rolled step, and each replica's gate (it said
    # "INCOMPLETE: engine not run" of a deployment of replicas, which has no engine-demo.json of its own).
    model = json.loads((tmp_path / "demo" / "latest" / "report.json").read_text())
    reps = next(sec for sec in model["sections"] if sec["id"] == "replicas")
    assert model["status"] == "pass" and reps["status"] == "pass", (model["verdict"], reps["summary"])
    assert [(r["deployment"], r["revision"]) for r in reps["replicas"]] == [("demo-r0", REV_B), ("demo-r1", REV_B)]
    assert [(st["replica"], st["outcome"]) for st in reps["rollout"]["steps"]] == [("r0", "rolled")], reps["rollout"]
    # Prometheus scrapes each replica's own API (the router's port serves no /metrics).
    sd = json.loads((tmp_path / "file_sd" / "demo-engine.json").read_text())
    assert [(g["targets"], g["labels"]["replica"]) for g in sd] == [
        (["10.77.0.11:8000"], "demo-r0"), (["10.77.0.13:8000"], "demo-r1")], sd  # fmt: skip
    assert client.sent > 0 and client.failed == 0, (client.sent, client.failed, client.errors[:5])

    # A rollout (playbooks/rollout.yml) whose step fails: --check prints the plan and restarts nothing; then the change
    # to revision C crashes replica 0's first start at load (rank 1, node2, the simulator's fault injected once: the
    # stand-in for a bad revision): r0 goes back on B, gated and in the router, the rollout stops there naming it, r1
    # keeps B - still no failed request.
    started = start_times(lab)
    cp = run_ansible("ansible-playbook", "playbooks/rollout.yml", "--check", "-e",
                     json.dumps({**VARS, **day2, "llmfleet_model_revision": REV_C}), timeout=900)  # fmt: skip
    flat = " ".join(cp.stdout.split())
    for rep in ("r0", "r1"):
        assert f"demo-{rep} on" in flat and f"revision {REV_B} -> {REV_C}" in flat, flat[-5000:]
    assert start_times(lab) == started and set(map(tuple, revisions(lab).values())) == {(REV_B,)}
    client = Client()
    client.start()
    # The fault's once-marker in replica 0's own state directory (its unit may write there, not in the deployment's).
    env = {"LLMFLEET_SIM_STATE_DIR": "{{ engine_state_dir }}/demo-r0/sim",
           "LLMFLEET_SIM_FAULT": "crash:rank=1:phase=load:once"}  # fmt: skip
    t0 = time.monotonic()
    cp = run_ansible("ansible-playbook", "playbooks/rollout.yml", "-e",
                     json.dumps({**VARS, **day2, "llmfleet_model_revision": REV_C, "engine_env": env}),
                     timeout=900, check=False)  # fmt: skip
    failed_s = time.monotonic() - t0
    time.sleep(2)
    client.stop.set()
    client.join(30)
    flat = " ".join(cp.stdout.split())
    print(f"rollout: B -> C failed on r0 and rolled back in {failed_s:.0f} s; client {client.sent} sent, "
          f"{client.failed} failed, longest gap {client.gap:.1f} s; errors {client.errors[:3]}")  # fmt: skip
    assert cp.returncode != 0
    assert "demo-r0: drained" in flat, flat[-6000:]  # the simulator's request gauges
    assert (f"The rollout of demo to revision {REV_C} stopped at replica r0 (demo-r0 on node1, node2)" in flat
            and f"It is back on revision {REV_B}, gated and in the router" in flat), flat[-6000:]  # fmt: skip
    # why, in the gate's words (a failed loop's first failed item, not "One or more items failed")
    assert "on the new revision it failed: engine not ready: first failed node node2" in flat, flat[-4000:]
    assert set(map(tuple, revisions(lab).values())) == {(REV_B,)}, revisions(lab)
    after = start_times(lab)
    assert all(after[k] != started[k] for k in after if k[1] == "r0")  # r0 restarted (on C, then back on B)
    assert all(after[k] == started[k] for k in after if k[1] == "r1")  # r1 never touched
    record = json.loads((tmp_path / "rollout-demo.json").read_text())
    assert [(s["replica"], s["outcome"]) for s in record["steps"]] == [("r0", "rolled back")], record
    assert record["steps"][0]["error"].startswith("engine not ready: first failed node node2"), record
    assert record["runs"] == {"r0": REV_B} and record["not_reached"] == ["r1"] and record["complete"] is False
    assert set(workers()) == set(WORKERS) and all(workers().values())
    assert client.sent > 0 and client.failed == 0, (client.sent, client.failed, client.errors[:5])
    assert ask() == "703"

    # The steps that would disturb a serving deployment see its replicas' units (there is no llmfleet-demo.service).
    cp = run_ansible("ansible-playbook", "playbooks/preflight.yml", "-e", json.dumps({**VARS, **SGLANG}), check=False)
    flat = " ".join(cp.stdout.split())
    assert cp.returncode != 0 and serving in flat, flat[-4000:]

    # Stopped in order, the router first.
    assert playbook("engine_stop", **SGLANG).returncode == 0
    assert unit(lab, "node1", "llmfleet-demo-router.service", "ActiveState") in ("inactive", "failed")
    for node, rep in (("node1", "r0"), ("node2", "r0"), ("node3", "r1"), ("node4", "r1")):
        assert unit(lab, node, f"llmfleet-demo-{rep}.service", "ActiveState") in ("inactive", "failed"), node


def revisions(lab):
    """The revision each replica's unit names, per node."""
    out = {}
    for node, rep in (("node1", "r0"), ("node2", "r0"), ("node3", "r1"), ("node4", "r1")):
        text = ssh(lab, node, f"cat /etc/systemd/system/llmfleet-demo-{rep}.service").stdout
        out[node] = sorted(set(re.findall(r"/demo-model/([0-9a-f]{40})", text)))
    return out


def start_times(lab):
    return {(n, r): unit(lab, n, f"llmfleet-demo-{r}.service", "ExecMainStartTimestampMonotonic")
            for n, r in (("node1", "r0"), ("node2", "r0"), ("node3", "r1"), ("node4", "r1"))}  # fmt: skip
