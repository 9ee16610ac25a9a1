"""What the roles met on the lent one-GPU H200 machine (tests/device/site_local.sh,
docs/measurements/device-runs/2026-12-04-h200x1-site): outputs captured there (tests/fixtures/device-h200x1/) read by the
same code, and the host without systemd the roles ran on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmfleet.checks import preflight, topology
from llmfleet.engine import fit, fit_cli

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests/fixtures/device-h200x1"


def fake_nvidia_smi(bindir: Path, query_csv: str) -> None:
    """nvidia-smi answering as the H200's did: the preflight query, memory.total, and the plain table."""
    bindir.mkdir(parents=True, exist_ok=True)
    (bindir / "query.csv").write_text(query_csv)
    smi = bindir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        f'case "$1" in\n'
        f"  --query-gpu=memory.total) cat {FIX / 'nvidia-smi-memory-total.csv'} ;;\n"
        f"  --query-gpu=*) cat {bindir / 'query.csv'} ;;\n"
        f"  *) cat {FIX / 'nvidia-smi.txt'} ;;\n"
        "esac\n"
    )
    smi.chmod(0o755)


def measure_with(tmp_path, monkeypatch, query_csv: str) -> dict:
    fake_nvidia_smi(tmp_path / "bin", query_csv)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "sys").mkdir()
    return preflight.measure(sys_root=str(tmp_path / "sys"), nvme_path=str(tmp_path),
                             driver_version_file=str(FIX / "proc-driver-nvidia-version.txt"))  # fmt: skip


def ecc_row(m: dict) -> dict:
    rows = preflight.evaluate({"vm": m}, {"gpus_per_node": 1, "expect_gpus": True, "fabric_ips": {"vm": "127.0.0.1"}})
    return next(r for r in rows if r["check"] == "ecc")


def test_preflight_reads_the_h200s_own_query_answer(tmp_path, monkeypatch):
    """The H200 answers [N/A] for retired_pages.pending (Hopper remaps rows instead of retiring pages): the
    lab's fixtures had said "No". Every other field is read as nvidia-smi printed it there."""
    m = measure_with(tmp_path, monkeypatch, (FIX / "nvidia-smi-preflight-query.csv").read_text())
    assert m["gpu_count"] == 1 and m["gpu_models"] == ["NVIDIA H200"]
    assert m["driver_version"] == "580.159.04" and m["cuda_version"] == "13.0"
    assert m["persistence_mode"] == ["Enabled"] and m["mig_mode"] == ["Disabled"]
    assert m["ecc_uncorrected"] == 0
    q = preflight.parse_gpu_query((FIX / "nvidia-smi-preflight-query.csv").read_text())
    assert q[0]["retired_pages.pending"] == "[N/A]"
    assert m["remapped_rows_pending"] is False and m["row_remap_failure"] is False
    row = ecc_row(m)
    assert row["status"] == "pass", row
    assert row["value"]["remapped_rows_pending"] is False


@pytest.mark.parametrize(
    ("column", "what"),
    [(-2, "remapped_rows.pending"), (-1, "remapped_rows.failure")],
)
def test_a_hopper_gpu_awaiting_or_failing_a_row_remap_fails_ecc(tmp_path, monkeypatch, column, what):
    """retired_pages.pending says nothing on Hopper ([N/A]); the row remapper's pending/failure flags are the
    memory-health signal there. Before they were queried, such a GPU passed the ecc check."""
    cells = [c.strip() for c in (FIX / "nvidia-smi-preflight-query.csv").read_text().strip().split(",")]
    cells[column] = "Yes"
    m = measure_with(tmp_path, monkeypatch, ", ".join(cells) + "\n")
    row = ecc_row(m)
    assert row["status"] == "fail", (what, row)
    assert "row remap" in row["message"]


def test_fit_reads_the_h200s_memory_total(tmp_path, monkeypatch):
    """`llmfleet fit` sizes against nvidia-smi's memory.total; the H200 printed 143771 (MiB), NVML 150754820096
    bytes: the same figure."""
    nvml = json.loads((FIX / "nvml.json").read_text())
    assert fit.gpu_memory_from_smi((FIX / "nvidia-smi-memory-total.csv").read_text()) == nvml["gpus"][0]["memory_total"]
    fake_nvidia_smi(tmp_path / "bin", "")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    args = fit_cli.argparse.Namespace(gpu_memory_gib=None)
    assert fit_cli._gpu_memory(args) == 150754820096


