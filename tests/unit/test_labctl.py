"""Pure parts of the lab harness (the rest is exercised for real in tests/integration)."""

import json

import pytest

from tests.lab import labctl


@pytest.mark.parametrize("name", ["", "Lab", "toolong", "a-b", "1ab"])
def test_lab_name_must_fit_link_names(name):
    with pytest.raises(labctl.LabError, match="lab name"):
        labctl.Lab(name=name)


def test_subnet_is_validated():
    with pytest.raises(labctl.LabError, match="subnet"):
        labctl.Lab(subnet="10.77.0.0/24")


def test_node_naming_fits_ifnamsiz():
    lab = labctl.Lab(name="abcde")
    n = lab.node(240)
    assert len(n.veth) <= 15 and len(lab.bridge) <= 15
    assert n.ip == "10.77.0.250"


def test_inventory_layout(tmp_path):
    lab = labctl.Lab(name="t", subnet="10.99.0", state_root=tmp_path, inventory_dir=tmp_path / "inv")
    nodes = [lab.node(i) for i in (1, 2, 3)]
    for n in nodes:
        n.dir.mkdir(parents=True)
        (n.dir / "ssh_host_ed25519_key.pub").write_text(f"ssh-ed25519 AAAA{n.index} {n.name}\n")
    lab.write_inventory(nodes)
    text = (tmp_path / "inv/hosts.yml").read_text()
    inv = json.loads(text.split("\n", 1)[1])
    groups = inv["all"]["children"]["llmfleet_nodes"]["children"]
    assert list(groups["head"]["hosts"]) == ["node1"]
    assert list(groups["worker"]["hosts"]) == ["node2", "node3"]
    assert groups["worker"]["hosts"]["node3"] == {"ansible_host": "10.99.0.13", "llmfleet_fabric_ip": "10.99.0.13"}
    known = (tmp_path / "t/known_hosts").read_text().splitlines()
    assert known[1] == "node2,10.99.0.12 ssh-ed25519 AAAA2"
    assert "StrictHostKeyChecking yes" in lab.ssh_config.read_text()


def test_up_rejects_bad_counts():
    with pytest.raises(labctl.LabError, match="node count"):
        labctl.Lab(name="t").up(0)
