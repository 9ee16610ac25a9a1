"""playbooks/site.yml on the lab: a contradictory inventory stops it before it touches a node.

site.yml end to end on a fresh fleet (what it installs, stages, starts, accepts and reports; preflight refusing the
serving deployment; the ordered stop before the checks) is checked in test_collection.py, on the run of the installed
collection as a site makes it: one bring-up of the fleet serves both."""

from tests.integration.conftest import run_ansible


def test_site_refuses_a_contradictory_inventory(lab, tmp_path):
    inv = tmp_path / "hosts.yml"
    inv.write_text(
        "all:\n  children:\n    llmfleet_nodes:\n      children:\n"
        "        head: {hosts: {node1: {ansible_host: 10.77.0.11, llmfleet_fabric_ip: 10.77.0.11}}}\n"
        "        worker: {hosts: {node2: {ansible_host: 10.77.0.12, llmfleet_fabric_ip: 10.77.0.11}}}\n"
    )
    cp = run_ansible("ansible-playbook", "-i", str(inv), "playbooks/site.yml", check=False)
    assert cp.returncode != 0
    assert "10.77.0.11 on node1 and node2" in " ".join(cp.stdout.split())
    assert "Install the llmfleet node runtime" not in cp.stdout  # failed before touching nodes
