"""What a node is, read from /proc, /sys and statvfs (stdlib only: runs inside Ansible modules
and under any node Python >= 3.8). ``root`` lets tests point it at a fake tree."""

from __future__ import annotations

import os
import platform
import socket
from typing import Any

from . import __version__

NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0302", "0x0300")  # 3D controller (datacenter GPUs), VGA


def read_text(path: str, default: str = "") -> str:
    """A small file's text, stripped (a sysfs or procfs attribute); default when it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return default


def meminfo_kib(text: str, key: str = "MemTotal") -> int:
    """Value of one /proc/meminfo key in KiB (0 when absent)."""
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == key:
            return int(rest.split()[0])
    return 0


def mount_options(mountinfo: str, target: str) -> list[str] | None:
    """Per-mount options of the last mount at ``target`` in /proc/self/mountinfo, or None."""
    found = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[4] == target:
            found = fields[5].split(",")
    return found


def nvidia_gpus(sys_root: str = "/sys") -> list[str]:
    """PCI addresses of NVIDIA display/3D devices, from sysfs (no driver needed)."""
    base = os.path.join(sys_root, "bus/pci/devices")
    out = []
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return out
    for bdf in names:
        dev = os.path.join(base, bdf)
        if (
            read_text(os.path.join(dev, "vendor")) == NVIDIA_VENDOR
            and read_text(os.path.join(dev, "class"))[:6] in GPU_CLASSES
        ):
            out.append(bdf)
    return out


def disk(path: str) -> dict[str, Any]:
    try:
        st = os.statvfs(path)
    except OSError as e:
        return {"path": path, "present": False, "error": str(e)}
    return {
        "path": path,
        "present": True,
        "total_bytes": st.f_blocks * st.f_frsize,
        "free_bytes": st.f_bavail * st.f_frsize,
    }


def gather(
    proc_root: str = "/proc", sys_root: str = "/sys", nvme: str = "/mnt/nvme", shared: str = "/mnt/shared"
) -> dict[str, Any]:
    """One node's identity and capacity, for the summary report and preflight."""
    environ1 = read_text(os.path.join(proc_root, "1/environ")).split("\0")
    container = next((e.split("=", 1)[1] for e in environ1 if e.startswith("container=")), "")
    mountinfo = read_text(os.path.join(proc_root, "self/mountinfo"))
    shared_opts = mount_options(mountinfo, shared)
    return {
        "hostname": socket.gethostname(),
        "machine_id": read_text("/etc/machine-id"),
        "boot_id": read_text(os.path.join(proc_root, "sys/kernel/random/boot_id")),
        "pid1": read_text(os.path.join(proc_root, "1/comm")),
        "container": container,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "mem_total_bytes": meminfo_kib(read_text(os.path.join(proc_root, "meminfo"))) * 1024,
        "gpus": nvidia_gpus(sys_root),
        "nvme": disk(nvme),
        "shared": {
            "path": shared,
            "mounted": shared_opts is not None,
            "read_only": bool(shared_opts and "ro" in shared_opts),
        },
        "llmfleet_version": __version__,
    }
