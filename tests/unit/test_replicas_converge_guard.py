"""A plain converge (site.yml, engine.yml) refuses a revision change of serving replicas, naming playbooks/rollout.yml;
it lets an unchanged revision, or replicas that do not serve, through. The task of roles/engine/tasks/replicas.yml
runs in real ansible-playbook on localhost; what systemctl and the unit files answered on the replicas' heads is
given as the registered results (a double: there are no replica nodes here)."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import pytest
import yaml

from tests.unit.test_engine_role import ROOT

REV_A, REV_B = "a" * 40, "b" * 40


def guard(tmp_path, active, revision):
    tasks = yaml.safe_load((ROOT / "roles/engine/tasks/replicas.yml").read_text())
    task = next(t for t in tasks if t["name"].startswith("A serving replica changes revision"))
    unit = base64.b64encode(f"ExecStart=/x /mnt/nvme/llmfleet/models/demo-model/{REV_A}/ --y\n".encode()).decode()
    play = [{"name": "The guard", "hosts": "localhost", "gather_facts": False, "tasks": [task], "vars": {
        "llmfleet_deployment": "demo", "llmfleet_model": "demo-model", "llmfleet_model_revision": revision,
        "engine_state": "started", "engine_rollout": False,
        "_engine_replicas": [{"name": "r0", "deployment": "demo-r0", "nodes": ["node1", "node2"]},
                             {"name": "r1", "deployment": "demo-r1", "nodes": ["node3", "node4"]}],
        "_engine_replica_active": {"results": [{"stdout": a} for a in active]},
        "_engine_replica_unitf": {"results": [{"content": unit}, {"content": unit}]}}}]  # fmt: skip
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp")}  # fmt: skip
    cp = subprocess.run([f"{bindir}/ansible-playbook", "-i", "localhost,", "-c", "local", str(tmp_path / "play.yml")],
                        capture_output=True, text=True, check=False, timeout=120, cwd=ROOT, env=env)  # fmt: skip
    return cp.returncode, " ".join((cp.stdout + cp.stderr).split())


def test_a_revision_change_of_serving_replicas_is_refused_naming_the_rollout(tmp_path):
    rc, out = guard(tmp_path, ["active", "active"], REV_B)
    assert rc != 0
    assert (f"demo serves r0 (demo-r0 on node1, node2, revision {REV_A}); r1 (demo-r1 on node3, node4, revision {REV_A}),"
            f" and this run names revision {REV_B}") in out, out[-2000:]  # fmt: skip
    assert "playbooks/rollout.yml" in out and "Traceback" not in out


@pytest.mark.parametrize(("active", "revision"), [(["active", "active"], REV_A), (["inactive", "failed"], REV_B)])
def test_the_same_revision_or_replicas_not_serving_pass(tmp_path, active, revision):
    rc, out = guard(tmp_path, active, revision)
    assert rc == 0, out[-2000:]
