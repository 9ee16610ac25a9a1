"""The engine role on the lab: two nodes, TP2 x PP2, the engine SIMULATOR (tests/lab/engine_sim.py)
under the real wrapper and systemd units. Ready means a correct answer; every injected fault ends
with all units stopped (head first), the first failed node named, and no rank left running."""

import json
import re
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT, oncall, run_ansible, ssh

NODES = ["node1", "node2"]
LIMIT = ["--limit", ",".join(NODES)]
BASE = ["-e", "llmfleet_pp_size=2", "-e", "engine_ready_deadline=120"]
UNIT = "llmfleet-demo.service"


def engine(*extra, check=False, playbook="playbooks/engine.yml", timeout=600):
    return run_ansible("ansible-playbook", playbook, *LIMIT, *BASE, *extra, check=check, timeout=timeout)


def fault_vars(spec, **more):
    env = {"LLMFLEET_SIM_STATE_DIR": "/var/lib/llmfleet/engine/demo/sim", "LLMFLEET_SIM_FAULT": spec}
    env.update(more)
    return ["-e", json.dumps({"engine_env": env})]


def unit(lab, node, prop):
    return ssh(lab, node, f"systemctl show {UNIT} --property={prop} --value").stdout.strip()


def sim_processes(lab, node):
    return ssh(lab, node, "pgrep -af '[e]ngine_sim.py' || true").stdout.strip()


