"""NCCL_IB_HCA (and UCX_NET_DEVICES, ib_ports) list the GPU rails only: HCAs that share a PCIe switch
or root complex with a GPU. Storage and management HCAs are left out and reported, and never make
discovery fail."""

import pytest

from llmfleet.checks import topology
from tests.helpers.fakesys import FakeSys, dgx_h100_ib, hgx_roce_lag, link_local_gids, roce_gids

RAILS = [f"10.10.{n}.31" for n in range(8)]
NODE_IP = "10.0.0.31"
ALL8 = ",".join(f"mlx5_{n}:1" for n in range(8))
IB = {1: {"link_layer": "InfiniBand", "gids": [("fe80:0000:0000:0000:a088:c203:0001:0001", "", "")]}}
DOWN_IB = {1: {**IB[1], "state": "1: DOWN", "phys_state": "3: Disabled"}}


def lag_addrs(ips=RAILS, node_ip=NODE_IP):
    return {**{f"ens{n}np0": [ip] for n, ip in enumerate(ips)}, "bond0": [node_ip]}


def run(root, node_ip=None, addresses=None, overrides=None):
    topo = topology.discover(str(root), node_ip=node_ip, addresses=addresses or {}, use_nvml=False)
    return topo, topology.fabric_env(topo, overrides)


def non_rails(topo):
    return {x["hca"]: x["reason"] for x in topo["non_rail_hcas"]}


# ---- the two layouts of the issue ----------------------------------------------------------------------


@pytest.mark.parametrize("storage_link", ["InfiniBand", "Ethernet"])
def test_dgx_h100_storage_hcas_are_not_rails(tmp_path, storage_link):
    """Ethernet: the storage ports are RoCE without an IPv4 (no usable GID) - that must not fail either."""
    dgx_h100_ib(tmp_path, storage_link=storage_link)
    topo, out = run(tmp_path, addresses={"enp170s0f0": ["10.0.0.21"]})
    assert out["env"] == {"NCCL_IB_HCA": "=" + ALL8, "UCX_NET_DEVICES": ALL8}
    assert out["ib_ports"] == ALL8.split(",") and out["warnings"] == []
    assert topo["rails"] == [f"mlx5_{n}" for n in range(8)] and topo["rail_rule"] == "pcie-affinity"
    why = non_rails(topo)
    assert sorted(why) == ["mlx5_8", "mlx5_9"]
    assert "no GPU on its PCIe switch or root complex pci0000:a0" in why["mlx5_8"] and "GPU0 NODE" in why["mlx5_8"]
    assert [h["rail"] for h in topo["hcas"]] == [True] * 8 + [False] * 2
    assert topo["hcas"][0]["affinity"] == {"gpu": 0, "level": "PXB"}
    # the per-GPU nearest rail stays for the engine
    assert [g["hca"] for g in topo["gpus"]] == [f"mlx5_{n}" for n in range(8)]
    assert topo["gpus"][0]["nearest_hcas"][0] == {"hca": "mlx5_0", "level": "PXB"}


