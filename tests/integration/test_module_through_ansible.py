"""A module from library/ that imports ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet, run by Ansible over SSH."""

import json

import llmfleet
from tests.integration.conftest import LAB_NODES, run_ansible


def test_node_info_module_on_every_lab_node(lab, tmp_path):
    out = tmp_path / "r.json"
    run_ansible("ansible-playbook", "tests/integration/playbooks/node_info.yml", "-e", f"out={out}")
    res = json.loads(out.read_text())
    assert sorted(res) == [f"node{i}" for i in range(1, LAB_NODES + 1)]
    for host, r in res.items():
        assert not r.get("failed") and r["changed"] is False, r
        node = r["node"]
        assert node["hostname"] == host
        assert node["pid1"] == "systemd"
        assert node["container"] == "labnode"
        assert node["llmfleet_version"] == llmfleet.__version__  # the module_utils copy AnsiballZ shipped
        assert node["shared"] == {"path": "/mnt/shared", "mounted": True, "read_only": True}
    assert len({r["node"]["machine_id"] for r in res.values()}) == LAB_NODES
