"""Fake /sys trees for topology tests, with the symlinks a real kernel makes:

bus/pci/devices/<bdf>          -> ../../../devices/pci0000:RR/<root port>/.../<bdf>
class/infiniband/<hca>         -> ../../devices/pci.../<bdf>/infiniband/<hca>
  .../infiniband/<hca>/device  -> ../../../<bdf>
class/net/<if>                 -> ../../devices/pci.../<bdf>/net/<if>   (virtual: devices/virtual/net/<if>)
  .../net/<if>/device          -> ../../../<bdf>
devices/virtual/net/<bond>/bonding/slaves          "slave1 slave2" (one line)
devices/virtual/net/<bond>/lower_<slave>           -> ../../../pci.../<bdf>/net/<slave>
devices/pci.../<bdf>/net/<slave>/{master,upper_<bond>} -> ../../../../../virtual/net/<bond>
class/infiniband/mlx5_bond_<n>                     -> the first slave's PCI function's infiniband/ dir
  (a RoCE LAG: the per-function IB devices are gone, the bond's GIDs name the bond as their ndev)
devices/virtual/net/<if>.<vid>/lower_<if> (and <if>/upper_<if>.<vid>): a VLAN, whose GIDs name it
devices/system/node/node<N>/cpulist
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


class FakeSys:
    def __init__(self, root: Path) -> None:
        self.root = root
        for d in ("bus/pci/devices", "class/infiniband", "class/net", "devices/system/node"):
            (root / d).mkdir(parents=True, exist_ok=True)

    def numa(self, node: int, cpus: str) -> None:
        d = self.root / f"devices/system/node/node{node}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpulist").write_text(cpus + "\n")

    def pci(self, chain: list[str], vendor: str, cls: str, numa: int, cpus: str, device: str = "0x0000") -> Path:
        """chain = ['pci0000:17', '0000:17:00.0', ..., bdf]: bridges are created as plain dirs."""
        d = self.root / "devices" / Path(*chain)
        d.mkdir(parents=True, exist_ok=True)
        for name, val in (("vendor", vendor), ("device", device), ("class", cls), ("numa_node", str(numa)),
                          ("local_cpulist", cpus)):  # fmt: skip
            (d / name).write_text(val + "\n")
        link = self.root / "bus/pci/devices" / chain[-1]
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(d, link.parent))
        return d

    def gpu(self, chain: list[str], numa: int, cpus: str) -> Path:
        return self.pci(chain, "0x10de", "0x030200", numa, cpus, device="0x2335")

    def netdev(self, name: str, pci_dir: Path | None, mac: str = "00:00:00:00:00:01", up: bool = True) -> None:
        d = (pci_dir / "net" / name) if pci_dir else (self.root / "devices/virtual/net" / name)
        d.mkdir(parents=True, exist_ok=True)
        (d / "operstate").write_text(("up" if up else "down") + "\n")
        (d / "address").write_text(mac + "\n")
        if pci_dir:
            (d / "device").symlink_to(f"../../../{pci_dir.name}")  # the kernel's text, not the shorter ../..
        (self.root / "class/net" / name).symlink_to(os.path.relpath(d, self.root / "class/net"))

    def bond(self, name: str, slaves: list[str], mac: str = "00:00:00:00:00:b0") -> Path:
        """A bonding master over existing netdevs, linked both ways as the bonding driver does."""
        d = self.root / "devices/virtual/net" / name
        (d / "bonding").mkdir(parents=True)
        (d / "bonding/slaves").write_text(" ".join(slaves) + "\n")
        (d / "operstate").write_text("up\n")
        (d / "address").write_text(mac + "\n")
        real = d.resolve()
        for sl in slaves:
            sdir = (self.root / "class/net" / sl).resolve()
            (d / f"lower_{sl}").symlink_to(os.path.relpath(sdir, real))
            for link in ("master", f"upper_{name}"):
                (sdir / link).symlink_to(os.path.relpath(real, sdir))
        (self.root / "class/net" / name).symlink_to(os.path.relpath(d, self.root / "class/net"))
        return d

    def vlan(self, parent: str, vid: int) -> str:
        """An 802.1Q interface <parent>.<vid> (virtual, linked lower_/upper_ as the 8021q driver does)."""
        name = f"{parent}.{vid}"
        d = self.root / "devices/virtual/net" / name
        d.mkdir(parents=True)
        (d / "operstate").write_text("up\n")
        (d / "address").write_text("00:00:00:00:00:c1\n")
        pdir = (self.root / "class/net" / parent).resolve()
        (d / f"lower_{parent}").symlink_to(os.path.relpath(pdir, d.resolve()))
        (pdir / f"upper_{name}").symlink_to(os.path.relpath(d.resolve(), pdir))
        (self.root / "class/net" / name).symlink_to(os.path.relpath(d, self.root / "class/net"))
        return name

    def hca(self, name: str, chain: list[str], numa: int, cpus: str, netdev: str | None, ports: dict[int, dict],
            ethernet: bool | None = None) -> Path:  # fmt: skip
        """ports: {1: {state, phys_state, link_layer, rate, gids: [(gid, type, ndev), ...]}}; ethernet: the
        PCI class (default: Ethernet when a netdev is given); the function may already exist (a LAG)."""
        eth = netdev is not None if ethernet is None else ethernet
        pdev = self.pci(chain, "0x15b3", "0x020000" if eth else "0x020700", numa, cpus, device="0x1021")
        d = pdev / "infiniband" / name
        d.mkdir(parents=True)
        (d / "device").symlink_to(f"../../../{pdev.name}")
        (self.root / "class/infiniband" / name).symlink_to(os.path.relpath(d, self.root / "class/infiniband"))
        if netdev:
            self.netdev(netdev, pdev)
        for p, info in ports.items():
            pd = d / "ports" / str(p)
            for sub in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
                (pd / sub).mkdir(parents=True)
            (pd / "state").write_text(info.get("state", "4: ACTIVE") + "\n")
            (pd / "phys_state").write_text(info.get("phys_state", "5: LinkUp") + "\n")
            (pd / "link_layer").write_text(info.get("link_layer", "Ethernet") + "\n")
            (pd / "rate").write_text(info.get("rate", "400 Gb/sec (4X NDR)") + "\n")
            for i, (gid, typ, ndev) in enumerate(info.get("gids", [])):
                (pd / "gids" / str(i)).write_text(gid + "\n")
                (pd / "gid_attrs/types" / str(i)).write_text(typ + "\n")
                (pd / "gid_attrs/ndevs" / str(i)).write_text(ndev + "\n")
        return pdev


ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"


def mapped(ip: str) -> str:
    """IPv4-mapped GID text as the kernel prints it (0000:...:ffff:0a0a:000b)."""
    return ipaddress.IPv6Address(f"::ffff:{ip}").exploded


def link_local_gids(ifname: str) -> list[tuple[str, str, str]]:
    """The GIDs a RoCE port has with no address configured: the link-local v1/v2 pair (no usable IPv4 GID)."""
    ll = "fe80:0000:0000:0000:0e42:a1ff:fe00:0001"
    return [(ll, "IB/RoCE v1", ifname), (ll, "RoCE v2", ifname)]


def roce_gids(ifname: str, ip: str, extra_v6: int = 0) -> list[tuple[str, str, str]]:
    """A RoCE port's GID table as mlx5 builds it: link-local v1/v2 at 0/1, then one v1/v2 pair per
    global IPv6 address, then the IPv4-mapped v1/v2 pair: the RoCE v2 IPv4 GID is at 3 + 2*extra_v6
    (3 with no global IPv6, 5 with one: the field's "3 drifted to 5")."""
    gids = link_local_gids(ifname)
    for k in range(extra_v6):
        g6 = f"2001:0db8:0000:0000:0000:0000:0000:{k + 1:04x}"
        gids += [(g6, "IB/RoCE v1", ifname), (g6, "RoCE v2", ifname)]
    return [*gids, (mapped(ip), "IB/RoCE v1", ifname), (mapped(ip), "RoCE v2", ifname)]


def hgx_h20(root: Path, rail_ips: list[str], extra_v6: int = 0, down: set[str] = frozenset(),
            no_v4_gid: set[str] = frozenset(), mgmt_ip: str | None = None) -> FakeSys:  # fmt: skip
    """8x H20 HGX, 2 sockets, 4 PCIe switches each with 2 GPUs and one dual-port CX-7
    (two PCI functions mlx5_{2k}, mlx5_{2k+1}, RoCE v2, one rail IP each)."""
    fs = FakeSys(root)
    fs.numa(0, "0-47,96-143")
    fs.numa(1, "48-95,144-191")
    for sw in range(4):
        numa = 0 if sw < 2 else 1
        cpus = "0-47,96-143" if numa == 0 else "48-95,144-191"
        rc = f"pci0000:{0x15 + sw * 0x20:02x}"
        rp = f"0000:{0x15 + sw * 0x20:02x}:01.0"
        up = f"0000:{0x16 + sw * 0x20:02x}:00.0"
        bus = 0x17 + sw * 0x20
        for k in range(2):
            ds = f"0000:{bus:02x}:{k:02x}.0"
            fs.gpu([rc, rp, up, ds, f"0000:{bus + 1 + k:02x}:00.0"], numa, cpus)
        ds_nic = f"0000:{bus:02x}:02.0"
        for f in range(2):
            n = sw * 2 + f
            name, ifname = f"mlx5_{n}", f"ens{n}np0"
            gids = roce_gids(ifname, rail_ips[n], extra_v6=extra_v6)
            if name in no_v4_gid:
                gids = gids[:-2]  # the port has no IPv4-mapped GID (IP missing/misconfigured)
            state = ("1: DOWN", "3: Disabled") if name in down else ("4: ACTIVE", "5: LinkUp")
            fs.hca(name, [rc, rp, up, ds_nic, f"0000:{bus + 3:02x}:00.{f}"], numa, cpus, ifname,
                   {1: {"state": state[0], "phys_state": state[1], "gids": gids}})  # fmt: skip
    if mgmt_ip:
        fs.netdev("bond0", None, mac="00:00:00:00:00:99")
    return fs


def dgx_h100_ib(root: Path, storage_link: str = "InfiniBand") -> FakeSys:
    """DGX H100: 8 GPUs, 8 single-port ConnectX-7 InfiniBand HCAs, one root complex per GPU/NIC pair;
    each GPU sits behind a second switch level below the NIC's switch, so GPU<->its NIC is PXB, other
    NICs on the socket NODE, across sockets SYS (as nvidia-smi prints). Plus the storage card: one
    dual-port ConnectX-7 (mlx5_8, mlx5_9: two functions, PIX to each other) on a root complex of
    socket 0 with no GPU (NODE to GPU0-3). storage_link "Ethernet": its ports are RoCE with no IPv4
    configured (link-local GIDs only: no usable RoCE v2 IPv4 GID)."""
    fs = FakeSys(root)
    fs.numa(0, "0-55,112-167")
    fs.numa(1, "56-111,168-223")
    ll = "fe80:0000:0000:0000:a088:c203:0001:0001"
    for g in range(8):
        numa = 0 if g < 4 else 1
        cpus = "0-55,112-167" if numa == 0 else "56-111,168-223"
        base = 0x10 * (g + 1)
        rc, rp, up = f"pci0000:{base:02x}", f"0000:{base:02x}:01.0", f"0000:{base + 1:02x}:00.0"
        gpu_chain = [rc, rp, up, f"0000:{base + 2:02x}:00.0", f"0000:{base + 3:02x}:00.0", f"0000:{base + 4:02x}:00.0",
                     f"0000:{base + 5:02x}:00.0"]  # fmt: skip
        fs.gpu(gpu_chain, numa, cpus)
        fs.hca(f"mlx5_{g}", [rc, rp, up, f"0000:{base + 2:02x}:01.0", f"0000:{base + 6:02x}:00.0"], numa, cpus,
               None, {1: {"link_layer": "InfiniBand", "gids": [(ll, "", "")]}})  # fmt: skip
    for f in range(2):
        ifname = f"enp161s0f{f}np{f}" if storage_link == "Ethernet" else None
        gids = [(ll, "", "")] if ifname is None else link_local_gids(ifname)
        fs.hca(f"mlx5_{8 + f}", ["pci0000:a0", "0000:a0:01.0", f"0000:a1:00.{f}"], 0, "0-55,112-167", ifname,
               {1: {"link_layer": storage_link, "gids": gids}})  # fmt: skip
    fs.netdev("enp170s0f0", None)
    return fs


def hgx_roce_lag(root: Path, rail_ips: list[str], node_ip: str, bond_ipv4_gid: bool = True) -> FakeSys:
    """8 GPUs and 8 single-port RoCE v2 rails (mlx5_0..7, ens{n}np0, IPv4 GID at 3): four root complexes,
    each one PCIe switch with 2 GPUs and 2 NICs (GPU<->NIC PIX). The storage/front-end card is a dual-port
    ConnectX on a root complex of socket 1 with no GPU, its ports bonded (bond0 over ens10f0np0/ens10f1np1,
    carrying node_ip) with a RoCE LAG: mlx5_bond_0 on the first function, GIDs on ndev bond0 - with a
    global IPv6 on bond0, so its IPv4 GID is at 5; bond_ipv4_gid=False: none at all (IPv6-only bond)."""
    fs = FakeSys(root)
    fs.numa(0, "0-47,96-143")
    fs.numa(1, "48-95,144-191")
    for sw in range(4):
        numa = 0 if sw < 2 else 1
        cpus = "0-47,96-143" if numa == 0 else "48-95,144-191"
        b = 0x10 + sw * 0x20
        rc, rp, up = f"pci0000:{b:02x}", f"0000:{b:02x}:01.0", f"0000:{b + 1:02x}:00.0"
        for k in range(2):
            n = sw * 2 + k
            fs.gpu([rc, rp, up, f"0000:{b + 2:02x}:{k:02x}.0", f"0000:{b + 3 + k:02x}:00.0"], numa, cpus)
            fs.hca(f"mlx5_{n}", [rc, rp, up, f"0000:{b + 2:02x}:{2 + k:02x}.0", f"0000:{b + 5 + k:02x}:00.0"], numa,
                   cpus, f"ens{n}np0", {1: {"gids": roce_gids(f"ens{n}np0", rail_ips[n])}})  # fmt: skip
    slaves = ["ens10f0np0", "ens10f1np1"]
    pfs = [["pci0000:c0", "0000:c0:01.0", f"0000:c1:00.{f}"] for f in range(2)]
    for chain, sl in zip(pfs, slaves, strict=True):
        fs.netdev(sl, fs.pci(chain, "0x15b3", "0x020000", 1, "48-95,144-191", device="0x1021"))
    fs.bond("bond0", slaves)
    gids = roce_gids("bond0", node_ip, extra_v6=1)
    fs.hca("mlx5_bond_0", pfs[0], 1, "48-95,144-191", None, {1: {"gids": gids if bond_ipv4_gid else gids[:-2]}},
           ethernet=True)  # fmt: skip
    return fs


def single_gpu_vm(root: Path) -> FakeSys:
    fs = FakeSys(root)
    fs.numa(0, "0-15")
    fs.gpu(["pci0000:00", "0000:00:05.0"], -1, "")
    fs.netdev("eth0", fs.pci(["pci0000:00", "0000:00:03.0"], "0x1af4", "0x020000", -1, ""))
    fs.netdev("lo", None)
    return fs
