"""Preflight on the lab with injected inconsistencies: the table names the odd node. (The clean lab passing with
the warnings of a lab without GPUs is checked on site.yml's own preflight, in test_collection.py.)"""

import json

import pytest

from tests.integration.conftest import run_ansible, ssh

DRIVER = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  {v}  Thu Oct 30 2026\n"


def preflight(tmp_path, *extra):
    cp = run_ansible("ansible-playbook", "playbooks/preflight.yml", "-e", f"llmfleet_report_dir={tmp_path}", *extra,
                     check=False)  # fmt: skip
    report = json.loads((tmp_path / "preflight.json").read_text())
    return cp, report


@pytest.fixture
def driver_stubs(lab):
    for i, v in ((1, "580.159.04"), (2, "570.86.10"), (3, "580.159.04")):
        ssh(lab, f"node{i}", f"mkdir -p /etc/llmfleet && printf '{DRIVER.format(v=v)}' > /etc/llmfleet/driver-version")
    yield "/etc/llmfleet/driver-version"
    for i in (1, 2, 3):
        ssh(lab, f"node{i}", "rm -f /etc/llmfleet/driver-version")


def test_a_different_driver_names_the_node(lab, tmp_path, driver_stubs):
    cp, report = preflight(tmp_path, "-e", f"preflight_driver_version_file={driver_stubs}")
    assert cp.returncode != 0
    assert report["failed_nodes"] == ["node2"]
    row = next(r for r in report["rows"] if r["check"] == "driver_version" and r["status"] == "fail")
    assert row["node"] == "node2" and row["value"] == "570.86.10" and "580.159.04" in row["message"]
    assert "preflight failed on node2" in " ".join(cp.stdout.split())


def test_a_blocked_rendezvous_port_names_the_node(lab, tmp_path):
    from tests.lab.labctl import run

    ns = lab.node(3).netns
    run(["ip", "netns", "exec", ns, "iptables", "-A", "INPUT", "-p", "tcp", "--dport", "50080", "-j", "DROP"])
    try:
        cp, report = preflight(tmp_path)
    finally:
        run(["ip", "netns", "exec", ns, "iptables", "-D", "INPUT", "-p", "tcp", "--dport", "50080", "-j", "DROP"])
    assert cp.returncode != 0
    assert report["failed_nodes"] == ["node3"]
    row = next(r for r in report["rows"] if r["check"] == "ports_reachable" and r["node"] == "node3")
    assert "50080 from node1: timeout" in row["message"] and "50080 from node2: timeout" in row["message"]


def test_a_clock_offset_names_the_node(lab, tmp_path):
    for i, off in ((1, "0.000031 seconds fast"), (2, "0.750000 seconds slow"), (3, "0.000002 seconds slow")):
        ssh(
            lab,
            f"node{i}",
            f"mkdir -p /etc/llmfleet && echo 'System time     : {off} of NTP time' > /etc/llmfleet/chrony-tracking",
        )
    cp, report = preflight(tmp_path, "-e", "preflight_clock_source=/etc/llmfleet/chrony-tracking")
    assert cp.returncode != 0 and report["failed_nodes"] == ["node2"]
    row = next(r for r in report["rows"] if r["check"] == "clock_sync" and r["node"] == "node2")
    assert row["value"] == -0.75 and "exceeds" in row["message"]
