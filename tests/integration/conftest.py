"""Integration tests run against the lab: real systemd + sshd hosts in network namespaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ansible_cache
from tests.lab import demo_model, labctl

ROOT = Path(__file__).resolve().parents[2]
LAB_NODES = int(os.environ.get("LLMFLEET_TEST_NODES", "4"))


def ansible_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the venv's ansible
    env.update(
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        # The lab's inventory, named here: ansible.cfg names none (an operator's forgotten -i must not reach a fleet).
        ANSIBLE_INVENTORY=env.get("ANSIBLE_INVENTORY", str(ROOT / "inventory" / "lab")),
        # Private to this user (see the Makefile), never a predictable path in /tmp.
        ANSIBLE_HOME=env.get("ANSIBLE_HOME", str(Path.home() / ".cache/llmfleet/ansible")),
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_DEPRECATION_WARNINGS="0",
    )
    ansible_cache.enable(env)
    return env


@pytest.fixture(scope="session")
def lab():
    """A lab of LAB_NODES nodes shared by the integration session; torn down at the end."""
    if os.geteuid() != 0:
        pytest.fail("integration tests need root for the lab (network namespaces, mounts, cgroups)")
    lab = labctl.default_lab()
    # Fresh nodes: a lab left running (e.g. by `make demo`, with its engine units) is not ours to reuse.
    lab.up(LAB_NODES, wipe_nvme=True, fresh=True)
    demo_model.ensure(lab.shared)  # site.yml stages it (inventory/lab/group_vars)
    yield lab
    lab.down()


def run_ansible(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run an ansible CLI (`ansible`, `ansible-playbook`) from the project root."""
    env = ansible_env()
    cp = subprocess.run(list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if check and cp.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {cp.returncode}\n{cp.stdout[-4000:]}\n{cp.stderr[-4000:]}")
    return cp


def ssh(lab: labctl.Lab, node: str, command: str, check: bool = True) -> subprocess.CompletedProcess:
    cp = subprocess.run(
        ["ssh", "-F", str(lab.ssh_config), node, command], capture_output=True, text=True, timeout=30, check=False
    )
    if check and cp.returncode != 0:
        raise AssertionError(f"ssh {node} {command!r}: exit {cp.returncode}: {cp.stderr}")
    return cp


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant. Killing its process group is not enough for
    ansible-playbook: its per-host workers start sessions of their own and were left running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, found = [pid], []
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    for p in found:
        try:
            os.kill(p, 9)
        except ProcessLookupError:
            pass


def oncall(lab: labctl.Lab, tmp_path: Path, *args: str, deployment: str = "demo", timeout: float = 300):
    """The `llmfleet` on-call CLI from the ops host, over SSH as the lab's operator (become), against node1-2."""
    inv = tmp_path / "oncall-inventory.yml"
    inv.write_text(json.dumps({"all": {
        "vars": {"ansible_user": "ops", "ansible_become": True, "ansible_ssh_common_args": f"-F {lab.ssh_config}",
                 "llmfleet_deployment": deployment, "ansible_python_interpreter": "/usr/bin/python3"},
        "children": {"llmfleet_nodes": {"children": {
            "head": {"hosts": {"node1": {"ansible_host": "10.77.0.11", "llmfleet_fabric_ip": "10.77.0.11"}}},
            "worker": {"hosts": {"node2": {"ansible_host": "10.77.0.12", "llmfleet_fabric_ip": "10.77.0.12"}}}}}}}}))  # fmt: skip
    cmd = [str(Path(sys.executable).parent / "llmfleet"), args[0], "-i", str(inv), *args[1:]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
