"""GPU / HCA / NUMA / GID discovery from sysfs (+ NVML when present) and the fabric environment
NCCL, Gloo, UCX and the engines must share on every rank.

Reads only the sysfs attributes listed in docs/topology.md (tests build fake trees of exactly
these, with the kernel's symlinks). Stdlib only; pynvml is imported lazily.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import struct
from typing import Any

from ..nodeinfo import read_text

NVIDIA = "0x10de"
GPU_CLASSES = ("0x0302", "0x0300")
# nvidia-smi topo -m link types, nearest first.
LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS")
# An HCA is a GPU rail when it shares a PCIe switch (PIX, PXB) or a root complex (PHB) with a GPU.
RAIL_LEVELS = ("PIX", "PXB", "PHB")
BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


class TopologyError(ValueError):
    """Discovery or an override cannot give a correct environment; the message says what to fix."""


class OverrideError(TopologyError):
    """A value the caller supplied (an override or an extra variable) is malformed or names what is
    not on this node: bad input (CLI exit 2), not a fault found on the node. ``source`` says which:
    "overrides" or "extra_env"."""

    def __init__(self, message: str, source: str = "overrides") -> None:
        super().__init__(message)
        self.source = source


ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_env_vars(values: dict[str, Any], source: str = "overrides") -> None:
    """Names and values that can be written as one NAME=VALUE line of an env file."""
    what = "override" if source == "overrides" else "extra variable"
    for k, v in values.items():
        if not isinstance(k, str) or not ENV_NAME.match(k):
            raise OverrideError(
                f"{what} {k!r}: not an environment variable name (letters, digits and '_', not starting with a digit)",
                source,
            )
        if any(c in str(v) for c in "\n\r\0"):
            raise OverrideError(f"{what} {k}: the value holds a line break or NUL; give a one-line value", source)


def check_overrides(overrides: dict[str, Any]) -> None:
    """What can be checked of overrides without the node (names, one-line values, numbers)."""
    check_env_vars(overrides)
    if "NCCL_IB_GID_INDEX" in overrides:
        _gid_index(overrides["NCCL_IB_GID_INDEX"])
    if "NCCL_IB_HCA" in overrides:
        _hca_list(overrides["NCCL_IB_HCA"])


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for raw in text.replace("\n", ",").split(","):
        part = raw.strip()
        if not part:
            continue
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def _numa(v: str) -> int | None:
    try:
        n = int(v)
    except ValueError:
        return None
    return n if n >= 0 else None


def pci_path(sys_root: str, bdf: str) -> list[str]:
    """The PCIe hierarchy of a device from its resolved sysfs path:
    ['pci0000:17', '0000:17:00.0', '0000:18:00.0', ..., bdf]."""
    real = os.path.realpath(os.path.join(sys_root, "bus/pci/devices", bdf))
    parts = real.split(os.sep)
    for i, p in enumerate(parts):
        if p.startswith("pci") and ":" in p:
            return [p] + [q for q in parts[i + 1 :] if BDF.match(q)]
    return [bdf]


def link_level(a: list[str], b: list[str], numa_a: int | None, numa_b: int | None) -> str:
    """nvidia-smi topo's relation between two PCI devices from their hierarchy paths."""
    if a[0] != b[0]:
        return "NODE" if numa_a is not None and numa_a == numa_b else "SYS"
    common = 0
    for x, y in zip(a, b):
        if x != y:
            break
        common += 1
    if common <= 2:  # only the host bridge (and at most the root port) in common
        return "PHB"
    # Through one switch: each side is a downstream port + the device below the common upstream port.
    return "PIX" if len(a) - common <= 2 and len(b) - common <= 2 else "PXB"


def pci_device(sys_root: str, bdf: str) -> dict[str, Any]:
    d = os.path.join(sys_root, "bus/pci/devices", bdf)
    return {
        "bdf": bdf,
        "vendor": read_text(os.path.join(d, "vendor")),
        "device": read_text(os.path.join(d, "device")),
        "class": read_text(os.path.join(d, "class")),
        "numa_node": _numa(read_text(os.path.join(d, "numa_node"), "-1")),
        "local_cpulist": read_text(os.path.join(d, "local_cpulist")),
        "path": pci_path(sys_root, bdf),
    }


