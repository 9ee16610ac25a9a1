"""A plain converge (site.yml, engine.yml) rolls the serving replicas whose unit names another revision, one at a
time as playbooks/rollout.yml does (tasks/rollout-replica.yml), and launches the others as usual: an unchanged
revision, or replicas that do not serve, are not rolled; rollout.yml rolls every replica. The tasks of
roles/engine/tasks/replicas.yml that decide it run in real ansible-playbook on localhost; what systemctl and the unit files answered on the replicas' heads is
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


def run_play(tmp_path, play):
    """ansible-playbook on localhost with the checkout's configuration."""
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp")}  # fmt: skip
    return subprocess.run([f"{bindir}/ansible-playbook", "-i", "localhost,", "-c", "local", str(tmp_path / "play.yml")],
                          capture_output=True, text=True, check=False, timeout=120, cwd=ROOT, env=env)  # fmt: skip


def guard(tmp_path, active, revision, rollout=False):
    tasks = yaml.safe_load((ROOT / "roles/engine/tasks/replicas.yml").read_text())
    task = next(t for t in tasks if t["name"] == "The replicas this run rolls")
    say = next(t for t in tasks if t["name"].startswith("Say that this converge rolls"))
    show = {"name": "Show", "ansible.builtin.debug": {"msg": "ROLLING={{ _engine_rolling | join(',') }}."}}
    unit = base64.b64encode(f"ExecStart=/x /mnt/nvme/llmfleet/models/demo-model/{REV_A}/ --y\n".encode()).decode()
    play = [{"name": "The guard", "hosts": "localhost", "gather_facts": False, "tasks": [task, say, show], "vars": {
        "llmfleet_deployment": "demo", "llmfleet_model": "demo-model", "llmfleet_model_revision": revision,
        "_engine_state": "started", "engine_rollout": rollout,
        "_engine_replicas": [{"name": "r0", "deployment": "demo-r0", "nodes": ["node1", "node2"]},
                             {"name": "r1", "deployment": "demo-r1", "nodes": ["node3", "node4"]}],
        "_engine_replica_active": {"results": [{"stdout": a} for a in active]},
        "_engine_replica_unitf": {"results": [{"content": unit}, {"content": unit}]}}}]  # fmt: skip
    cp = run_play(tmp_path, play)
    return cp.returncode, " ".join((cp.stdout + cp.stderr).split())


def test_a_converge_rolls_the_serving_replicas_on_another_revision(tmp_path):
    rc, out = guard(tmp_path, ["active", "active"], REV_B)
    assert rc == 0, out[-2000:]
    assert "ROLLING=r0,r1." in out, out[-2000:]
    assert f"replicas r0, r1 serve another revision than {REV_B}: rolled one at a time" in out, out[-2000:]


def test_a_converge_rolls_only_the_replicas_that_serve(tmp_path):
    rc, out = guard(tmp_path, ["failed", "active"], REV_B)
    assert rc == 0 and "ROLLING=r1." in out, out[-2000:]


@pytest.mark.parametrize(("active", "revision"), [(["active", "active"], REV_A), (["inactive", "failed"], REV_B)])
def test_the_same_revision_or_replicas_not_serving_are_not_rolled(tmp_path, active, revision):
    rc, out = guard(tmp_path, active, revision)
    assert rc == 0 and "ROLLING=." in out and "serve another revision" not in out, out[-2000:]


def test_the_rollout_rolls_every_replica(tmp_path):
    rc, out = guard(tmp_path, ["inactive", "failed"], REV_A, rollout=True)
    assert rc == 0 and "ROLLING=r0,r1." in out and "serve another revision" not in out, out[-2000:]


def test_a_deployment_without_replicas_skips_the_router_question(tmp_path):
    """The question a serving replica's restart asks its router (tasks/0020-install.yml) is skipped, not failed, for a
    deployment without replicas: there is no router node to delegate to (Ansible templates delegate_to first)."""
    tasks = yaml.safe_load((ROOT / "roles/engine/tasks/0020-install.yml").read_text())
    task = next(t for t in tasks if t["name"] == "Whether the replica's router routes to it now")
    play = [{"name": "The question", "hosts": "localhost", "gather_facts": False, "tasks": [task], "vars": {
        "_engine_replica_serving_restart": False, "_engine_roll_router": "vllm-router",
        "_engine_replica_router_local": "http://127.0.0.1:9"}}]  # fmt: skip
    cp = run_play(tmp_path, play)
    out = " ".join((cp.stdout + cp.stderr).split())
    assert cp.returncode == 0 and "skipping: [localhost]" in out, out[-2000:]
