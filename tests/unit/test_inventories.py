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


def test_real_engine_overlay_keeps_the_collective_timeout_above_a_slow_first_forward():
    """vLLM applies --distributed-timeout-seconds to every Gloo collective, not only the rendezvous. The lab's
    30 s (meant for the simulator's rendezvous tests) reached the real CPU engine through the group vars, and a
    rank on the lab's shared cores that came to the first forward's all-reduce over 30 s late failed the
    deployment with 'Timed out waiting 30000ms for recv operation' (CI, molecule bench, 2026-12-01)."""
    import yaml

    base = yaml.safe_load((ROOT / "inventory/lab/group_vars/all.yml").read_text())
    overlay = yaml.safe_load((ROOT / "inventory/overlays/lab-vllm-cpu.yml").read_text())
    timeout = {**base, **overlay}["engine_dist_timeout"]
    # 0 = the engine's own default (PyTorch's 1800 s on Gloo); otherwise at least the gate's whole deadline.
    assert timeout == 0 or timeout >= overlay["engine_ready_deadline"], timeout


def test_real_engine_overlay_gives_each_nodes_rank_its_own_core():
    """Both lab nodes see the machine's 2 cores; vLLM's default binding (auto) reserved one and bound both
    nodes' ranks to core 0, so the two-node TP2 engine ran on one core while the other idled."""
    import jinja2
    import yaml

    overlay = yaml.safe_load((ROOT / "inventory/overlays/lab-vllm-cpu.yml").read_text())
    bind = overlay["engine_env"].get("VLLM_CPU_OMP_THREADS_BIND")
    assert bind, "the overlay leaves the binding to vLLM (auto: core 0 on every lab node)"
    cores = [jinja2.Environment(autoescape=True).from_string(bind).render(engine_node_rank=str(r)) for r in (0, 1)]
    assert cores == ["0", "1"], cores


def test_real_engine_overlay_and_the_lab_test_run_eager_at_the_first_request_too():
    """vLLM's CPU build compiles its vocab-parallel embedding mask with inductor and g++ at the first request when
    TP > 1 (--enforce-eager does not cover it): 13-31 s between the port opening and the first answer on the lab,
    and one rank compiling longer than the other once reached the first all-reduce past the collective timeout."""
    import yaml

    overlay = yaml.safe_load((ROOT / "inventory/overlays/lab-vllm-cpu.yml").read_text())
    assert overlay["engine_env"].get("TORCHDYNAMO_DISABLE") == "1", overlay["engine_env"]
    assert '"TORCHDYNAMO_DISABLE": "1"' in (ROOT / "tests/integration/test_real_engine.py").read_text()
