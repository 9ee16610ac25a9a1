"""`llmfleet startscan --unit` against a real systemd and journal (a lab node): the unit's current start is scanned,
and a unit systemd does not know is exit 2 naming it, never "no known fall-back line" having read nothing."""

from __future__ import annotations

import time

from tests.integration.conftest import ROOT, ssh

PY = f"{ROOT}/.venv/bin/python"  # the project is bind-mounted at the same path on every node
UNIT = "llmfleet-scantest.service"


def test_startscan_reads_a_units_start_and_refuses_a_unit_systemd_does_not_know(lab):
    ssh(lab, "node1", f"systemd-run --unit {UNIT} --collect sh -c 'echo engine says hello; sleep 120'")
    try:
        for _ in range(50):  # the journal has the line within a second or two
            cp = ssh(lab, "node1", f"{PY} -m llmfleet.cli startscan --unit {UNIT}", check=False)
            if cp.returncode == 0:
                break
            time.sleep(0.2)
        assert cp.returncode == 0 and "no known fall-back line" in cp.stdout, cp.stderr
        cp = ssh(lab, "node1", f"{PY} -m llmfleet.cli startscan --unit llmfleet-nosuch.service", check=False)
        assert cp.returncode == 2 and cp.stdout == "", cp.stdout
        assert "--unit llmfleet-nosuch.service: systemd has no such unit (LoadState=not-found)" in cp.stderr
    finally:
        ssh(lab, "node1", f"systemctl stop {UNIT}", check=False)
