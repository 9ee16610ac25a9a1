"""The fleet contract (roles/llmfleet) checks llmfleet_replicas before any role acts: a shape it cannot place
fails the play naming the replica, the node and the fix; a good one passes, and the whole-group TP x PP rule
(which a replica's own size would break) gives way to the replicas' check."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLAY = """\
- hosts: llmfleet_nodes
  gather_facts: false
  roles: [llmfleet]
"""
INVENTORY = {"all": {"children": {"llmfleet_nodes": {
    "children": {"head": {"hosts": {"node1": {"llmfleet_fabric_ip": "10.0.0.1"}}}},
    "hosts": {f"node{i}": {"llmfleet_fabric_ip": f"10.0.0.{i}"} for i in (2, 3, 4)}}}}}  # fmt: skip


def contract(tmp_path, replicas):
    (tmp_path / "play.yml").write_text(PLAY)
    (tmp_path / "inventory.json").write_text(json.dumps(INVENTORY))
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_ROLES_PATH": str(ROOT / "roles"),
           "PATH": f"{bindir}:{os.environ['PATH']}", "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp")}  # fmt: skip
    extra = {"llmfleet_replicas": replicas, "llmfleet_tp_size": 2, "llmfleet_pp_size": 1, "llmfleet_gpus_per_node": 2,
             "llmfleet_deployment": "demo", "ansible_connection": "local", "ansible_python_interpreter": sys.executable}  # fmt: skip
    cp = subprocess.run(
        [f"{bindir}/ansible-playbook", "-i", str(tmp_path / "inventory.json"), str(tmp_path / "play.yml"),
         "-e", json.dumps(extra)],
        capture_output=True, text=True, check=False, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    out = cp.stdout + cp.stderr
    assert "Traceback" not in out, out[-3000:]
    return cp.returncode, " ".join(out.split())


def test_two_replicas_of_tp2_over_two_nodes_pass_where_tp2_over_four_would_not(tmp_path):
    rc, out = contract(
        tmp_path, [{"name": "r0", "nodes": ["node1", "node2"]}, {"name": "r1", "nodes": ["node3", "node4"]}]
    )
    assert rc == 0, out[-3000:]


def test_a_shape_the_nodes_cannot_hold_fails_the_play_naming_replica_node_and_fix(tmp_path):
    rc, out = contract(
        tmp_path, [{"name": "r0", "nodes": ["node1", "node2", "node3"]}, {"name": "r1", "nodes": ["node9"]}]
    )
    assert rc != 0
    assert "replica r0 (3 nodes): TP2 x PP1 = 2 ranks cannot be split evenly over 3 nodes" in out
    assert "replica r1: node9 not in llmfleet_nodes: add the host to the group or take it out of the replica" in out
