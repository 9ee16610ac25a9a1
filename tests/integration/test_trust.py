"""Only the deployment's nodes take part in its deployment link and its staging, on the lab as the `ops` operator
(the lab inventory's): a host on the fabric that is not a node (the ops host, 10.77.0.1 on the lab bridge, where
this test runs) cannot stop, restart or read from the deployment, while the nodes still heal together and stage
from each other. The key is the deployment's fabric key, made by the play (docs/security.md)."""

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from tests.helpers.ckpt import make_checkpoint
from tests.integration.conftest import ROOT, ansible_env, kill_tree, run_ansible, ssh
from tests.integration.test_engine import BASE, LIMIT, NODES, ask, engine, unit

KEY_FILE = "/etc/llmfleet/credentials/demo.fabric-key"
HEAD, LINK_PORT = "10.77.0.11", 50082
UNIT = "llmfleet-demo.service"


@pytest.fixture(scope="module")
def serving(lab):
    """The simulator deployment of test_engine (2 nodes, TP2 x PP2) with its link, up and answering."""
    # One ansible-playbook run for the four (as site.yml runs them): one start of Ansible instead of four.
    playbooks = [f"playbooks/{pb}.yml" for pb in ("base", "topology", "model_stage", "engine")]
    cp = run_ansible("ansible-playbook", *playbooks, *LIMIT, *BASE, check=False, timeout=600)
    assert cp.returncode == 0, cp.stdout[-4000:]
    yield lab
    engine(playbook="playbooks/engine_stop.yml")
    for n in NODES:
        ssh(lab, n, f"systemctl reset-failed {UNIT} || true")
    for i in range(1, len(NODES) + 1):
        lab.wipe_nvme(lab.node(i))


def key_of(lab, node):
    """(owner, mode, sha256 of the key): the key itself never leaves the node."""
    owner, mode = ssh(lab, node, f"stat -c '%U %a' {KEY_FILE}").stdout.split()
    return owner, mode, ssh(lab, node, f"sha256sum < {KEY_FILE}").stdout.split()[0]


def stranger(*lines, hold=0.0):
    """The ops host speaking the link's protocol without the key; what the head answered."""
    with socket.create_connection((HEAD, LINK_PORT), timeout=5) as s:
        for line in lines:
            s.sendall((line + "\n").encode())
        time.sleep(hold)
        s.settimeout(2)
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except OSError:
            pass
        return got.decode()


def test_a_stranger_on_the_fabric_cannot_stop_or_restart_the_deployment_which_still_heals(serving):
    """Before the key, `HELLO node2` + `BYE node2 ...` from any host stopped the head (exit 0, nothing restarted,
    the record blaming node2), `FAIL` or a dropped connection restarted the whole deployment."""
    lab = serving
    owners = {n: key_of(lab, n) for n in NODES}
    assert {o[:2] for o in owners.values()} == {("root", "600")} and len({o[2] for o in owners.values()}) == 1
    before = {n: (unit(lab, n, "InvocationID"), unit(lab, n, "NRestarts")) for n in NODES}
    nonce = "0" * 32
    got = [
        stranger("HELLO node2", "BYE node2 stop requested (SIGTERM)"),
        stranger(f"HELLO node2 {nonce}", "AUTH " + "0" * 64, "FAIL node2 exit 1"),
        stranger(f"HELLO node2 {nonce}", hold=0.1),  # then gone: before, that was a node lost
        stranger("STOP requested node1 x"),
    ]
    assert not any("WELCOME" in g for g in got), got
    time.sleep(8)  # past the link's 5 s heartbeat timeout
    assert {n: (unit(lab, n, "InvocationID"), unit(lab, n, "NRestarts")) for n in NODES} == before
    assert all(unit(lab, n, "ActiveState") == "active" for n in NODES)
    assert ask() == "703"
    journal = ssh(lab, "node1", f"journalctl -u {UNIT} -o cat --no-pager | grep 'link: refused' || true").stdout
    assert journal.count("link: refused a connection from 10.77.0.1:") >= 4, journal[-2000:]
    # The nodes, holding the key, still heal together: a rank SIGKILLed on node2 restarts the deployment.
    ssh(lab, "node2", "pkill -KILL -o -f '[e]ngine_sim.py _rank'")
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        back = all(int(unit(lab, n, "NRestarts") or 0) > int(before[n][1] or 0) for n in NODES)
        if back and all(unit(lab, n, "ActiveState") == "active" for n in NODES):
            break
        time.sleep(2)
    else:
        raise AssertionError({n: (unit(lab, n, "NRestarts"), unit(lab, n, "ActiveState")) for n in NODES})
    rec = json.loads(ssh(lab, "node1", "cat /var/lib/llmfleet/engine/demo/termination.json.1").stdout)
    assert rec["verdict"] == "peer-failed" and rec["link"]["stopped_by"]["node"] == "node2", rec["reason"]
    assert _answers_within(90)