def test_topology_of_the_one_gpu_vm_from_its_captured_sysfs(tmp_path):
    """The VM's GPU reports numa_node -1 in sysfs and NVML has no NUMA id (NotSupported): with one NUMA node it is
    that node; no HCA, so the socket fallback on the fabric IP's interface, said as a warning."""
    from tests.helpers.fakesys import FakeSys

    sysfs = json.loads((FIX / "sysfs-gpu.json").read_text())
    nvml = json.loads((FIX / "nvml.json").read_text())
    assert nvml["gpus"][0]["numa"].startswith("<NVMLError_NotSupported")
    bdf, dev = next((k, v) for k, v in sysfs.items() if k.startswith("0000:"))
    assert sysfs["/sys/class/infiniband"] == [] and [n for n in sysfs["/sys/devices/system/node"] if n.startswith("node")] == ["node0"]  # fmt: skip
    fs = FakeSys(tmp_path)
    fs.numa(0, dev["local_cpulist"])
    fs.pci(dev["realpath"].split("/")[3:], dev["vendor"], dev["class"], int(dev["numa_node"]), dev["local_cpulist"],
           device=dev["device"])  # fmt: skip
    fs.netdev("lo", None)
    topo = topology.discover(str(tmp_path), node_ip="127.0.0.1", addresses={"lo": ["127.0.0.1"]}, use_nvml=False)
    g = topo["gpus"][0]
    assert g["bdf"] == bdf and g["numa_node"] == 0 and g["numa_source"] == "single NUMA node"
    assert g["cpus"] == list(range(16))
    env = topology.fabric_env(topo)
    assert env["env"]["NCCL_IB_DISABLE"] == "1" and env["socket_ifname"] == "lo"
    assert any("TCP sockets (lo)" in w for w in env["warnings"])
    assert topology.parse_topo_matrix((FIX / "nvidia-smi-topo-m.txt").read_text()) == {"GPU0": {"GPU0": "X"}}


DEVICE_HOSTS = """all:
  children:
    llmfleet_nodes:
      children:
        head:
          hosts:
            vm:
              llmfleet_fabric_ip: 127.0.0.1
"""


def ansible_env(tmp_path) -> dict:
    return {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_ROLES_PATH": str(ROOT / "roles"), "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"),
            "ANSIBLE_HOME": str(tmp_path / "home")}  # fmt: skip


def test_device_inventory_parses_as_one_local_head(tmp_path):
    inv = tmp_path / "device-h200"
    shutil.copytree(ROOT / "inventory/device-h200", inv)
    (inv / "hosts.yml").write_text(DEVICE_HOSTS)  # what site_local.sh writes there
    bindir = os.path.dirname(sys.executable)
    cp = subprocess.run([f"{bindir}/ansible-inventory", "-i", str(inv), "--host", "vm"],
                        capture_output=True, text=True, check=False, timeout=120, env=ansible_env(tmp_path))  # fmt: skip
    assert cp.returncode == 0 and "WARNING" not in cp.stderr, cp.stderr
    hv = json.loads(cp.stdout)
    assert hv["ansible_connection"] == "local" and hv["ansible_become"] is False
    assert (hv["llmfleet_gpus_per_node"], hv["llmfleet_tp_size"], hv["llmfleet_pp_size"]) == (1, 1, 1)


@pytest.mark.skipif(os.path.isdir("/run/systemd/system"), reason="this host runs systemd as PID 1")
def test_serving_guard_on_a_host_without_systemd(tmp_path):
    """The lent GPU machine (like this one, and containers) has no systemd as PID 1: systemctl there fails
    ("System has not been booted with systemd") or is absent, and preflight stopped on it. No llmfleet unit can
    be serving there, so the guard says why it reads none and lets the step go on."""
    inv = tmp_path / "hosts.yml"
    inv.write_text(DEVICE_HOSTS.replace("127.0.0.1\n", f"127.0.0.1\n              ansible_connection: local\n"
                                        f"              ansible_python_interpreter: {sys.executable}\n"))  # fmt: skip
    play = tmp_path / "guard.yml"
    play.write_text(
        "- hosts: llmfleet_nodes\n  gather_facts: false\n  tasks:\n"
        "    - ansible.builtin.include_role:\n        name: llmfleet\n        tasks_from: not_serving.yml\n"
        "      vars:\n        _llmfleet_guard_step: the test would probe\n        _llmfleet_guard_tag: test\n"
    )
    bindir = os.path.dirname(sys.executable)
    cp = subprocess.run([f"{bindir}/ansible-playbook", "-i", str(inv), str(play)],
                        capture_output=True, text=True, check=False, timeout=300, env=ansible_env(tmp_path))  # fmt: skip
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-2000:]
    assert "systemd is not PID 1 here" in cp.stdout
