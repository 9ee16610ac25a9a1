"""Topology discovery on fake sysfs trees (real symlink structure) and the fabric env it yields."""

import pytest

from llmfleet.checks import topology
from tests.helpers.fakesys import dgx_h100_ib, hgx_h20, single_gpu_vm

RAILS_A = [f"10.10.{n}.11" for n in range(8)]
RAILS_B = [f"10.10.{n}.12" for n in range(8)]
ALL8 = ",".join(f"mlx5_{n}:1" for n in range(8))


def addrs(ips, mgmt=None):
    a = {f"ens{n}np0": [ip] for n, ip in enumerate(ips)}
    if mgmt:
        a["bond0"] = [mgmt]
    return a


def env_for(tmp_path, build, node_ip, addresses, overrides=None):
    build(tmp_path)
    topo = topology.discover(str(tmp_path), node_ip=node_ip, addresses=addresses, use_nvml=False)
    return topo, topology.fabric_env(topo, overrides)


CASES = [
    (
        "HGX H20, RoCE v2 IPv4 GID at 3 (node A)",
        lambda r: hgx_h20(r, RAILS_A, mgmt_ip="10.0.0.11"), "10.0.0.11", addrs(RAILS_A, "10.0.0.11"),
        {"NCCL_IB_HCA": "=" + ALL8, "NCCL_IB_GID_INDEX": "3", "NCCL_SOCKET_IFNAME": "=bond0", "GLOO_SOCKET_IFNAME": "bond0",
         "UCX_NET_DEVICES": ALL8, "SGLANG_HOST_IP": "10.0.0.11", "VLLM_HOST_IP": "10.0.0.11"},
        [],
    ),
    (
        "HGX H20, a global IPv6 pushed the IPv4 GID to 5 (node B)",
        lambda r: hgx_h20(r, RAILS_B, extra_v6=1, mgmt_ip="10.0.0.12"), "10.0.0.12", addrs(RAILS_B, "10.0.0.12"),
        {"NCCL_IB_HCA": "=" + ALL8, "NCCL_IB_GID_INDEX": "5", "NCCL_SOCKET_IFNAME": "=bond0", "GLOO_SOCKET_IFNAME": "bond0",
         "UCX_NET_DEVICES": ALL8, "SGLANG_HOST_IP": "10.0.0.12", "VLLM_HOST_IP": "10.0.0.12"},
        [],
    ),
    (
        "DGX H100, 8 InfiniBand rails + 2 storage HCAs (left out): no GID index",
        dgx_h100_ib, None, {"enp170s0f0": ["10.0.0.21"]},
        {"NCCL_IB_HCA": "=" + ALL8, "UCX_NET_DEVICES": ALL8},
        [],
    ),
    (
        "HGX H20 with mlx5_3 DOWN",
        lambda r: hgx_h20(r, RAILS_A, down={"mlx5_3"}, mgmt_ip="10.0.0.11"), "10.0.0.11", addrs(RAILS_A, "10.0.0.11"),
        {"NCCL_IB_HCA": "=" + ",".join(f"mlx5_{n}:1" for n in range(8) if n != 3), "NCCL_IB_GID_INDEX": "3",
         "NCCL_SOCKET_IFNAME": "=bond0", "GLOO_SOCKET_IFNAME": "bond0",
         "UCX_NET_DEVICES": ",".join(f"mlx5_{n}:1" for n in range(8) if n != 3),
         "SGLANG_HOST_IP": "10.0.0.11", "VLLM_HOST_IP": "10.0.0.11"},
        ["mlx5_3:1 (DOWN/Disabled)"],
    ),
    (
        "single-GPU VM without HCA: socket fallback",
        single_gpu_vm, "192.168.1.5", {"eth0": ["192.168.1.5"], "lo": ["127.0.0.1"]},
        {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "=eth0", "GLOO_SOCKET_IFNAME": "eth0", "UCX_NET_DEVICES": "eth0",
         "SGLANG_HOST_IP": "192.168.1.5", "VLLM_HOST_IP": "192.168.1.5"},
        ["NCCL_IB_DISABLE=1"],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("label", "build", "ip", "addresses", "env", "warn"), CASES, ids=[c[0] for c in CASES])
def test_env_per_tree(tmp_path, label, build, ip, addresses, env, warn):
    _, out = env_for(tmp_path, build, ip, addresses)
    assert out["env"] == env, label
    for w in warn:
        assert any(w in x for x in out["warnings"]), out["warnings"]
    if not warn:
        assert out["warnings"] == []


def test_roce_port_without_v2_ipv4_gid_is_a_clear_error(tmp_path):
    with pytest.raises(topology.TopologyError, match=r"mlx5_2:1 have no RoCE v2 GID carrying an IPv4"):
        env_for(tmp_path, lambda r: hgx_h20(r, RAILS_A, no_v4_gid={"mlx5_2"}, mgmt_ip="10.0.0.11"), "10.0.0.11",
                addrs(RAILS_A, "10.0.0.11"))  # fmt: skip


def test_ports_disagreeing_on_gid_index_use_nccl_selection(tmp_path):
    hgx_h20(tmp_path, RAILS_A, mgmt_ip="10.0.0.11")
    topo = topology.discover(str(tmp_path), node_ip="10.0.0.11", addresses=addrs(RAILS_A, "10.0.0.11"), use_nvml=False)
    topo["hcas"][5]["ports"][1]["roce_v2_gid"] = 5  # one port's IPv4 GID moved
    out = topology.fabric_env(topo)
    assert "NCCL_IB_GID_INDEX" not in out["env"]
    assert out["env"]["NCCL_IB_ADDR_FAMILY"] == "AF_INET" and out["env"]["NCCL_IB_ROCE_VERSION_NUM"] == "2"
    assert "mlx5_5:1=5" in out["warnings"][0] and "mlx5_0:1=3" in out["warnings"][0]


def test_fabric_ip_on_no_interface_is_an_error(tmp_path):
    with pytest.raises(topology.TopologyError, match=r"no interface carries the fabric IP 10\.9\.9\.9"):
        env_for(tmp_path, single_gpu_vm, "10.9.9.9", {"eth0": ["192.168.1.5"], "lo": ["127.0.0.1"]})


def test_gpu_affinity_numa_and_cpus(tmp_path):
    topo, _ = env_for(
        tmp_path, lambda r: hgx_h20(r, RAILS_A, mgmt_ip="10.0.0.11"), "10.0.0.11", addrs(RAILS_A, "10.0.0.11")
    )
    g = topo["gpus"]
    assert [x["index"] for x in g] == list(range(8))
    assert [x["numa_node"] for x in g] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert g[5]["cpus"][:2] == [48, 49] and len(g[5]["cpus"]) == 96
    # GPU0/GPU1 share a switch with the dual-port card mlx5_0/mlx5_1: each takes one function
    assert [x["hca"] for x in g] == [f"mlx5_{n}" for n in range(8)]
    lv = {x["hca"]: x["level"] for x in g[0]["nearest_hcas"]}
    assert lv["mlx5_0"] == lv["mlx5_1"] == "PIX" and lv["mlx5_2"] == "NODE" and lv["mlx5_7"] == "SYS"


def test_dgx_levels_match_recorded_nvidia_smi_topo(tmp_path):
    from pathlib import Path

    text = (Path(__file__).parent / "fixtures/nvidia-smi-topo-dgx-h100.txt").read_text()
    matrix = topology.parse_topo_matrix(text)
    legend = topology.parse_topo_nic_legend(text)
    assert matrix["GPU0"]["GPU1"] == "NV18" and matrix["GPU0"]["NIC0"] == "PXB" and matrix["GPU7"]["NIC0"] == "SYS"
    assert matrix["NIC8"]["NIC9"] == "PIX" and legend["NIC9"] == "mlx5_9" and len(matrix) == 18
    topo, _ = env_for(tmp_path, dgx_h100_ib, None, {"enp170s0f0": ["10.0.0.21"]})
    assert topology.crosscheck(topo, matrix, legend) == []
    topo["gpus"][0]["nearest_hcas"][0]["level"] = "PIX"  # a wrong derivation is caught
    assert topology.crosscheck(topo, matrix, legend) == ["GPU0-mlx5_0: sysfs PIX, nvidia-smi PXB"]


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"NCCL_IB_HCA": "=mlx5_9:1"}, "mlx5_9:1 does not exist"),
        ({"NCCL_IB_HCA": "mlx5_3:1"}, "mlx5_3:1 is DOWN"),
        ({"NCCL_IB_GID_INDEX": "1"}, "that index is RoCE v2 fe80"),
        ({"NCCL_SOCKET_IFNAME": "=eth7"}, "no interface 'eth7'"),
    ],
)
def test_overrides_are_validated_against_what_exists(tmp_path, overrides, error):
    with pytest.raises(topology.TopologyError, match=error):
        env_for(tmp_path, lambda r: hgx_h20(r, RAILS_A, down={"mlx5_3"}, mgmt_ip="10.0.0.11"), "10.0.0.11",
                addrs(RAILS_A, "10.0.0.11"), overrides)  # fmt: skip