def gpus_from_sysfs(sys_root: str) -> list[dict[str, Any]]:
    base = os.path.join(sys_root, "bus/pci/devices")
    out = []
    for bdf in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        dev = pci_device(sys_root, bdf)
        if dev["vendor"] == NVIDIA and dev["class"][:6] in GPU_CLASSES:
            out.append(dev)
    for i, g in enumerate(out):  # NVML/nvidia-smi order is PCI bus order
        g.update(index=i, uuid=None, model=None, memory_bytes=None, nvlinks=None, source="sysfs")
    return out


def gpus_from_nvml(sys_root: str) -> list[dict[str, Any]] | None:
    """GPUs via NVML, NUMA/CPUs from sysfs when NVML says 'not supported'. None without NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver / no GPU: fall back to sysfs
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            bus = pynvml.nvmlDeviceGetPciInfo(h).busId
            bus = bus.decode() if isinstance(bus, bytes) else bus
            bdf = bus.lower()[-12:]  # NVML: 00000000:18:00.0 -> 0000:18:00.0
            name = pynvml.nvmlDeviceGetName(h)
            dev = pci_device(sys_root, bdf) if os.path.exists(os.path.join(sys_root, "bus/pci/devices", bdf)) else {
                "bdf": bdf, "numa_node": None, "local_cpulist": "", "path": [bdf]}  # fmt: skip
            numa_src = "sysfs"
            try:
                dev["numa_node"] = pynvml.nvmlDeviceGetNumaNodeId(h)
                numa_src = "nvml"
            except Exception:  # noqa: S110 ("Not Supported" on many drivers/VMs: keep sysfs numa_node)
                pass
            links = 0
            for link in range(18):
                try:
                    links += pynvml.nvmlDeviceGetNvLinkState(h, link) == 1
                except Exception:
                    break
            uuid = pynvml.nvmlDeviceGetUUID(h)
            dev.update(
                index=i,
                uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,  # llmfleet_gpus may name GPUs by UUID
                model=name.decode() if isinstance(name, bytes) else name,
                memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                nvlinks=links,
                source="nvml",
                numa_source=numa_src,
            )
            out.append(dev)
        return out
    finally:
        pynvml.nvmlShutdown()


def _port_info(pdir: str) -> dict[str, Any]:
    def num_text(v: str) -> str:
        return v.split(":", 1)[1].strip() if ":" in v else v

    gids = []
    gdir = os.path.join(pdir, "gids")
    for name in sorted(os.listdir(gdir), key=int) if os.path.isdir(gdir) else []:
        gid = read_text(os.path.join(gdir, name))
        gids.append(
            {
                "index": int(name),
                "gid": gid,
                "type": read_text(os.path.join(pdir, "gid_attrs/types", name)),
                "ndev": read_text(os.path.join(pdir, "gid_attrs/ndevs", name)),
                "ipv4": gid_ipv4(gid),
            }
        )
    return {
        "state": num_text(read_text(os.path.join(pdir, "state"))),
        "phys_state": num_text(read_text(os.path.join(pdir, "phys_state"))),
        "link_layer": read_text(os.path.join(pdir, "link_layer")),
        "rate": read_text(os.path.join(pdir, "rate")),
        "gids": gids,
    }


def gid_ipv4(gid: str) -> str | None:
    """The IPv4 of an IPv4-mapped GID (::ffff:a.b.c.d), else None (all-zero, link-local, IPv6)."""
    try:
        ip = ipaddress.IPv6Address(gid)
    except ValueError:
        return None
    return str(ip.ipv4_mapped) if ip.ipv4_mapped else None


def hcas_from_sysfs(sys_root: str) -> list[dict[str, Any]]:
    base = os.path.join(sys_root, "class/infiniband")
    out = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        dev_link = os.path.join(base, name, "device")
        bdf = os.path.basename(os.path.realpath(dev_link))
        # Software RDMA (rxe, siw) has no PCI function: no path, so no affinity to any GPU.
        dev = pci_device(sys_root, bdf) if BDF.match(bdf) else {"bdf": None, "numa_node": None, "path": None}
        bdf = dev["bdf"]
        net_dir = os.path.join(dev_link, "net")
        netdevs = sorted(os.listdir(net_dir)) if os.path.isdir(net_dir) else []
        # A RoCE LAG (mlx5_bond_N) sits on its first slave's PCI function, but its GIDs name the bond;
        # a VLAN's GIDs name the VLAN device: both are upper devices of the function's netdev.
        uppers = sorted({u for nd in netdevs for u in upper_netdevs(sys_root, nd)})
        ports = {}
        pbase = os.path.join(base, name, "ports")
        for p in sorted(os.listdir(pbase), key=int) if os.path.isdir(pbase) else []:
            ports[int(p)] = _port_info(os.path.join(pbase, p))
        out.append({"name": name, "bdf": bdf, "numa_node": dev.get("numa_node"), "path": dev.get("path"),
                    "netdevs": netdevs, "upper_netdevs": uppers, "ports": ports})  # fmt: skip
    return out


def bond_master(sys_root: str, ifname: str) -> str | None:
    """The bond (or other master) an interface is enslaved to: class/net/<if>/master -> .../<master>."""
    link = os.path.join(sys_root, "class/net", ifname, "master")
    return os.path.basename(os.path.realpath(link)) if os.path.islink(link) else None


def upper_netdevs(sys_root: str, ifname: str, depth: int = 4) -> list[str]:
    """Interfaces stacked on ifname (its master, upper_<if> links: bonds, VLANs), and theirs in turn."""
    d = os.path.join(sys_root, "class/net", ifname)
    found = [e[len("upper_") :] for e in (sorted(os.listdir(d)) if os.path.isdir(d) else []) if e.startswith("upper_")]
    master = bond_master(sys_root, ifname)
    if master and master not in found:
        found.append(master)
    for u in list(found) if depth > 1 else []:
        found += [x for x in upper_netdevs(sys_root, u, depth - 1) if x not in found]
    return found


def ipv4_of(ifname: str) -> str | None:
    """Primary IPv4 of an interface (SIOCGIFADDR), None if it has none or does not exist."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            import fcntl

            res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(res[20:24])


