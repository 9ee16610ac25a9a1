"""A deployment's GPUs on one node (llmfleet_gpus) and the claims that keep deployments apart.

Several deployments may share a node when each names its GPUs. The engine role resolves the names to
nvidia-smi indexes (PCI bus order, which CUDA follows with CUDA_DEVICE_ORDER=PCI_BUS_ID), hands them to the
unit as CUDA_VISIBLE_DEVICES, and writes a claim per deployment on the node
(<llmfleet_config_dir>/gpus/<deployment>.json: GPUs and ports); a deployment whose GPUs or ports overlap
another's claim is refused before anything is installed. A deployment that names no GPUs claims them all,
as one instance owning every GPU of its nodes always did.
"""

from __future__ import annotations

import re
from typing import Any

UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z-]+$")


class GpuSetError(ValueError):
    """llmfleet_gpus that cannot be used on a node; the message names the value and the fix."""


def _entry(v: Any) -> int | str:
    if isinstance(v, bool):
        raise GpuSetError(f"llmfleet_gpus entry {v!r} is neither a GPU index nor a UUID")
    if isinstance(v, int):
        return v
    s = str(v).strip()
    if s.isdigit():
        return int(s)
    if UUID.match(s):
        return s
    raise GpuSetError(f"llmfleet_gpus entry {v!r} is neither a GPU index (0, 1, ...) nor a UUID (GPU-...)")


def resolve(requested: list | None, gpus_per_node: int, topo_gpus: list[dict] | None, ranks_per_node: int) -> dict:
    """The GPU set of one node: {named, indexes, visible, numa_nodes}.

    named: False when llmfleet_gpus is empty (the whole node, the engine picks its first ranks_per_node GPUs);
    indexes: nvidia-smi indexes, in the order given (= local rank order); visible: CUDA_VISIBLE_DEVICES ('' when
    not named); numa_nodes: each rank's GPU's NUMA node from the topology facts (None where unknown).
    Raises GpuSetError naming what to fix."""
    topo = list(topo_gpus or [])
    by_index = {int(g["index"]): g for g in topo if g.get("index") is not None}
    count = len(topo) if topo else int(gpus_per_node or 0)
    if not requested:
        idx = list(range(ranks_per_node))
        return {"named": False, "indexes": idx, "visible": "",
                "numa_nodes": [by_index.get(i, {}).get("numa_node") for i in idx]}  # fmt: skip
    entries = [_entry(v) for v in requested]
    by_uuid = {g["uuid"]: int(g["index"]) for g in topo if g.get("uuid")}
    idx = []
    for e in entries:
        if isinstance(e, str):
            if e not in by_uuid:
                have = ", ".join(sorted(by_uuid)) or "none: NVML gave no UUIDs here, name the GPUs by index"
                raise GpuSetError(f"llmfleet_gpus names {e}, which is not a GPU of this node (UUIDs: {have})")
            idx.append(by_uuid[e])
        else:
            if count and not 0 <= e < count:
                raise GpuSetError(f"llmfleet_gpus names GPU {e}, but this node has GPUs 0-{count - 1}")
            idx.append(e)
    dup = sorted({i for i in idx if idx.count(i) > 1})
    if dup:
        raise GpuSetError(f"llmfleet_gpus names GPU {', '.join(map(str, dup))} twice ({requested}): one rank per GPU")
    if len(idx) != ranks_per_node:
        raise GpuSetError(
            f"llmfleet_gpus names {len(idx)} GPUs ({requested}), but the deployment runs {ranks_per_node} ranks per "
            "node (llmfleet_tp_size x llmfleet_pp_size / nodes): name exactly one GPU per rank"
        )
    return {"named": True, "indexes": idx, "visible": ",".join(map(str, idx)),
            "numa_nodes": [by_index.get(i, {}).get("numa_node") for i in idx]}  # fmt: skip


def claim(deployment: str, gpu_set: dict, ports: dict[str, Any]) -> dict:
    """What a deployment holds on a node: its GPUs ('all' when it names none) and its TCP ports (0 = none)."""
    return {
        "deployment": deployment,
        "gpus": gpu_set["indexes"] if gpu_set["named"] else "all",
        "ports": {k: int(v) for k, v in sorted(ports.items()) if int(v or 0) > 0},
    }


def conflicts(mine: dict, others: list[dict]) -> list[str]:
    """What my claim shares with the other deployments' claims on this node, one sentence each."""
    out = []
    my_ports = {v: k for k, v in mine["ports"].items()}
    for o in sorted(others, key=lambda c: str(c.get("deployment"))):
        name = o.get("deployment")
        if name == mine["deployment"]:
            continue
        theirs = o.get("gpus")
        if mine["gpus"] == "all" or theirs == "all":
            who = "this deployment names no GPUs (llmfleet_gpus)" if mine["gpus"] == "all" else f"{name} names none"
            out.append(f"GPUs: {who}, so it claims every GPU of the node and cannot share it with {name}: "
                       "name each deployment's GPUs with llmfleet_gpus")  # fmt: skip
        else:
            both = sorted(set(mine["gpus"]) & set(theirs or []))
            if both:
                out.append(f"GPU {', '.join(map(str, both))} already belongs to deployment {name} (its GPUs: "
                           f"{', '.join(map(str, theirs))}): choose others in llmfleet_gpus")  # fmt: skip
        for what, port in sorted((o.get("ports") or {}).items()):
            if int(port) in my_ports:
                out.append(f"port {port} ({my_ports[int(port)]} here) is deployment {name}'s {what} port: "
                           f"set this deployment's {PORT_VARS[my_ports[int(port)]]} to a free port")  # fmt: skip
    return out


# The variable behind each claimed port, for the fix in the message.
PORT_VARS = {"api": "engine_port", "dist": "engine_dist_port", "link": "engine_link_port",
             "router": "engine_pd_router_port", "side_channel": "engine_pd_side_channel_port"}  # fmt: skip