MALFORMED = [
    # (overrides, extra_env, error): each used to raise a bare ValueError, or to write a broken env file
    ({"NCCL_IB_GID_INDEX": "three"}, {}, "override NCCL_IB_GID_INDEX=three: not a GID table index"),
    ({"NCCL_IB_GID_INDEX": "-1"}, {}, "not a GID table index"),
    ({"NCCL_IB_GID_INDEX": " 3"}, {}, "not a GID table index"),
    ({"NCCL_IB_HCA": "mlx5_0:one"}, {}, r"'mlx5_0:one' is not HCA\[:PORT\]"),
    ({"NCCL_IB_HCA": "=mlx5_0:1,:1"}, {}, r"':1' is not HCA\[:PORT\]"),
    ({"": "x"}, {}, "override '': not an environment variable name"),
    ({"NCCL DEBUG": "INFO"}, {}, "override 'NCCL DEBUG': not an environment variable name"),
    ({"NCCL_DEBUG": "INFO\nLD_PRELOAD=/tmp/x.so"}, {}, "override NCCL_DEBUG: the value holds a line break"),
    ({}, {"1BAD": "0"}, "extra variable '1BAD': not an environment variable name"),
    ({}, {"NCCL_NVLS_ENABLE": "0\n"}, "extra variable NCCL_NVLS_ENABLE: the value holds a line break"),
]