def _answers_within(seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if ask() == "703":
                return True
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(2)
    return False


def test_rotating_the_key_restarts_the_deployment_with_a_new_one_on_every_node(serving):
    lab = serving
    old = key_of(lab, "node1")[2]
    before = {n: unit(lab, n, "InvocationID") for n in NODES}
    cp = engine("-e", "llmfleet_fabric_key_rotate=true")
    assert cp.returncode == 0, cp.stdout[-4000:]
    new = {n: key_of(lab, n) for n in NODES}
    assert {k for *_, k in new.values()} != {old} and len({k for *_, k in new.values()}) == 1, new
    assert all(o[:2] == ("root", "600") for o in new.values())
    assert all(unit(lab, n, "InvocationID") != before[n] for n in NODES)
    assert ask() == "703"
    # Never in the play's output, the unit or argv: the unit names the credential file only.
    unit_text = ssh(lab, "node1", f"cat /etc/systemd/system/{UNIT}").stdout
    elsewhere = (
        cp.stdout + cp.stderr + unit_text + ssh(lab, "node1", f"ps -eo args; journalctl -u {UNIT} --no-pager").stdout
    )
    key = ssh(lab, "node1", f"cat {KEY_FILE}").stdout.strip()
    assert len(key) >= 32 and key not in elsewhere
    assert KEY_FILE in unit_text and "--link-key fabric-key" in unit_text  # the unit names the file, not the key


def peer_get(port, path):
    try:
        with urllib.request.urlopen(f"http://{HEAD}:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_a_stranger_gets_403_from_a_staging_peer_server_while_the_nodes_stage_from_each_other(serving, tmp_path):
    """Before: any host on the fabric listed the files on /status and fetched the weights from /files/."""
    lab = serving
    model, revision, port = "trust", "7" * 40, 29999
    d = lab.shared / model
    shutil.rmtree(d, ignore_errors=True)
    make_checkpoint(d, shards=8, tensors_per_shard=4, shape=(512, 256))  # 8 MiB
    ev = {"llmfleet_model": model, "llmfleet_model_revision": revision, "model_stage_source": f"/mnt/shared/{model}",
          "llmfleet_report_dir": str(tmp_path), "model_stage_rate_limit_mib_s": 1, "model_stage_peer_port": port,
          "model_stage_activate": False}  # fmt: skip
    argv = ["ansible-playbook", "playbooks/model_stage.yml", *LIMIT, "-e", json.dumps(ev)]
    proc = subprocess.Popen(argv, cwd=ROOT, env=ansible_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        deadline, seen = time.monotonic() + 120, []
        while len(seen) < 2:
            assert time.monotonic() < deadline, f"the peer server never answered: {seen}"
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            try:
                seen = [peer_get(port, "/status"), peer_get(port, "/files/model-00001-of-00008.safetensors")]
            except OSError:  # not listening yet
                seen = []
                time.sleep(0.2)
        assert [s for s, _ in seen] == [403, 403], seen
        assert not any(b"safetensors" in body or len(body) > 1000 for _, body in seen), seen
        out, _ = proc.communicate(timeout=300)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    assert proc.returncode == 0, out.decode()[-4000:]
    nodes = json.loads((tmp_path / f"stage-{model}.json").read_text())["nodes"]
    assert sum(r["peer_bytes_read"] for r in nodes.values()) > 0, nodes  # the nodes still stage from each other
    assert nodes["node1"]["peer_refused"] >= 2 and nodes["node1"]["peer_refused_from"][0].startswith("10.77.0.1:")
