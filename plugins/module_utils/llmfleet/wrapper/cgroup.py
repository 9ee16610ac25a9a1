"""What the wrapper's cgroup says, for the termination record: its systemd unit and its OOM kill counter.

Stdlib only, Python >= 3.8 (copied to nodes). docs/wrapper.md#oom-evidence has the layouts read.
"""

from __future__ import annotations

import os
from typing import Any


def _cgroup_lines(cgroup_text: str) -> list[tuple[str, list[str], str]]:
    out = []
    for line in cgroup_text.splitlines():
        parts = line.strip().split(":", 2)  # hierarchy-id:controllers:path (the path may hold ':')
        if len(parts) == 3:
            out.append((parts[0], parts[1].split(",") if parts[1] else [], parts[2]))
    return out


def oom_counter_file(cgroup_text: str, root: str = "/sys/fs/cgroup") -> tuple[str | None, str]:
    """(file holding this cgroup's oom_kill counter, "") or (None, why not). cgroup v2's memory.events is
    preferred; hybrid hosts mount v2 at <root>/unified without the memory controller, so v1 is the fallback."""
    v2 = v1 = None
    for hid, ctrls, path in _cgroup_lines(cgroup_text):
        if hid == "0" and not ctrls:
            v2 = path
        elif "memory" in ctrls:
            v1 = (",".join(ctrls), path)
    tried = []
    if v2 is not None:
        for base in (root, os.path.join(root, "unified")):
            f = os.path.join(base, v2.lstrip("/"), "memory.events")
            if os.path.isfile(f):
                return f, ""
            tried.append(f)
    if v1 is not None:
        for mount in dict.fromkeys(("memory", v1[0])):
            f = os.path.join(root, mount, v1[1].lstrip("/"), "memory.oom_control")
            if os.path.isfile(f):
                return f, ""
            tried.append(f)
    if not tried:
        return None, "no memory cgroup in /proc/self/cgroup"
    return None, f"no readable oom_kill counter (tried {', '.join(tried)})"


def read_oom_counters(path: str) -> dict[str, int]:
    """The 'key value' lines of memory.events / memory.oom_control (oom_kill, oom, ...)."""
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                out[parts[0]] = int(parts[1])
    return out


def oom_read(cgroup_text: str, root: str) -> tuple[str | None, dict[str, int] | None, str]:
    """(counter file, its counters, "") or (file or None, None, why not)."""
    path, why = oom_counter_file(cgroup_text, root)
    if path is None:
        return None, None, why
    try:
        counters = read_oom_counters(path)
    except OSError as e:
        return path, None, f"cannot read {path}: {e.strerror}"
    if "oom_kill" not in counters:
        return path, None, f"{path} has no oom_kill field (kernel < 4.13?)"
    return path, counters, ""


def oom_evidence(
    source: str | None, before: dict[str, int] | None, after: dict[str, int] | None
) -> dict[str, Any] | None:
    """The record's oom_kill: the counter before and after the run, None when either was unreadable."""
    if before is None or after is None:
        return None
    return {
        "source": source,
        "before": before["oom_kill"],
        "after": after["oom_kill"],
        "delta": after["oom_kill"] - before["oom_kill"],
        # cgroup v2 only: times the cgroup hit its limit (OOM killer invoked, maybe nothing killed)
        "oom_events_delta": after["oom"] - before["oom"] if "oom" in before else None,
    }


def unit_of(cgroup_text: str) -> str | None:
    """The systemd unit (*.service) the wrapper runs in, from its cgroup path; None outside a service."""
    lines = _cgroup_lines(cgroup_text)
    ordered = [p for h, c, p in lines if h == "0" and not c] + [p for h, c, p in lines if "name=systemd" in c]
    for path in ordered + [p for _, _, p in lines]:
        services = [part for part in path.split("/") if part.endswith(".service")]
        if services:
            return services[-1]
    return None