@pytest.mark.parametrize(("overrides", "extra", "error"), MALFORMED)
def test_malformed_overrides_are_bad_input(tmp_path, overrides, extra, error):
    hgx_h20(tmp_path, RAILS_A, mgmt_ip="10.0.0.11")
    with pytest.raises(topology.OverrideError, match=error):
        topology.report(str(tmp_path), node_ip="10.0.0.11", overrides=overrides, extra_env=extra, use_nvml=False,
                        addresses=addrs(RAILS_A, "10.0.0.11"))  # fmt: skip
    # also on a node without RoCE ports, where the GID index used to pass through unchecked
    with pytest.raises(topology.OverrideError, match=error):
        topology.report(str(tmp_path / "empty"), overrides=overrides, extra_env=extra, use_nvml=False, addresses={})


def test_override_errors_are_override_errors(tmp_path):
    """Overrides naming what is not on the node are the caller's input (CLI exit 2), still TopologyErrors."""
    with pytest.raises(topology.OverrideError, match="mlx5_9:1 does not exist"):
        env_for(tmp_path, lambda r: hgx_h20(r, RAILS_A, mgmt_ip="10.0.0.11"), "10.0.0.11", addrs(RAILS_A, "10.0.0.11"),
                {"NCCL_IB_HCA": "mlx5_9"})  # fmt: skip
    assert issubclass(topology.OverrideError, topology.TopologyError)


def test_valid_overrides_win(tmp_path):
    _, out = env_for(tmp_path, lambda r: hgx_h20(r, RAILS_A, mgmt_ip="10.0.0.11"), "10.0.0.11", addrs(RAILS_A, "10.0.0.11"),
                     {"NCCL_IB_HCA": "mlx5_1:1,mlx5_0", "NCCL_IB_GID_INDEX": "3", "NCCL_CROSS_NIC": "0"})  # fmt: skip
    assert out["env"]["NCCL_IB_HCA"] == "=mlx5_1:1,mlx5_0:1"
    assert out["env"]["NCCL_IB_GID_INDEX"] == "3" and out["env"]["NCCL_CROSS_NIC"] == "0"