def netdevs_from_sysfs(sys_root: str, addresses: dict[str, list[str]] | None = None) -> list[dict[str, Any]]:
    base = os.path.join(sys_root, "class/net")
    out = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        d = os.path.join(base, name)
        dev = os.path.realpath(os.path.join(d, "device")) if os.path.exists(os.path.join(d, "device")) else None
        ips = (addresses or {}).get(name)
        if ips is None and addresses is None:
            ip = ipv4_of(name)
            ips = [ip] if ip else []
        out.append({
            "name": name,
            "operstate": read_text(os.path.join(d, "operstate")),
            "address": read_text(os.path.join(d, "address")),
            "pci": os.path.basename(dev) if dev and BDF.match(os.path.basename(dev)) else None,
            "ipv4": ips or [],
            "master": bond_master(sys_root, name),
            "slaves": read_text(os.path.join(d, "bonding/slaves")).split(),
        })  # fmt: skip
    return out


def numa_nodes(sys_root: str) -> dict[int, list[int]]:
    base = os.path.join(sys_root, "devices/system/node")
    out = {}
    for name in os.listdir(base) if os.path.isdir(base) else []:
        m = re.fullmatch(r"node(\d+)", name)
        if m:
            out[int(m.group(1))] = parse_cpulist(read_text(os.path.join(base, name, "cpulist")))
    return dict(sorted(out.items()))


# ---- choices ---------------------------------------------------------------------------------------


def roce_gid(port: dict[str, Any], ips: list[str], ndevs: list[str] | None = None) -> int | None:
    """The RoCE v2 GID index whose IPv4-mapped address is configured on the port's netdev. With ndevs,
    the GID must also belong to one of them (the table's ndev says whose address it is)."""
    for g in port["gids"]:
        if g["type"].lower().replace(" ", "") != "rocev2" or not g["ipv4"] or g["ipv4"] not in ips:
            continue
        if ndevs is None or not g["ndev"] or g["ndev"] in ndevs:
            return g["index"]
    return None


