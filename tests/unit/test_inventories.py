"""The shipped inventories parse cleanly: every file directly in an inventory directory is read as an
inventory source, so a vars file left there (the vLLM CPU overlay once was) turns its variables into
bogus group definitions with a warning on every play."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The lab's hosts.yml is written by labctl at bring-up; a two-node one stands in here.
LAB_HOSTS = """all:
  children:
    llmfleet_nodes:
      children:
        head: {hosts: {node1: {ansible_host: 10.77.0.11, llmfleet_fabric_ip: 10.77.0.11}}}
        workers: {hosts: {node2: {ansible_host: 10.77.0.12, llmfleet_fabric_ip: 10.77.0.12}}}
"""


@pytest.mark.parametrize("name", ["lab", "example-h20"])
def test_inventory_parses_without_warnings(tmp_path, name):
    inv = tmp_path / name
    shutil.copytree(ROOT / "inventory" / name, inv)
    if name == "lab":
        (inv / "hosts.yml").write_text(LAB_HOSTS)
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp")}  # fmt: skip
    cp = subprocess.run([f"{bindir}/ansible-inventory", "-i", str(inv), "--list"],
                        capture_output=True, text=True, check=False, timeout=120, env=env)  # fmt: skip
    assert cp.returncode == 0, cp.stderr
    assert "WARNING" not in cp.stderr, cp.stderr
    assert '"head"' in cp.stdout