@pytest.mark.parametrize(
    ("text", "cpus"), [("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11]), ("", []), ("5", [5]), ("0-1\n", [0, 1])]
)
def test_parse_cpulist(text, cpus):
    assert topology.parse_cpulist(text) == cpus


@pytest.mark.parametrize(
    ("gid", "ip"),
    [
        ("0000:0000:0000:0000:0000:ffff:0a0a:000b", "10.10.0.11"),
        ("fe80:0000:0000:0000:0e42:a1ff:fe00:0001", None),
        ("0000:0000:0000:0000:0000:0000:0000:0000", None),
        ("2001:0db8:0000:0000:0000:0000:0000:0001", None),
        ("garbage", None),
    ],
)
def test_gid_ipv4(gid, ip):
    assert topology.gid_ipv4(gid) == ip


def test_cli_on_a_fake_tree(tmp_path):
    import json
    import subprocess
    import sys

    hgx_h20(tmp_path, RAILS_A, extra_v6=1)
    base = [sys.executable, "-m", "llmfleet", "topology", "--sysfs-root", str(tmp_path), "--no-nvml"]
    # no netdev carries the rail IPs in this process's namespace, and no fabric IP: the GID cannot be chosen
    cp = subprocess.run([*base, "--json"], capture_output=True, text=True, check=False)
    assert cp.returncode == 1 and "no RoCE v2 GID carrying an IPv4" in cp.stderr
    # single-rail style: one fabric IP and a port whose GID carries it
    tree = tmp_path / "one"
    from tests.helpers.fakesys import FakeSys, roce_gids

    fs = FakeSys(tree)
    fs.numa(0, "0-7")
    fs.gpu(["pci0000:00", "0000:00:01.0", "0000:01:00.0"], 0, "0-7")
    fs.hca("mlx5_0", ["pci0000:00", "0000:00:02.0", "0000:02:00.0"], 0, "0-7", "ens1",
           {1: {"gids": roce_gids("ens1", "10.1.1.1", extra_v6=1)}})  # fmt: skip
    cp = subprocess.run([sys.executable, "-m", "llmfleet", "topology", "--sysfs-root", str(tree), "--no-nvml",
                         "--node-ip", "10.1.1.1", "--json"], capture_output=True, text=True, check=False)  # fmt: skip
    assert cp.returncode == 1 and "no interface carries the fabric IP 10.1.1.1" in cp.stderr  # ens1 has no IP here
    cp = subprocess.run([sys.executable, "-m", "llmfleet", "topology", "--sysfs-root", str(tree), "--no-nvml",
                         "--node-ip", "10.1.1.1", "--address", "ens1=10.1.1.1", "--json"],
                        capture_output=True, text=True, check=False)  # fmt: skip
    assert cp.returncode == 0, cp.stderr
    env = json.loads(cp.stdout)["env"]
    assert (
        env["NCCL_IB_HCA"] == "=mlx5_0:1" and env["NCCL_IB_GID_INDEX"] == "5" and env["NCCL_SOCKET_IFNAME"] == "=ens1"
    )
    txt = subprocess.run([*base[:-1], "--sysfs-root", str(tree), "--node-ip", "10.1.1.1", "--address", "ens1=10.1.1.1"],
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert "NCCL_IB_GID_INDEX=5" in txt.stdout.splitlines() and "GPU0 0000:01:00.0" in txt.stdout


def test_parse_recorded_h200x2_topo():
    """Recorded on the lent 2x H200 machine (docs/measurements/device-runs/2026-11-29-h200x2-topology)."""
    from pathlib import Path

    text = (Path(__file__).parent / "fixtures/nvidia-smi-topo-h200x2.txt").read_text()
    assert topology.parse_topo_matrix(text) == {
        "GPU0": {"GPU0": "X", "GPU1": "NV18"},
        "GPU1": {"GPU0": "NV18", "GPU1": "X"},
    }
    assert topology.parse_topo_nic_legend(text) == {}


def test_vm_numa_minus_one_with_one_numa_node(tmp_path):
    fs = single_gpu_vm(tmp_path)  # numa_node -1 in sysfs, like the lent H200 VM
    assert fs
    topo = topology.discover(str(tmp_path), node_ip="192.168.1.5", addresses={"eth0": ["192.168.1.5"]}, use_nvml=False)
    assert topo["gpus"][0]["numa_node"] == 0 and topo["gpus"][0]["numa_source"] == "single NUMA node"
    assert topo["gpus"][0]["cpus"] == list(range(16))
