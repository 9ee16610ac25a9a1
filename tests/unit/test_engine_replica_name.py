"""A replica's launch takes its own deployment name, API port and GPUs from the internal _engine_replica, so that
`-e llmfleet_deployment=... -e engine_port=...` (extra vars beat include vars) cannot give every replica the
deployment's own unit, state directory, claim, fabric key and port. Rendered by real ansible-playbook on localhost."""

from __future__ import annotations

import json
import re

from tests.unit.test_engine_role import ROOT, play

REPLICA = {"index": 0, "name": "r1", "deployment": "demo-r1", "nodes": ["localhost"], "gpus": "", "port": 8101}
PLAY = """
- name: One replica's launch on localhost, the deployment's name and port given as extra vars
  hosts: all
  gather_facts: false
  tasks:
    - name: The node's topology (an empty sysfs tree)
      llmfleet.fleet.llmfleet_topology_facts:
        sysfs_root: "{{ out_dir }}"
        use_nvml: false

    - name: Plan, as tasks/replicas.yml launches a replica
      ansible.builtin.include_role:
        name: engine
        tasks_from: 0010-plan.yml
        public: true
      vars:
        _engine_replica: "{{ replica }}"

    - name: What the replica's launch names
      ansible.builtin.copy:
        content: "{{ {'deployment': _engine_deployment, 'unit': _engine_unit, 'dir': _engine_dir, 'claim': _engine_claim_path,
                     'port': _engine_port | int, 'argv': _engine_plan.argv, 'endpoint': _engine_endpoint.deployment,
                     'fabric_key': _llmfleet_fabric_key_file, 'env_file': _engine_env_file} | to_json }}"
        dest: "{{ out_dir }}/out.json"
        mode: "0644"
      vars:
        _engine_replica: "{{ replica }}"
"""


def test_extra_vars_do_not_rename_a_replica(tmp_path):
    rc, out, _ = play(tmp_path, PLAY, replica=REPLICA, llmfleet_deployment="demo", engine_port=9999,
                      engine_profile="vllm")  # fmt: skip
    assert rc == 0, out[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["deployment"] == "demo-r1"
    assert got["unit"] == "llmfleet-demo-r1.service"
    assert got["dir"].endswith("/demo-r1")
    assert got["claim"].endswith("/demo-r1.json")
    assert got["env_file"].endswith("/demo-r1.env")
    assert got["fabric_key"].endswith("/demo-r1.fabric-key")
    assert got["endpoint"] == "demo-r1"
    assert got["port"] == 8101
    assert "--port" in got["argv"] and got["argv"][got["argv"].index("--port") + 1] == "8101"


def test_the_role_names_its_deployment_only_through_the_internal_variable():
    """Every task and template that runs inside a replica's launch reads _engine_deployment; llmfleet_deployment is
    read where the deployment itself is meant (its replicas, its router, the rollout record) and in the definition."""
    outer = {"replicas.yml", "replica-router.yml", "replica-scale-in.yml", "rollout-record.yml", "rollout-replica.yml", "main.yml",
             "engine-replica-router.service.j2"}  # fmt: skip
    offenders = []
    for path in [*(ROOT / "roles/engine/tasks").glob("*.yml"), *(ROOT / "roles/engine/templates").glob("*.j2")]:
        if path.name in outer:
            continue
        offenders += [f"{path.name}:{n}" for n, line in enumerate(path.read_text().splitlines(), 1)
                      if re.search(r"\bllmfleet_deployment\b", line) and not line.lstrip().startswith("#")]  # fmt: skip
    vars_lines = (ROOT / "roles/engine/vars/main.yml").read_text().splitlines()
    offenders += [f"vars/main.yml:{n}" for n, line in enumerate(vars_lines, 1)
                  if re.search(r"\bllmfleet_deployment\b", line) and not line.lstrip().startswith("#")
                  and not line.startswith("_engine_deployment:")]  # fmt: skip
    assert offenders == []
