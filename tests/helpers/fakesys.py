"""Fake /sys trees for topology tests, with the symlinks a real kernel makes:

bus/pci/devices/<bdf>          -> ../../../devices/pci0000:RR/<root port>/.../<bdf>
class/infiniband/<hca>         -> ../../devices/pci.../<bdf>/infiniband/<hca>
  .../infiniband/<hca>/device  -> ../../../<bdf>
class/net/<if>                 -> ../../devices/pci.../<bdf>/net/<if>   (virtual: devices/virtual/net/<if>)
  .../net/<if>/device          -> ../../../<bdf>
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
            (d / "device").symlink_to(os.path.relpath(pci_dir, d))
        (self.root / "class/net" / name).symlink_to(os.path.relpath(d, self.root / "class/net"))

    def hca(
        self, name: str, chain: list[str], numa: int, cpus: str, netdev: str | None, ports: dict[int, dict]
    ) -> Path:
        """ports: {1: {state, phys_state, link_layer, rate, gids: [(gid, type, ndev), ...]}}"""
        pdev = self.pci(chain, "0x15b3", "0x020700" if netdev is None else "0x020000", numa, cpus, device="0x1021")
        d = pdev / "infiniband" / name
        d.mkdir(parents=True)
        (d / "device").symlink_to(os.path.relpath(pdev, d))
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


def roce_gids(ifname: str, ip: str, extra_v6: int = 0) -> list[tuple[str, str, str]]:
    """A RoCE port's GID table as mlx5 builds it: link-local v1/v2 at 0/1, then one v1/v2 pair per
    global IPv6 address, then the IPv4-mapped v1/v2 pair: the RoCE v2 IPv4 GID is at 3 + 2*extra_v6
    (3 with no global IPv6, 5 with one: the field's "3 drifted to 5")."""
    ll = "fe80:0000:0000:0000:0e42:a1ff:fe00:0001"
    gids = [(ll, "IB/RoCE v1", ifname), (ll, "RoCE v2", ifname)]
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


def dgx_h100_ib(root: Path) -> FakeSys:
    """DGX H100: 8 GPUs, 8 single-port ConnectX-7 InfiniBand HCAs (+ 2 storage/mgmt HCAs), one root
    complex per GPU/NIC pair; each GPU sits behind a second switch level below the NIC's switch, so
    GPU<->its NIC is PXB, other NICs on the socket NODE, across sockets SYS (as nvidia-smi prints)."""
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
    fs.netdev("enp170s0f0", None)
    return fs


def single_gpu_vm(root: Path) -> FakeSys:
    fs = FakeSys(root)
    fs.numa(0, "0-15")
    fs.gpu(["pci0000:00", "0000:00:05.0"], -1, "")
    fs.netdev("eth0", fs.pci(["pci0000:00", "0000:00:03.0"], "0x1af4", "0x020000", -1, ""))
    fs.netdev("lo", None)
    return fs