@pytest.mark.parametrize("bond_ipv4_gid", [True, False], ids=["bond-gid-at-5", "bond-without-ipv4-gid"])
def test_roce_lag_storage_on_bond0_carrying_the_node_ip(tmp_path, bond_ipv4_gid):
    hgx_roce_lag(tmp_path, RAILS, NODE_IP, bond_ipv4_gid=bond_ipv4_gid)
    topo, out = run(tmp_path, NODE_IP, lag_addrs())
    assert out["env"] == {
        "NCCL_IB_HCA": "=" + ALL8, "UCX_NET_DEVICES": ALL8, "NCCL_IB_GID_INDEX": "3",
        "NCCL_SOCKET_IFNAME": "=bond0", "GLOO_SOCKET_IFNAME": "bond0",
        "SGLANG_HOST_IP": NODE_IP, "VLLM_HOST_IP": NODE_IP,
    }  # fmt: skip
    assert out["warnings"] == []
    assert topo["rails"] == [f"mlx5_{n}" for n in range(8)]
    assert list(non_rails(topo)) == ["mlx5_bond_0"]
    assert "root complex pci0000:c0" in non_rails(topo)["mlx5_bond_0"]
    by = {h["name"]: h for h in topo["hcas"]}
    for n in range(8):  # each rail's GID is the RoCE v2 one of its own netdev
        p = by[f"mlx5_{n}"]["ports"][1]
        g = p["gids"][p["roce_v2_gid"]]
        assert (g["ndev"], g["type"], g["ipv4"]) == (f"ens{n}np0", "RoCE v2", RAILS[n])
    bond = by["mlx5_bond_0"]
    # the LAG's device is the first slave's PCI function; its GIDs name the bond, found through master
    assert bond["bdf"] == "0000:c1:00.0" and bond["netdevs"] == ["ens10f0np0"] and bond["upper_netdevs"] == ["bond0"]
    assert bond["ports"][1]["roce_v2_gid"] == (5 if bond_ipv4_gid else None)
    nets = {n["name"]: n for n in topo["netdevs"]}
    assert nets["bond0"]["slaves"] == ["ens10f0np0", "ens10f1np1"] and nets["ens10f1np1"]["master"] == "bond0"
    assert nets["ens0np0"]["master"] is None and nets["ens0np0"]["pci"] == "0000:15:00.0"


def test_roce_lag_gpu_rail_pairs(tmp_path):
    hgx_roce_lag(tmp_path, RAILS, NODE_IP)
    topo, _ = run(tmp_path, NODE_IP, lag_addrs())
    assert [g["hca"] for g in topo["gpus"]] == [f"mlx5_{n}" for n in range(8)]
    lv = {x["hca"]: x["level"] for x in topo["gpus"][0]["nearest_hcas"]}
    assert lv["mlx5_0"] == lv["mlx5_1"] == "PIX" and lv["mlx5_2"] == "NODE" and lv["mlx5_bond_0"] == "SYS"


def test_module_reports_rails_and_the_rest(module_exits, tmp_path):
    import llmfleet_topology_facts
    from tests.unit.module_utils import AnsibleExitJson, set_module_args

    hgx_roce_lag(tmp_path, RAILS, NODE_IP)
    # the module reads addresses with SIOCGIFADDR: none of these interfaces exist here, so no node IP
    with set_module_args({"sysfs_root": str(tmp_path), "use_nvml": False, "overrides": {"NCCL_IB_GID_INDEX": "3"}}):
        with pytest.raises(AnsibleExitJson) as e:
            llmfleet_topology_facts.main()
    facts = e.value.args[0]["ansible_facts"]["llmfleet_topology"]
    assert facts["ib_ports"] == ALL8.split(",") and facts["env"]["NCCL_IB_HCA"] == "=" + ALL8
    assert facts["rails"] == [f"mlx5_{n}" for n in range(8)] and facts["rail_rule"] == "pcie-affinity"
    assert [x["hca"] for x in facts["non_rail_hcas"]] == ["mlx5_bond_0"]


# ---- the rule's edges ------------------------------------------------------------------------------------


def two_root_complexes(root, rail_chain, second_gpu_rc=False):
    """GPU0 behind a switch on pci0000:10; mlx5_0 at rail_chain; mlx5_1 on pci0000:20 (no GPU, or GPU1
    with second_gpu_rc); all InfiniBand."""
    fs = FakeSys(root)
    fs.numa(0, "0-31")
    fs.gpu(["pci0000:10", "0000:10:01.0", "0000:11:00.0", "0000:12:00.0", "0000:13:00.0"], 0, "0-31")
    fs.hca("mlx5_0", rail_chain, 0, "0-31", None, IB)
    if second_gpu_rc:
        fs.gpu(["pci0000:30", "0000:30:01.0", "0000:31:00.0"], 0, "0-31")
    fs.hca("mlx5_1", ["pci0000:20", "0000:20:01.0", "0000:21:00.0"], 0, "0-31", None, IB)
    return fs