def discover(
    sys_root: str = "/sys",
    node_ip: str | None = None,
    addresses: dict[str, list[str]] | None = None,
    use_nvml: bool = True,
) -> dict[str, Any]:
    """Everything about this node's GPUs, HCAs, NICs and NUMA that rank placement needs."""
    gpus = (gpus_from_nvml(sys_root) if use_nvml else None) or gpus_from_sysfs(sys_root)
    hcas = hcas_from_sysfs(sys_root)
    nets = netdevs_from_sysfs(sys_root, addresses)
    numa = numa_nodes(sys_root)
    ip_of = {n["name"]: n["ipv4"] for n in nets}
    for g in gpus:
        if g.get("numa_node") is None and len(numa) == 1:
            # VMs report numa_node -1 (and NVML "not supported"); with one NUMA node it can only be that one.
            g["numa_node"] = next(iter(numa))
            g["numa_source"] = "single NUMA node"
        g["cpus"] = parse_cpulist(g.get("local_cpulist") or "") or numa.get(g.get("numa_node"), [])
        g["nearest_hcas"] = sorted(
            ({"hca": h["name"], "level": link_level(g["path"], h["path"], g.get("numa_node"), h.get("numa_node"))}
             for h in hcas if h.get("path")),
            key=lambda x: (LEVELS.index(x["level"]), x["hca"]),
        )  # fmt: skip
    for h in hcas:
        ndevs = h["netdevs"] + h["upper_netdevs"]
        ips = [ip for nd in ndevs for ip in ip_of.get(nd, [])]
        if node_ip and not ips and len(hcas) == 1:
            ips = [node_ip]  # single-rail node: the fabric IP from the inventory
        h["ipv4"] = ips
        for p in h["ports"].values():
            p["ipv4"] = ips
            p["roce_v2_gid"] = roce_gid(p, ips, ndevs) if p["link_layer"] == "Ethernet" else None
    topo = {"gpus": gpus, "hcas": hcas, "netdevs": nets, "numa": numa, "node_ip": node_ip}
    topo.update(classify_rails(topo))
    return topo