def ask(port=30000, prompt="What is 37\u00d719? Reply with only the number."):
    body = {"model": "demo-model", "messages": [{"role": "user", "content": prompt}], "temperature": 0}
    req = urllib.request.Request(f"http://10.77.0.11:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 (http to the lab head)
        return json.loads(r.read())["choices"][0]["message"]["content"]


def assert_all_stopped(lab):
    for n in NODES:
        assert unit(lab, n, "ActiveState") in ("inactive", "failed"), n
        assert sim_processes(lab, n) == "", f"ranks left running on {n}"


@pytest.fixture(scope="module")
def prepared(lab):
    for pb in ("base", "topology", "model_stage"):
        run_ansible("ansible-playbook", f"playbooks/{pb}.yml", *LIMIT)
    yield lab
    if any(unit(lab, n, "ActiveState") not in ("inactive", "failed") for n in NODES):  # the last test stops it
        engine(playbook="playbooks/engine_stop.yml")
    for n in NODES:  # a unit a fault left failed would leave the node's systemd "degraded" for later tests
        ssh(lab, n, f"systemctl reset-failed {UNIT} || true")
    # Leave the NVMe as found: later tests (site.yml) count what staging reads from shared storage.
    for i in range(1, len(NODES) + 1):
        lab.wipe_nvme(lab.node(i))


def test_sglang_tp2_pp2_reaches_ready_and_answers(prepared):
    lab = prepared
    cp = engine()
    assert cp.returncode == 0, cp.stdout[-5000:]
    assert ask() == "703"
    for n in NODES:
        assert unit(lab, n, "ActiveState") == "active"
        assert unit(lab, n, "Type") == "notify" and unit(lab, n, "KillMode") == "mixed"
        assert unit(lab, n, "LimitMEMLOCK") == "infinity"
    # The head's ranks are global ranks 0,1 (PP stage 0); node2 holds 2,3 (stage 1).
    out = ssh(lab, "node2", f"journalctl -u {UNIT} -o cat --no-pager").stdout
    assert re.search(r"TP1 PP1\]", out), out[-2000:]
    # What a person reads: where each node's start is while the gate waits (no FAILED - RETRYING), then the
    # timeline as a table in seconds, and one summary line.
    assert "engine gate " in cp.stdout and "FAILED - RETRYING" not in cp.stdout, cp.stdout[-5000:]
    timeline = cp.stdout[cp.stdout.index("Cold-start timeline") :]
    assert "weights loaded" in timeline and "first correct answer" in timeline and "t0" not in timeline, timeline[:3000]
    assert "engine: demo (sglang) serves demo-model at http://10.77.0.11:30000" in cp.stdout


def test_second_converge_restarts_nothing(prepared):
    lab = prepared
    before = {n: unit(lab, n, "InvocationID") for n in NODES}
    cp = engine(check=True)
    assert re.search(r"changed=0\s", cp.stdout), cp.stdout[-3000:]
    assert {n: unit(lab, n, "InvocationID") for n in NODES} == before


def test_an_unknown_engine_flag_fails_before_anything_starts(prepared):
    lab = prepared
    before = ssh(lab, "node1", f"cat /etc/systemd/system/{UNIT}").stdout
    cp = engine("-e", json.dumps({"engine_extra_args": ["--enable-metric"]}))
    assert cp.returncode != 0
    assert "--enable-metric (did you mean --enable-metrics" in cp.stdout, cp.stdout[-3000:]
    assert ssh(lab, "node1", f"cat /etc/systemd/system/{UNIT}").stdout == before


def test_a_unit_systemd_would_half_ignore_is_not_installed(prepared):
    lab = prepared
    # systemd-analyze verify says "Failed to parse service restart specifier, ignoring" and exits 0.
    cp = engine("-e", "engine_restart=sometimes")
    assert cp.returncode != 0
    assert "restart specifier" in cp.stdout, cp.stdout[-3000:]
    assert "Restart=sometimes" not in ssh(lab, "node1", f"cat /etc/systemd/system/{UNIT}").stdout


def test_a_slow_load_with_progress_outlives_the_start_timeout(prepared):
    """TimeoutStartSec=25 but loading takes 30 s more with progress lines: the wrapper's
    EXTEND_TIMEOUT_USEC keeps the units starting until they are ready. (The first progress line comes after the
    ranks imported torch and met: 12 s on two busy cores, so a 15 s start timeout failed for want of a line.)"""
    lab = prepared
    cp = engine("-e", "engine_start_timeout=25", "-e", "engine_extend_timeout=10", *fault_vars("slow_load:seconds=30"))
    assert cp.returncode == 0, cp.stdout[-4000:]
    for n in NODES:
        assert unit(lab, n, "ActiveState") == "active" and unit(lab, n, "NRestarts") == "0"
    assert ask() == "703"


@pytest.mark.parametrize(
    ("profile", "spec", "node", "expect"),
    [
        # SGLang crash path: the dead rank's node SIGKILLs itself (unit ends by signal 9).
        ("sglang", "crash:rank=3:phase=load:exit=3", "node2", r"verdict signal"),
        # vLLM: its executor logs the dead worker (then its API server would exit 0, or wait for ever while starting);
        # the wrapper ends the run on that line: a failure naming the rank.
        ("vllm", "crash:rank=1:phase=load", "node1", r"verdict rank-died, exit 70"),
        ("sglang", "crash:rank=2:phase=rendezvous:signal=SEGV", "node2", r"verdict signal"),
    ],
)
def test_a_crashing_rank_stops_everything_and_is_named(prepared, profile, spec, node, expect):
    lab = prepared
    t0 = time.monotonic()
    cp = engine("-e", f"engine_profile={profile}", *fault_vars(spec))
    took = time.monotonic() - t0
    assert cp.returncode != 0
    out = cp.stdout
    assert f"first failed node {node}" in out, out[-5000:]
    assert re.search(expect, out), out[-5000:]
    assert "stopped in order (head first): node1" in out
    # As the operator account (not root), the record and the journal are still read (through sudo).
    assert "termination record: verdict" in out, out[-5000:]
    tail = out[out.index("journal tail of the first failed node:") :].splitlines()[1:16]
    assert sum(f" {node} " in ln for ln in tail) >= 3, tail  # short-iso lines carry the hostname
    assert_all_stopped(lab)
    # The failed run left its record for the deployment report, the first failure up front, and the report
    # command puts it at the top of the page.
    rec = json.loads((ROOT / "reports/engine-demo.json").read_text())
    assert rec["ok"] is False and rec["failure"]["node"] == node and rec["failure"]["log_tail"], rec["failure"]
    cp = run_ansible(str(ROOT / ".venv/bin/llmfleet"), "report", "--dir", str(ROOT / "reports"), "--deployment", "demo")
    # (The report directory also holds other tests' records, e.g. a failed NCCL check: only the engine row is ours.)
    row = next(x for x in cp.stdout.splitlines() if x.split()[:2] == ["engine/cold", "start"])
    assert row.split()[2] == "FAIL" and f"first failed node {node}" in row, cp.stdout
    print(f"{profile} {spec}: failed play in {took:.0f}s")


def test_a_rank_hanging_in_rendezvous_hits_the_deadline_and_everything_stops(prepared):
    lab = prepared
    cp = engine("-e", "engine_ready_deadline=25", *fault_vars("hang:rank=3:phase=rendezvous"))
    assert cp.returncode != 0
    assert "deadline of 25 s passed" in cp.stdout, cp.stdout[-4000:]
    assert_all_stopped(lab)


def test_restart_on_failure_brings_the_deployment_back(prepared):
    """vLLM logs a dead worker and exits 0 seconds later (systemd would not restart it); the wrapper ends the run on
    that line with exit 70 (rank-died). The other node's ranks sit in their collective until the distributed
    timeout (600 s) like NCCL's, but the deployment link stops that node within seconds (exit 75, naming node1) and
    Restart=on-failure brings both back together; the fault fires once."""
    lab = prepared
    spec = "crash:rank=1:phase=serve:after=12:once"
    ssh(lab, "node1", "rm -rf /var/lib/llmfleet/engine/demo/sim")
    cp = engine("-e", "engine_profile=vllm", *fault_vars(spec))
    assert cp.returncode == 0, cp.stdout[-4000:]  # the gate got 703 (no ask here: the fault may have fired already)
    assert "--link-head 10.77.0.11:50082" in unit(lab, "node2", "ExecStart")
    deadline = time.monotonic() + 150  # far below the 600 s a peer would wait without the link
    restarted = False
    while time.monotonic() < deadline:
        restarted = all(int(unit(lab, n, "NRestarts") or 0) >= 1 for n in NODES)
        if restarted and all(unit(lab, n, "ActiveState") == "active" for n in NODES):
            break
        time.sleep(2)
    assert restarted, {n: unit(lab, n, "NRestarts") for n in NODES}
    rec = json.loads(ssh(lab, "node1", "cat /var/lib/llmfleet/engine/demo/termination.json.1").stdout)
    assert rec["verdict"] == "rank-died" and rec["exit_code"] == 70, rec.get("reason")
    peer = json.loads(ssh(lab, "node2", "cat /var/lib/llmfleet/engine/demo/termination.json.1").stdout)
    assert peer["verdict"] == "peer-failed" and peer["exit_code"] == 75, peer["reason"]
    assert peer["link"]["stopped_by"]["node"] == "node1" and "rank 1 died" in peer["link"]["stopped_by"]["reason"]
    assert all(unit(lab, n, "ActiveState") == "active" for n in NODES)
    assert ask(port=8000) == "703"


def test_oncall_commands_find_the_first_failure_and_stop_leaves_nothing(prepared, tmp_path):
    """After the heal above (node1's rank 1 died, node2 was stopped by the link): status is healthy again and
    shows the previous run, logs --first-failed and why (over a bundle) name node1, stop leaves no rank,
    restart serves again."""
    lab = prepared
    st = oncall(lab, tmp_path, "status", "--json")
    assert st.returncode == 0, st.stdout + st.stderr
    rows = {r["node"]: r for r in json.loads(st.stdout)["nodes"]}
    assert set(rows) == {"node1", "node2"}, rows
    logs = oncall(lab, tmp_path, "logs", "--first-failed", "-n", "20")
    assert logs.returncode == 1 and "node1" in logs.stdout.split("\n", 2)[0] + logs.stdout.split("\n", 2)[1], (
        logs.stdout
    )
    bundle = tmp_path / "bundle"
    # The journals hold this module's earlier injected faults too: collect from the crashed run's start, as
    # on-call would with --since.
    crashed = json.loads(ssh(lab, "node1", "cat /var/lib/llmfleet/engine/demo/termination.json.1").stdout)
    b = oncall(lab, tmp_path, "bundle", "-o", str(bundle), f"--since=@{int(crashed['started_at']) - 1}")
    assert b.returncode == 0, b.stdout + b.stderr
    for node in ("node1", "node2"):
        # The running engine has no record yet: the crash's is the rotated one.
        for f in ("journal-llmfleet-demo.service.txt", "kernel.txt", "unit-llmfleet-demo.service.show",
                  "termination-llmfleet-demo.service.json.1"):  # fmt: skip
            assert (bundle / node / f).is_file(), (node, f)
    why = subprocess.run([str(Path(sys.executable).parent / "llmfleet"), "why", "--bundle", str(bundle), "--json"],
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert why.returncode == 1, why.stdout + why.stderr
    report = json.loads(why.stdout)
    assert report["first_failure"]["node"] == "node1", json.dumps(report["first_failure"])[:2000]
    # The same through ansible-playbook (the lab's own inventory, limited to the deployment's nodes).
    pb_status = run_ansible("ansible-playbook", "playbooks/status.yml", *LIMIT, check=False)
    assert pb_status.returncode == 0 and "healthy" in pb_status.stdout, pb_status.stdout[-3000:]
    pb_bundle = run_ansible("ansible-playbook", "playbooks/bundle.yml", *LIMIT, "-e", f"bundle_dir={tmp_path / 'pb'}",
                            "-e", f"bundle_since=@{int(crashed['started_at']) - 1}", check=False)  # fmt: skip
    assert pb_bundle.returncode == 0, pb_bundle.stdout[-3000:]
    assert re.search(r"node1", pb_bundle.stdout.split("Show the verdict", 1)[1]), pb_bundle.stdout[-3000:]
    assert (tmp_path / "pb" / "node1" / "kernel.txt").is_file()
    stop = oncall(lab, tmp_path, "stop")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert_all_stopped(lab)
    # An unhealthy deployment fails the status playbook, naming the problem.
    pb_down = run_ansible("ansible-playbook", "playbooks/status.yml", *LIMIT, check=False)
    assert pb_down.returncode == 2 and "UNHEALTHY" in pb_down.stdout, pb_down.stdout[-3000:]
    restart = oncall(lab, tmp_path, "restart")
    assert restart.returncode == 0, restart.stdout + restart.stderr
    assert ask(port=8000) == "703"  # the deployment above is the vllm profile
    pb_restart = engine("-e", "engine_profile=vllm", playbook="playbooks/restart.yml")
    assert pb_restart.returncode == 0, pb_restart.stdout[-4000:]
    assert ask(port=8000) == "703"


def test_a_hang_while_serving_is_found_and_the_deployment_heals(prepared, tmp_path):
    """The simulator hangs every generation request 15 s after its API started (past the gate), while its port,
    /health and /v1/models stay fine. The head's wrapper asks the gate's question every 2 s (2 s each, 2 failures):
    it stops its engine (exit 69, unhealthy-while-serving, the failed probes in the record), the link stops node2
    (75, naming node1), Restart=on-failure brings both back (the fault fires once) and the deployment answers 703."""
    lab = prepared
    spec = "hang:rank=0:phase=serve:after=15:once"
    ssh(lab, "node1", "rm -rf /var/lib/llmfleet/engine/demo/sim")
    health = ["-e", "engine_health_interval=2", "-e", "engine_health_timeout=2", "-e", "engine_health_failures=2"]
    cp = engine(*health, *fault_vars(spec))
    assert cp.returncode == 0, cp.stdout[-4000:]  # the gate got 703 before the hang
    assert "--health-url http://127.0.0.1:30000" in unit(lab, "node1", "ExecStart")
    assert "--health-url" not in unit(lab, "node2", "ExecStart")  # a worker serves no API: the head's probe covers it
    deadline = time.monotonic() + 180
    restarted = False
    while time.monotonic() < deadline:
        restarted = all(int(unit(lab, n, "NRestarts") or 0) >= 1 for n in NODES)
        if restarted and all(unit(lab, n, "ActiveState") == "active" for n in NODES):
            break
        time.sleep(2)
    assert restarted, {n: unit(lab, n, "NRestarts") for n in NODES}
    rec = json.loads(ssh(lab, "node1", "cat /var/lib/llmfleet/engine/demo/termination.json.1").stdout)
    assert rec["verdict"] == "unhealthy-while-serving" and rec["exit_code"] == 69, rec["reason"]
    assert rec["stop_requested"] and rec["left_over_pids"] == 0 and "hung while serving" in rec["reason"]
    probes = rec["health"]["probes"]
    # Found by the second failed probe in a row: within interval x failures + timeout of the hang.
    assert [p["ok"] for p in probes[-2:]] == [False, False] and rec["health"]["last_good_at"] is not None, probes
    assert all("no complete answer within 2 s" in p["error"] for p in probes[-2:]), probes
    found = probes[-1]["at"] + probes[-1]["latency_s"]
    good = rec["health"]["last_good_at"] + rec["health"]["last_good_latency_s"]  # the hang began after this answer
    peer = json.loads(ssh(lab, "node2", "cat /var/lib/llmfleet/engine/demo/termination.json.1").stdout)
    assert peer["verdict"] == "peer-failed" and peer["exit_code"] == 75, peer["reason"]
    ended = max(rec["ended_at"], peer["ended_at"])
    print(f"hang found at most {found - good:.1f} s after it began (bound 2 x 2 + 2 = 6 s); every node stopped "
          f"{ended - found:.1f} s later; probes: {probes}")  # fmt: skip
    assert (
        peer["link"]["stopped_by"]["node"] == "node1" and "hung while serving" in peer["link"]["stopped_by"]["reason"]
    )
    assert ask() == "703"
    # status shows the new run's probe once it asked (every 2 s); why (over a bundle of this run) names the hang.
    deadline = time.monotonic() + 30
    while True:
        st = oncall(lab, tmp_path, "status", "--json")
        units = {r["node"]: r["units"][0] for r in json.loads(st.stdout)["nodes"]}
        last = (units["node1"].get("health") or {}).get("last")
        if (last and last["ok"]) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert st.returncode == 0 and last and last["ok"] and units["node2"].get("health") is None, st.stdout[-3000:]
    bundle = tmp_path / "bundle"
    b = oncall(lab, tmp_path, "bundle", "-o", str(bundle), f"--since=@{int(rec['started_at']) - 1}")
    assert b.returncode == 0, b.stdout + b.stderr
    why = subprocess.run([str(Path(sys.executable).parent / "llmfleet"), "why", "--bundle", str(bundle), "--json"],
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    report = json.loads(why.stdout)
    first = report["first_failure"]
    assert first["node"] == "node1" and first["verdict"] == "unhealthy-while-serving", json.dumps(first)[:2000]
    assert "hung while serving" in first["cause"], json.dumps(first)[:2000]


def test_a_node_the_gate_cannot_reach_fails_it_within_the_bound(prepared):
    """SSH to node2 dies while the engine loads: the gate names node2 and the SSH error after
    engine_ready_unreachable_after, not after the 300 s deadline; the head is still stopped."""
    lab = prepared
    node2 = lab.node(2)

    def cut_ssh_once_loading():
        end = time.monotonic() + 120
        while time.monotonic() < end:
            if node2.nsenter("systemctl", "is-active", UNIT).stdout.strip() == "activating":
                node2.nsenter("systemctl", "stop", "ssh.socket", "ssh.service")
                return
            time.sleep(0.5)

    cutter = threading.Thread(target=cut_ssh_once_loading, daemon=True)
    cutter.start()
    try:
        cp = engine("-e", "engine_ready_deadline=300", "-e", "engine_ready_unreachable_after=6",
                    "-e", "engine_ready_connect_timeout=2", *fault_vars("slow_load:seconds=90"))  # fmt: skip
    finally:
        cutter.join(timeout=5)
        node2.nsenter("systemctl", "start", "ssh.service", check=True)
    assert cp.returncode != 0
    out = cp.stdout
    assert "first failed node node2" in out and "unreachable over SSH" in out, out[-4000:]
    assert "deadline" not in out.split("first failed node", 1)[1].splitlines()[0]
    assert "NOT stopped: node2" in out  # said plainly: the gate could not reach it
    engine(playbook="playbooks/engine_stop.yml")
    assert_all_stopped(lab)


def test_secrets_go_through_credentials_never_argv_units_or_logs_and_an_open_api_is_loud(prepared):
    """The API key and engine_secret_env reach the engine as root-only credentials (LoadCredential=), never in
    argv, the unit, the env files, the journal or the play output; an API without a key is a warning (an error
    with engine_require_api_key), and dropping a secret removes its credential. One converge with both secrets,
    one refused, one without (each converge costs the suite about a minute)."""
    lab = prepared
    key = "sk-llmfleet-test-0123456789"
    token = "hf-lab-0123456789abcdef"  # noqa: S105 (a test secret)
    cp = engine("-e", json.dumps({"llmfleet_api_key": key, "engine_secret_env": {"HF_TOKEN": token}}))
    assert cp.returncode == 0, cp.stdout[-4000:]
    assert key not in cp.stdout + cp.stderr and token not in cp.stdout + cp.stderr
    assert not re.search(r"WARNING: node1 serves the \w+ API of demo on", cp.stdout), cp.stdout[-3000:]
    cred = "/etc/llmfleet/credentials/demo.env-HF_TOKEN"
    assert ssh(lab, "node1", f"stat -c '%U %a' {cred}").stdout.split() == ["root", "600"]
    assert ssh(lab, "node1", "stat -c '%U %a' /etc/llmfleet/credentials/demo.api-key").stdout.split() == ["root", "600"]
    env = ssh(lab, "node1", "for p in $(pgrep -f '[e]ngine_sim.py'); do tr '\\0' '\\n' < /proc/$p/environ; done").stdout
    assert f"HF_TOKEN={token}" in env  # the engine has it ...
    for n in NODES:  # ... and neither secret is anywhere else
        text = ssh(lab, n, f"cat /etc/systemd/system/{UNIT} /etc/llmfleet/*.env; ps -eo args; "
                           f"journalctl -u {UNIT} --no-pager").stdout  # fmt: skip
        assert key not in text and token not in text, n
    with pytest.raises(urllib.error.HTTPError, match="401"):
        ask()
    # A variable turns the open-API warning into an error, before anything restarts.
    before = unit(lab, "node1", "InvocationID")
    cp = engine("-e", "engine_require_api_key=true")
    assert cp.returncode != 0 and "engine_require_api_key" in cp.stdout, cp.stdout[-3000:]
    assert unit(lab, "node1", "InvocationID") == before
    # Without a key and on 0.0.0.0: a warning in the play output; the dropped secrets lose their credentials.
    cp = engine()
    assert cp.returncode == 0, cp.stdout[-3000:]
    assert re.search(r"WARNING: node1 serves the \w+ API of demo on", cp.stdout), cp.stdout[-3000:]
    for gone in (cred, "/etc/llmfleet/credentials/demo.api-key"):
        assert ssh(lab, "node1", f"test -e {gone}", check=False).returncode == 1, gone
    assert ask() == "703"


def test_a_planted_cache_symlink_is_never_followed(prepared):
    """The engine's user owns the compile cache root; a fingerprint-named link to /etc must be
    removed as a link by the root-run converge, and /etc keep its owner."""
    lab = prepared
    # The converge prepares the cache on every run, a start or not: no stop and restart needed here.
    link = "/mnt/nvme/llmfleet/cache/demo/0000000000000000"
    ssh(lab, "node1", f"setpriv --reuid=llmfleet --regid=llmfleet --clear-groups ln -sfn /etc {link}")
    cp = engine("-e", "engine_cache_keep=1")
    assert cp.returncode == 0, cp.stdout[-3000:]
    assert ssh(lab, "node1", "stat -c '%U %G %a' /etc").stdout.split() == ["root", "root", "755"]
    assert ssh(lab, "node1", f"test -L {link} || test -e {link}", check=False).returncode == 1


def test_a_unit_at_its_start_limit_comes_back_on_the_next_converge(prepared):
    """After StartLimitBurst starts within StartLimitIntervalSec systemd refuses to start the unit
    until `systemctl reset-failed`: re-running the play must bring it back. That converge logs in as root
    without become (one variable, what the lab did before it had an operator): that login keeps working."""
    lab = prepared
    refused = "Start request repeated too quickly"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if refused in ssh(lab, "node2", f"journalctl -u {UNIT} -n 30 --no-pager").stdout:
            break
        ssh(lab, "node2", f"systemctl start {UNIT} --no-block; sleep 1; systemctl kill -s KILL {UNIT}; sleep 0.5")
    # systemd 252 keeps the earlier Result (signal) when it refuses a start; the journal says why.
    assert unit(lab, "node2", "ActiveState") == "failed"
    assert refused in ssh(lab, "node2", f"journalctl -u {UNIT} -n 30 --no-pager").stdout
    cp = engine("-e", "lab_operator=root")
    assert cp.returncode == 0, cp.stdout[-4000:]
    assert "Clear the failed state" in cp.stdout
    assert ask() == "703"


REV = "5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed"  # inventory/lab: llmfleet_model_revision
MODELS = "/mnt/nvme/models/demo-model"


def test_a_node_restarting_alone_keeps_the_pinned_revision_and_its_peers_fabric_env(prepared):
    """Staging flips `current` per node; a unit that systemd restarts alone must load what its peers loaded,
    with their NCCL environment. The engine loads the fleet contract's revision directory, so a moved `current`
    changes nothing; the deprecated engine_model_path through `current` is refused when the nodes disagree; a
    changed fabric env restarts the whole deployment in order."""
    lab = prepared
    cp = engine()
    assert cp.returncode == 0, cp.stdout[-4000:]
    assert f"{MODELS}/{REV}" in unit(lab, "node2", "ExecStart") and "current" not in unit(lab, "node2", "ExecStart")
    new = "0" * 40
    try:
        # node2 finished staging a new revision (current moved) and its engine restarts alone.
        ssh(
            lab,
            "node2",
            f"mkdir -p {MODELS}/{new} && ln -sfn {new} {MODELS}/current.tmp && mv -T {MODELS}/current.tmp {MODELS}/current",
        )
        fabric = ssh(lab, "node2", "cat /etc/llmfleet/fabric.env").stdout
        ssh(lab, "node2", "echo NCCL_SOCKET_IFNAME=wrong0 >> /etc/llmfleet/fabric.env")
        # node2's rank dies: systemd restarts node2 (and, through the deployment link, node1 with it).
        restarts = int(unit(lab, "node2", "NRestarts") or 0)
        ssh(lab, "node2", "pkill -KILL -o -f '[e]ngine_sim.py _rank'")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if int(unit(lab, "node2", "NRestarts") or 0) > restarts and f"{MODELS}/{REV}" in sim_processes(
                lab, "node2"
            ):
                break
            time.sleep(1)
        assert f"{MODELS}/{REV}" in sim_processes(lab, "node2") and new not in sim_processes(lab, "node2")
        pid = unit(lab, "node2", "MainPID")
        environ = ssh(lab, "node2", f"tr '\\0' '\\n' < /proc/{pid}/environ").stdout
        assert "NCCL_SOCKET_IFNAME=wrong0" not in environ, environ
        ssh(lab, "node2", f"printf '%s' {shlex.quote(fabric)} > /etc/llmfleet/fabric.env")
        # The contract's revision: the role plans <root>/<model>/<REV> on both nodes, whatever `current` says.
        cp = engine("--check")
        assert cp.returncode == 0, cp.stdout[-4000:]
        # The deprecated path through `current`: the role will not start nodes that would load different revisions.
        cp = engine("-e", f"engine_model_path={MODELS}/current")
        assert cp.returncode != 0
        assert "the nodes would load different revisions" in cp.stdout and f"node2 -> {MODELS}/{new}" in cp.stdout, (
            cp.stdout[-3000:]
        )
    finally:
        ssh(lab, "node2", f"ln -sfn {REV} {MODELS}/current && rm -rf {MODELS}/{new}")
    # A changed fabric env (here: one more variable from the topology role) restarts every node in order.
    before = {n: unit(lab, n, "InvocationID") for n in NODES}
    cp = engine("-e", json.dumps({"topology_extra_env": {"NCCL_DEBUG": "WARN"}}))
    assert cp.returncode == 0, cp.stdout[-4000:]
    assert ask() == "703"
    for n in NODES:
        assert unit(lab, n, "InvocationID") != before[n], n
        assert "NCCL_DEBUG=WARN" in ssh(lab, n, "cat /etc/llmfleet/engine/demo.env").stdout, n


def shared_node(name, gpus, port, *extra, playbook="playbooks/engine.yml", check=True):
    """A TP2 deployment of its own on node1 alone, on the (fake) GPUs it names (llmfleet_gpus)."""
    env = {"LLMFLEET_SIM_STATE_DIR": f"/var/lib/llmfleet/engine/{name}/sim"}
    vars_ = {"llmfleet_deployment": name, "llmfleet_gpus_per_node": 4, "llmfleet_tp_size": 2, "llmfleet_pp_size": 1,
             "llmfleet_gpus": gpus, "engine_port": port, "engine_ready_deadline": 120, "engine_env": env}  # fmt: skip
    return run_ansible("ansible-playbook", playbook, "--limit", "node1", "-e", json.dumps(vars_), *extra, check=check)


def test_two_deployments_share_a_node_on_disjoint_gpus(prepared):
    """Two deployments on one node, each on the GPUs it names: both serve, a third that wants one of their GPUs
    is refused before anything is installed, and each is removed without touching the other."""
    lab = prepared
    engine(playbook="playbooks/engine_stop.yml")  # demo names no GPUs: stopped in order, it gives node1 back
    removed = []
    try:
        for name, gpus, port in (("left", [0, 1], 30010), ("right", [2, 3], 30011)):
            shared_node(name, gpus, port)
        for name, port, gpus in (("left", 30010, "0,1"), ("right", 30011, "2,3")):
            assert ssh(lab, "node1", f"systemctl is-active llmfleet-{name}.service").stdout.strip() == "active"
            assert ask(port) == "703"
            env = ssh(lab, "node1", f"cat /etc/llmfleet/engine/{name}.env").stdout
            assert f"CUDA_VISIBLE_DEVICES={gpus}\n" in env and "CUDA_DEVICE_ORDER=PCI_BUS_ID\n" in env
            journal = ssh(lab, "node1", f"journalctl -u llmfleet-{name}.service -o cat --no-pager").stdout
            assert f"[simulator] GPUs: CUDA_VISIBLE_DEVICES={gpus}, local ranks on GPU {gpus}" in journal
            claim = json.loads(ssh(lab, "node1", f"cat /etc/llmfleet/gpus/{name}.json").stdout)
            assert claim == {"deployment": name, "gpus": [int(g) for g in gpus.split(",")], "ports": {"api": port}}
        cp = shared_node("clash", [1, 2], 30012, check=False)
        assert cp.returncode != 0
        assert (
            "node1: deployment clash cannot start here: GPU 1 already belongs to deployment left (its GPUs: 0, 1): "
            "choose others in llmfleet_gpus; GPU 2 already belongs to deployment right"
        ) in " ".join(cp.stdout.split())
        clash = ssh(lab, "node1", "systemctl show llmfleet-clash.service -p LoadState --value").stdout.strip()
        assert clash == "not-found"
        assert ssh(lab, "node1", "test -e /etc/llmfleet/gpus/clash.json", check=False).returncode == 1
        # Removing one (stopped in order, then its files) leaves the other serving, and gives its GPUs back.
        shared_node("left", [0, 1], 30010, playbook="playbooks/reset.yml")
        removed.append("left")
        assert ssh(lab, "node1", "systemctl is-active llmfleet-left.service", check=False).stdout.strip() == "inactive"
        assert ssh(lab, "node1", "test -e /etc/llmfleet/gpus/left.json", check=False).returncode == 1
        assert ssh(lab, "node1", "systemctl is-active llmfleet-right.service").stdout.strip() == "active"
        assert ask(30011) == "703"
    finally:  # removed, not only stopped: installed, they keep node1's runtime in use for the later reset lab test
        for name, gpus, port in (("left", [0, 1], 30010), ("right", [2, 3], 30011)):
            if name not in removed:
                shared_node(name, gpus, port, playbook="playbooks/reset.yml", check=False)
    assert sim_processes(lab, "node1") == ""