@pytest.mark.parametrize(
    ("chain", "level"),
    [
        (["pci0000:10", "0000:10:01.0", "0000:11:00.0", "0000:12:01.0", "0000:14:00.0"], "PIX"),
        (["pci0000:10", "0000:10:03.0", "0000:15:00.0"], "PHB"),  # another root port of the GPU's root complex
        # behind another switch than the GPU's
        (["pci0000:10", "0000:10:03.0", "0000:15:00.0", "0000:16:00.0", "0000:17:00.0"], "PHB"),
    ],
    ids=["same-switch", "same-root-complex", "other-switch-same-root-complex"],
)
def test_rail_by_switch_or_root_complex(tmp_path, chain, level):
    two_root_complexes(tmp_path, chain)
    topo, out = run(tmp_path)
    assert out["env"]["NCCL_IB_HCA"] == "=mlx5_0:1" and out["warnings"] == []
    assert topo["hcas"][0]["affinity"] == {"gpu": 0, "level": level}
    assert "no GPU on its PCIe switch or root complex pci0000:20" in non_rails(topo)["mlx5_1"]


def test_gpu_without_a_rail_of_its_own_is_a_warning(tmp_path):
    two_root_complexes(tmp_path, ["pci0000:10", "0000:10:03.0", "0000:15:00.0"], second_gpu_rc=True)
    topo, out = run(tmp_path)
    assert out["env"]["NCCL_IB_HCA"] == "=mlx5_0:1"
    assert [g["hca"] for g in topo["gpus"]] == ["mlx5_0", "mlx5_0"]
    assert len(out["warnings"]) == 1
    assert "GPU1 (0000:31:00.0) has no rail on its PCIe switch or root complex" in out["warnings"][0]


def no_affinity(root, gpus=True):
    """GPUs (if any) on pci0000:10; IB HCAs mlx5_0/mlx5_1 on their own root complexes; a RoCE HCA mlx5_2 on
    eno1 carrying the node IP; a RoCE HCA mlx5_3 on eno2 without an IPv4 (no usable GID)."""
    fs = FakeSys(root)
    fs.numa(0, "0-31")
    if gpus:
        fs.gpu(["pci0000:10", "0000:10:01.0", "0000:11:00.0"], 0, "0-31")
    for n in range(2):
        fs.hca(f"mlx5_{n}", [f"pci0000:{0x20 + n * 0x10:02x}", f"0000:{0x20 + n * 0x10:02x}:01.0",
                             f"0000:{0x21 + n * 0x10:02x}:00.0"], 0, "0-31", None, IB)  # fmt: skip
    fs.hca("mlx5_2", ["pci0000:40", "0000:40:01.0", "0000:41:00.0"], 0, "0-31", "eno1",
           {1: {"gids": roce_gids("eno1", "10.0.0.7", extra_v6=1)}})  # fmt: skip
    fs.hca("mlx5_3", ["pci0000:40", "0000:40:01.0", "0000:41:00.1"], 0, "0-31", "eno2",
           {1: {"gids": link_local_gids("eno2")}})  # fmt: skip
    return fs