def _affinity(h: dict[str, Any], gpus: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The GPU nearest to an HCA and how near ({gpu, level}); None without a PCI path or a GPU."""
    best = None
    for g in gpus:
        for x in g["nearest_hcas"]:
            if x["hca"] == h["name"] and (best is None or LEVELS.index(x["level"]) < LEVELS.index(best["level"])):
                best = {"gpu": g["index"], "level": x["level"]}
    return best


def _no_usable_gid(h: dict[str, Any]) -> bool:
    """Every ACTIVE port is RoCE without a usable RoCE v2 IPv4 GID (such an HCA cannot carry NCCL)."""
    active = [p for p in h["ports"].values() if p["state"] == "ACTIVE"]
    return bool(active) and all(p["link_layer"] == "Ethernet" and p["roce_v2_gid"] is None for p in active)


def classify_rails(topo: dict[str, Any]) -> dict[str, Any]:
    """Which HCAs are GPU rails (docs/topology.md, "Which HCAs are rails"); sets each HCA's ``rail`` and
    ``affinity`` and returns {rails, non_rail_hcas: [{hca, reason}], rail_rule}.

    pcie-affinity: the HCAs sharing a PCIe switch or root complex with at least one GPU. Without any
    such HCA (no-affinity, or no-gpu) storage cannot be told from rails by position: every HCA, except
    the one carrying the node IP (the front end) and RoCE ones without a usable GID, as long as that
    leaves one; fabric_env warns."""
    gpus, hcas, node_ip = topo["gpus"], topo["hcas"], topo.get("node_ip")
    why: dict[str, str] = {}
    for h in hcas:
        h["affinity"] = _affinity(h, gpus)
        if not h.get("path"):
            why[h["name"]] = "not a PCI device (software RDMA or virtual)"
    if any(h["affinity"] and h["affinity"]["level"] in RAIL_LEVELS for h in hcas):
        rule = "pcie-affinity"
        for h in hcas:
            a = h["affinity"] or {"gpu": "?", "level": "SYS"}
            if h["name"] not in why and a["level"] not in RAIL_LEVELS:
                why[h["name"]] = (f"no GPU on its PCIe switch or root complex {h['path'][0]} "
                                  f"(nearest: GPU{a['gpu']} {a['level']})")  # fmt: skip
    else:
        rule = "no-affinity" if gpus else "no-gpu"
        cands = [h for h in hcas if h["name"] not in why]
        front = [h for h in cands if node_ip and node_ip in h["ipv4"]]
        if front and len(front) < len(cands):
            for h in front:
                via = ",".join(nd for nd in h["upper_netdevs"] + h["netdevs"])
                why[h["name"]] = f"carries the node IP {node_ip} ({via}): the front-end network, not a rail"
        cands = [h for h in cands if h["name"] not in why]
        no_gid = [h for h in cands if _no_usable_gid(h)]
        if no_gid and len(no_gid) < len(cands):  # all without a GID: keep them, fabric_env names the fault
            for h in no_gid:
                why[h["name"]] = "no RoCE v2 GID carrying an IPv4 of its netdev (cannot carry NCCL)"
    for h in hcas:
        h["rail"] = h["name"] not in why
    return {
        "rails": [h["name"] for h in hcas if h["rail"]],
        "non_rail_hcas": [
            {"hca": h["name"], "bdf": h["bdf"], "netdevs": h["upper_netdevs"] + h["netdevs"], "reason": why[h["name"]]}
            for h in hcas
            if not h["rail"]
        ],
        "rail_rule": rule,
    }


def socket_ifname(nets: list[dict[str, Any]], node_ip: str | None) -> str | None:
    if node_ip:
        for n in nets:
            if node_ip in n["ipv4"]:
                return n["name"]
    return None


def _assign_gpus(topo: dict[str, Any], usable: set[str]) -> list[str]:
    """Each GPU's ``hca``: the least-used of its nearest usable HCAs (GPU0/GPU1 behind one switch with a
    dual-port card get mlx5_0 and mlx5_1); None when none is usable. Returns the HCAs in GPU order."""
    used: dict[str, int] = {}
    order: list[str] = []
    for g in topo["gpus"]:
        near = [x for x in g.get("nearest_hcas", []) if x["hca"] in usable]
        g["hca"] = None
        if not near:
            continue
        best = min(LEVELS.index(x["level"]) for x in near)
        pick = min((x["hca"] for x in near if LEVELS.index(x["level"]) == best), key=lambda n: (used.get(n, 0), n))
        g["hca"] = pick
        used[pick] = used.get(pick, 0) + 1
        if pick not in order:
            order.append(pick)
    return order


def _ports_by_affinity(topo: dict[str, Any], rails: set[str]) -> list[tuple[str, int]]:
    """ACTIVE rail (hca, port) pairs in GPU order (see _assign_gpus), then any ACTIVE rail port no GPU
    chose."""
    by_name = {h["name"]: h for h in topo["hcas"]}
    usable = {n for n in rails if any(i["state"] == "ACTIVE" for i in by_name[n]["ports"].values())}
    order = _assign_gpus(topo, usable)
    order += sorted(usable - set(order))
    return [(n, p) for n in order for p, i in by_name[n]["ports"].items() if i["state"] == "ACTIVE"]


def _rail_warnings(topo: dict[str, Any], rails: set[str]) -> list[str]:
    """What an operator must know about the rail choice: a fallback, or GPUs without a rail nearby."""
    rule = topo.get("rail_rule", "pcie-affinity")
    if rule != "pcie-affinity" and rails:
        lead = "no GPU found" if rule == "no-gpu" else "no GPU shares a PCIe switch or root complex with any HCA"
        left = [x["hca"] for x in topo.get("non_rail_hcas", [])]
        return [
            f"{lead}: NCCL_IB_HCA takes every HCA{' but ' + ', '.join(left) if left else ''} (non_rail_hcas says "
            "why) - storage or management HCAs cannot be told from rails by PCIe position here; check the list "
            "and pin it with topology_overrides NCCL_IB_HCA"
        ]
    far = [g for g in topo["gpus"] if rails and not any(
        x["hca"] in rails and x["level"] in RAIL_LEVELS for x in g.get("nearest_hcas", []))]  # fmt: skip
    if not far:
        return []
    names = ", ".join(f"GPU{g['index']} ({g['bdf']})" for g in far)
    one = len(far) == 1
    return [
        f"{names} {'has' if one else 'have'} no rail on {'its' if one else 'their'} PCIe switch or root complex: "
        f"{'its' if one else 'their'} NCCL traffic crosses the host bridges or the CPU interconnect to the nearest rail"
    ]


def _gid_env(active: list, port: dict, overrides: dict, warnings: list[str]) -> dict[str, str]:
    roce = [(hp, port[hp]) for hp in active if port[hp]["link_layer"] == "Ethernet"]
    if "NCCL_IB_GID_INDEX" in overrides:
        gi = overrides.pop("NCCL_IB_GID_INDEX")
        _validate_gid_override(gi, roce)
        return {"NCCL_IB_GID_INDEX": str(gi)}
    missing = [f"{h}:{p}" for (h, p), info in roce if info["roce_v2_gid"] is None]
    if missing:
        raise TopologyError(
            f"RoCE port(s) {', '.join(missing)} have no RoCE v2 GID carrying an IPv4 of their netdev "
            f"(IPv4s seen: {sorted({ip for _, i in roce for ip in i['ipv4']}) or 'none'}); configure the "
            "port's IPv4 address (the GID table follows it), or leave the port out with NCCL_IB_HCA"
        )
    gids = sorted({info["roce_v2_gid"] for _, info in roce})
    if len(gids) == 1:
        return {"NCCL_IB_GID_INDEX": str(gids[0])}
    if len(gids) > 1:
        per = ", ".join(f"{h}:{p}={info['roce_v2_gid']}" for (h, p), info in roce)
        warnings.append(
            f"RoCE v2 GID index differs between ports ({per}): exporting NCCL's own selection "
            "(NCCL_IB_ADDR_FAMILY=AF_INET, NCCL_IB_ROCE_VERSION_NUM=2, NCCL >= 2.21) instead of one index"
        )
        return {"NCCL_IB_ADDR_FAMILY": "AF_INET", "NCCL_IB_ROCE_VERSION_NUM": "2"}
    return {}  # InfiniBand link layer: no RoCE GID index needed


def _chosen_ports(topo: dict[str, Any], overrides: dict[str, Any], port: dict, rails: set[str],
                  warnings: list[str]) -> list[tuple[str, int]]:  # fmt: skip
    """The (hca, port) pairs for NCCL_IB_HCA: the override (validated; a non-rail in it is a warning, not
    an error: the operator may know better) or the ACTIVE rail ports in GPU order."""
    if "NCCL_IB_HCA" not in overrides:
        warnings += _rail_warnings(topo, rails)
        return _ports_by_affinity(topo, rails)
    active = _validate_hca_override(overrides.pop("NCCL_IB_HCA"), port)
    _assign_gpus(topo, {h for h, _ in active})
    why = {x["hca"]: x["reason"] for x in topo.get("non_rail_hcas", [])}
    for h in dict.fromkeys(h for h, _ in active if h in why):
        warnings.append(f"override NCCL_IB_HCA: {h} is not a rail ({why[h]}); using it as told")
    return active


def fabric_env(topo: dict[str, Any], overrides: dict[str, str] | None = None) -> dict[str, Any]:
    """The environment every rank gets, plus warnings and the per-port choices behind it."""
    overrides = dict(overrides or {})
    check_overrides(overrides)
    warnings: list[str] = []
    env: dict[str, str] = {}
    node_ip = topo.get("node_ip")
    ifname = socket_ifname(topo["netdevs"], node_ip)
    if node_ip and not ifname:
        raise TopologyError(
            f"no interface carries the fabric IP {node_ip} (interfaces: "
            + ", ".join(f"{n['name']}={'/'.join(n['ipv4']) or '-'}" for n in topo["netdevs"])
            + "); fix llmfleet_fabric_ip or the network config"
        )
    port = {(h["name"], p): info for h in topo["hcas"] for p, info in h["ports"].items()}
    # Topologies built before rails existed (or by hand) count every HCA as a rail.
    rails = set(topo.get("rails", [h["name"] for h in topo["hcas"]]))
    down = [f"{h}:{p} ({i['state']}/{i['phys_state']})" for (h, p), i in port.items()
            if i["state"] != "ACTIVE" and h in rails]  # fmt: skip
    if down:
        warnings.append(f"ports not ACTIVE, left out of NCCL_IB_HCA: {', '.join(down)}")
    active = _chosen_ports(topo, overrides, port, rails, warnings)
    if active:
        env["NCCL_IB_HCA"] = "=" + ",".join(f"{h}:{p}" for h, p in active)  # '=': mlx5_1 must not match mlx5_10
        env["UCX_NET_DEVICES"] = ",".join(f"{h}:{p}" for h, p in active)
        env.update(_gid_env(active, port, overrides, warnings))
    else:
        env["NCCL_IB_DISABLE"] = "1"
        # Rails that are all down never hand NCCL to storage HCAs: that is a fault to fix, not a choice.
        what = (f"no rail port is ACTIVE (rails: {', '.join(sorted(rails))})" if rails
                else "no ACTIVE InfiniBand/RoCE port")  # fmt: skip
        warnings.append(
            f"{what}: NCCL_IB_DISABLE=1, cross-node traffic goes over TCP sockets "
            f"({ifname or 'no socket interface'}) - fine for a lab or one node, far too slow for a multi-node engine"
        )
        if ifname:
            env["UCX_NET_DEVICES"] = ifname
    if ifname:
        env["NCCL_SOCKET_IFNAME"] = "=" + ifname
        env["GLOO_SOCKET_IFNAME"] = ifname  # gloo takes plain names (no '=' / '^' syntax)
    if node_ip:
        env["SGLANG_HOST_IP"] = node_ip
        env["VLLM_HOST_IP"] = node_ip
    for k, v in overrides.items():
        if k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            name = str(v).lstrip("=^")
            if name not in {n["name"] for n in topo["netdevs"]}:
                raise OverrideError(f"override {k}={v}: no interface {name!r} on this node")
        env[k] = str(v)
    return {"env": env, "warnings": warnings, "socket_ifname": ifname, "ib_ports": [f"{h}:{p}" for h, p in active]}


def _hca_list(value: Any) -> list[tuple[str, int]]:
    """'=mlx5_0:1,mlx5_1' -> [('mlx5_0', 1), ('mlx5_1', 1)] (port 1 when left out)."""
    out = []
    for item in str(value).lstrip("=").split(","):
        name, _, p = item.strip().partition(":")
        if not name or (p and not re.fullmatch(r"[0-9]+", p)):
            raise OverrideError(
                f"override NCCL_IB_HCA={value}: {item.strip()!r} is not HCA[:PORT] (e.g. =mlx5_0:1,mlx5_1:1)"
            )
        out.append((name, int(p) if p else 1))
    return out


def _validate_hca_override(value: str, port: dict[tuple[str, int], dict[str, Any]]) -> list[tuple[str, int]]:
    out = []
    have = ", ".join(f"{h}:{q}" for h, q in port) or "none"
    for name, pnum in _hca_list(value):
        if (name, pnum) not in port:
            raise OverrideError(f"override NCCL_IB_HCA: {name}:{pnum} does not exist here (have: {have})")
        if port[(name, pnum)]["state"] != "ACTIVE":
            raise OverrideError(f"override NCCL_IB_HCA: {name}:{pnum} is {port[(name, pnum)]['state']}, not ACTIVE: "
                                f"name ACTIVE ports only (or bring the link up)")  # fmt: skip
        out.append((name, pnum))
    return out


def _gid_index(gi: Any) -> int:
    if not re.fullmatch(r"[0-9]+", str(gi)):
        raise OverrideError(f"override NCCL_IB_GID_INDEX={gi}: not a GID table index (a whole number >= 0, e.g. 3)")
    return int(str(gi))


def _validate_gid_override(gi: Any, roce: list) -> None:
    index = _gid_index(gi)
    for (h, p), info in roce:
        g = next((g for g in info["gids"] if g["index"] == index), None)
        if g is None or g["type"].lower().replace(" ", "") != "rocev2" or not g["ipv4"]:
            raise OverrideError(
                f"override NCCL_IB_GID_INDEX={gi}: on {h}:{p} that index is "
                f"{(g or {}).get('type') or 'empty'} {(g or {}).get('gid', '')}, not a RoCE v2 IPv4 GID"
                f" (RoCE v2 IPv4 here: {info['roce_v2_gid']})"
            )


def render_env_file(env: dict[str, str], header: str = "") -> str:
    lines = [header.rstrip()] if header else []
    lines += [f"{k}={v}" for k, v in sorted(env.items())]
    return "\n".join(lines) + "\n"


# ---- nvidia-smi topo -m ------------------------------------------------------------------------------


def parse_topo_matrix(text: str) -> dict[str, dict[str, str]]:
    """`nvidia-smi topo -m` -> {row: {column: relation}} for the GPU/NIC matrix part."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    header_i = next(i for i, ln in enumerate(lines) if re.match(r"^\s*(\x1b\[[0-9;]*m)?\s*GPU0\b", ln))
    cols = re.sub(r"\x1b\[[0-9;]*m", "", lines[header_i]).split()
    known = [c for c in cols if re.fullmatch(r"GPU\d+|NIC\d+|mlx5_\d+", c)]
    out: dict[str, dict[str, str]] = {}
    for ln in lines[header_i + 1 :]:
        cells = re.sub(r"\x1b\[[0-9;]*m", "", ln).split()
        if not cells or not re.fullmatch(r"GPU\d+|NIC\d+|mlx5_\d+", cells[0]):
            if out:
                break
            continue
        out[cells[0]] = dict(zip(known, cells[1 : 1 + len(known)]))
    return out


def parse_topo_nic_legend(text: str) -> dict[str, str]:
    """The 'NIC Legend' block: {NIC0: mlx5_0, ...}."""
    return dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", text, re.M))


def crosscheck(topo: dict[str, Any], matrix: dict[str, dict[str, str]], legend: dict[str, str]) -> list[str]:
    """GPU<->HCA relations where sysfs-derived levels and `nvidia-smi topo -m` disagree."""
    by_hca = {v: k for k, v in legend.items()}
    out = []
    for g in topo["gpus"]:
        row = matrix.get(f"GPU{g['index']}", {})
        for near in g["nearest_hcas"]:
            col = by_hca.get(near["hca"])
            if col and col in row and row[col] != near["level"]:
                out.append(f"GPU{g['index']}-{near['hca']}: sysfs {near['level']}, nvidia-smi {row[col]}")
    return out


def nvidia_smi_crosscheck(topo: dict[str, Any], runner: Any = None) -> list[str]:
    """Warnings where `nvidia-smi topo -m` (when installed) disagrees with the sysfs-derived levels."""
    import shutil
    import subprocess

    if runner is None:
        if not shutil.which("nvidia-smi"):
            return []
        try:
            cp = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30, check=False,
                                env={**os.environ, "LC_ALL": "C"})  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            return [f"nvidia-smi topo -m failed: {e}"]
        if cp.returncode != 0:
            return [f"nvidia-smi topo -m exited {cp.returncode}: {cp.stderr.strip()[:200]}"]
        text = cp.stdout
    else:
        text = runner()
    try:
        matrix = parse_topo_matrix(text)
    except StopIteration:
        return ["nvidia-smi topo -m printed no GPU matrix"]
    return [f"topology disagrees with nvidia-smi: {m}" for m in crosscheck(topo, matrix, parse_topo_nic_legend(text))]


def report(sys_root: str = "/sys", *, node_ip: str | None = None, overrides: dict[str, str] | None = None,
           use_nvml: bool = True, extra_env: dict[str, str] | None = None,
           addresses: dict[str, list[str]] | None = None) -> dict[str, Any]:  # fmt: skip
    """discover + fabric_env + the nvidia-smi cross-check: what the CLI prints and the module returns."""
    check_env_vars(extra_env or {}, "extra_env")
    topo = discover(sys_root, node_ip=node_ip, use_nvml=use_nvml, addresses=addresses)
    out = fabric_env(topo, overrides)
    out["env"].update({k: str(v) for k, v in (extra_env or {}).items()})
    if sys_root == "/sys":
        out["warnings"] += nvidia_smi_crosscheck(topo)
    if not topo["gpus"]:
        out["warnings"].append("no NVIDIA GPU found (sysfs PCI class 0x0302/0x0300, vendor 0x10de)")
    return {"topology": topo, **out}