@pytest.mark.parametrize("gpus", [True, False], ids=["gpu-on-no-hca-root-complex", "no-gpu"])
def test_no_gpu_hca_affinity_takes_every_hca_but_the_front_end_and_warns(tmp_path, gpus):
    no_affinity(tmp_path, gpus=gpus)
    topo, out = run(tmp_path, "10.0.0.7", {"eno1": ["10.0.0.7"]})
    assert out["env"]["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1" and "NCCL_IB_GID_INDEX" not in out["env"]
    assert topo["rail_rule"] == ("no-affinity" if gpus else "no-gpu")
    why = non_rails(topo)
    assert "carries the node IP 10.0.0.7 (eno1)" in why["mlx5_2"]
    assert "no RoCE v2 GID carrying an IPv4 of its netdev" in why["mlx5_3"]
    assert len(out["warnings"]) == 1
    w = out["warnings"][0]
    assert "NCCL_IB_HCA takes every HCA but mlx5_2, mlx5_3" in w and "topology_overrides" in w
    assert ("no GPU shares a PCIe switch or root complex with any HCA" if gpus else "no GPU found") in w


def test_no_affinity_and_only_the_front_end_hca_uses_it(tmp_path):
    """A one-NIC node: the HCA carrying the node IP is all there is, so it carries NCCL too."""
    fs = FakeSys(tmp_path)
    fs.numa(0, "0-31")
    fs.gpu(["pci0000:10", "0000:10:01.0", "0000:11:00.0"], 0, "0-31")
    fs.hca("mlx5_0", ["pci0000:40", "0000:40:01.0", "0000:41:00.0"], 0, "0-31", "eno1",
           {1: {"gids": roce_gids("eno1", "10.0.0.7")}})  # fmt: skip
    topo, out = run(tmp_path, "10.0.0.7", {"eno1": ["10.0.0.7"]})
    assert out["env"]["NCCL_IB_HCA"] == "=mlx5_0:1" and out["env"]["NCCL_IB_GID_INDEX"] == "3"
    assert topo["non_rail_hcas"] == [] and "every HCA" in out["warnings"][0]


def test_fallback_roce_hcas_all_without_gid_still_fail_clearly(tmp_path):
    """Without affinity, dropping every candidate for lack of a GID would silently turn IB off: fail."""
    fs = FakeSys(tmp_path)
    fs.numa(0, "0-31")
    fs.gpu(["pci0000:10", "0000:10:01.0", "0000:11:00.0"], 0, "0-31")
    fs.hca("mlx5_0", ["pci0000:40", "0000:40:01.0", "0000:41:00.0"], 0, "0-31", "eno2",
           {1: {"gids": link_local_gids("eno2")}})  # fmt: skip
    with pytest.raises(topology.TopologyError, match="mlx5_0:1 have no RoCE v2 GID carrying an IPv4"):
        run(tmp_path)


def test_rail_without_gid_still_fails_naming_it(tmp_path):
    hgx_roce_lag(tmp_path, RAILS, NODE_IP)
    gid3 = tmp_path / "class/infiniband/mlx5_4/ports/1/gids/3"
    gid3.resolve().write_text("0000:0000:0000:0000:0000:0000:0000:0000\n")
    with pytest.raises(topology.TopologyError, match=r"RoCE port\(s\) mlx5_4:1 have no RoCE v2 GID"):
        run(tmp_path, NODE_IP, lag_addrs())


def test_gid_of_another_netdev_is_not_the_rails(tmp_path):
    """A GID carrying a rail's IPv4 but created for another netdev (e.g. a macvlan) is not the rail's."""
    hgx_roce_lag(tmp_path, RAILS, NODE_IP)
    ndev3 = (tmp_path / "class/infiniband/mlx5_0/ports/1/gid_attrs/ndevs/3").resolve()
    ndev3.write_text("mv0\n")
    with pytest.raises(topology.TopologyError, match=r"mlx5_0:1 have no RoCE v2 GID"):
        run(tmp_path, NODE_IP, lag_addrs())


def test_non_rail_ports_down_are_not_warned_about(tmp_path):
    fs = dgx_h100_ib(tmp_path)
    assert fs
    for f in (8, 9):
        (tmp_path / f"class/infiniband/mlx5_{f}/ports/1/state").resolve().write_text("1: DOWN\n")
    _, out = run(tmp_path)
    assert out["env"]["NCCL_IB_HCA"] == "=" + ALL8 and out["warnings"] == []


def test_all_rails_down_never_falls_back_to_storage(tmp_path):
    dgx_h100_ib(tmp_path)
    for n in range(8):
        (tmp_path / f"class/infiniband/mlx5_{n}/ports/1/state").resolve().write_text("1: DOWN\n")
    topo, out = run(tmp_path)
    assert out["env"] == {"NCCL_IB_DISABLE": "1"} and out["ib_ports"] == []
    assert any("NCCL_IB_DISABLE=1" in w and "no rail port is ACTIVE" in w for w in out["warnings"])
    assert [g.get("hca") for g in topo["gpus"]] == [None] * 8


def test_override_may_name_a_non_rail_with_a_warning(tmp_path):
    dgx_h100_ib(tmp_path)
    _, out = run(tmp_path, overrides={"NCCL_IB_HCA": "=mlx5_0:1,mlx5_8:1"})
    assert out["env"]["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_8:1"
    assert len(out["warnings"]) == 1 and "mlx5_8 is not a rail (no GPU on its PCIe switch" in out["warnings"][0]


def test_hca_without_pci_device_is_not_a_rail(tmp_path):
    """Soft-RoCE (rxe) and other virtual devices have no PCI function to have affinity with."""
    two_root_complexes(tmp_path, ["pci0000:10", "0000:10:03.0", "0000:15:00.0"])
    d = tmp_path / "devices/virtual/infiniband/rxe0"
    (d / "ports/1").mkdir(parents=True)
    (d / "ports/1/state").write_text("4: ACTIVE\n")
    (d / "ports/1/link_layer").write_text("Ethernet\n")
    (tmp_path / "class/infiniband/rxe0").symlink_to("../../devices/virtual/infiniband/rxe0")
    topo, out = run(tmp_path)
    assert out["env"]["NCCL_IB_HCA"] == "=mlx5_0:1"
    assert non_rails(topo)["rxe0"] == "not a PCI device (software RDMA or virtual)"


def test_fabric_env_file_names_the_non_rails(tmp_path):
    """The role's template (Ansible renders with trim_blocks): non-rails are comments, the env is the rails."""
    from pathlib import Path

    import jinja2

    hgx_roce_lag(tmp_path, RAILS, NODE_IP)
    topo, out = run(tmp_path, NODE_IP, lag_addrs())
    src = Path(__file__).parents[2] / "roles/topology/templates/etc/llmfleet/fabric.env.j2"
    env = jinja2.Environment(trim_blocks=True, keep_trailing_newline=True)  # noqa: S701 (an env file, not HTML)
    env.filters["comment"] = lambda s: f"# {s}"
    facts = {"llmfleet_topology": {**out, "non_rail_hcas": topo["non_rail_hcas"]}}
    text = env.from_string(src.read_text()).render(
        ansible_managed="managed", inventory_hostname="n1", llmfleet_fabric_ip=NODE_IP, ansible_facts=facts
    )
    lines = text.splitlines()
    why = "no GPU on its PCIe switch or root complex pci0000:c0 (nearest: GPU4 NODE)"
    assert f"# not a GPU rail: mlx5_bond_0 ({why})" in lines
    assert "NCCL_IB_HCA==" + ALL8 in lines and "UCX_NET_DEVICES=" + ALL8 in lines


def test_rails_with_their_ip_on_a_vlan(tmp_path):
    """The IPv4 sits on ens<n>np0.100 (an upper device of the rail's netdev): its GID names the VLAN."""
    fs = FakeSys(tmp_path)
    fs.numa(0, "0-31")
    sw = ["pci0000:10", "0000:10:01.0", "0000:11:00.0"]
    fs.gpu([*sw, "0000:12:00.0", "0000:13:00.0"], 0, "0-31")
    for n in range(2):
        pdev = fs.pci([*sw, "0000:12:01.0", f"0000:14:00.{n}"], "0x15b3", "0x020000", 0, "0-31", device="0x1021")
        fs.netdev(f"ens{n}np0", pdev)
        vlan = fs.vlan(f"ens{n}np0", 100)
        fs.hca(f"mlx5_{n}", [*sw, "0000:12:01.0", f"0000:14:00.{n}"], 0, "0-31", None,
               {1: {"gids": link_local_gids(f"ens{n}np0") + roce_gids(vlan, RAILS[n])}}, ethernet=True)  # fmt: skip
    topo, out = run(tmp_path, addresses={"ens0np0.100": [RAILS[0]], "ens1np0.100": [RAILS[1]]})
    assert out["env"]["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1" and out["env"]["NCCL_IB_GID_INDEX"] == "5"
    assert topo["hcas"][0]["upper_netdevs"] == ["ens0np0.100"] and out["warnings"] == []
