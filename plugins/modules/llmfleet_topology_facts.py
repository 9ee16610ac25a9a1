#!/usr/bin/python
"""Ansible module: discover GPUs/HCAs/GIDs/NUMA and compute the fabric environment."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_topology_facts
short_description: Discover GPU/HCA/GID/NUMA topology and the NCCL/Gloo/UCX environment for this node
description:
  - Reads sysfs (GPUs by PCI class, HCAs, ports, GID tables, netdevs, NUMA) and NVML when pynvml is importable
    (the NUMA id falls back to sysfs when NVML says "not supported"), cross-checks with C(nvidia-smi topo -m)
    when present.
  - Picks the GPU rails, HCAs sharing a PCIe switch or root complex with a GPU (storage and management HCAs are
    left out and listed in I(non_rail_hcas) with the reason; docs/topology.md gives the rule and its fallbacks),
    and their ACTIVE ports in GPU-affinity order (exact-match C(NCCL_IB_HCA==...)), the RoCE v2 GID whose IPv4 is
    configured on each port's netdev or its bond (never a fixed index), the socket interface carrying the
    fabric IP, and C(NCCL_IB_DISABLE=1) with a warning when no rail port is ACTIVE.
  - Overrides are validated against what exists.
  - Read-only; sets C(ansible_facts.llmfleet_topology). The topology role writes C(/etc/llmfleet/fabric.env)
    from the returned I(env) with a template task; this module writes nothing.
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
  - llmfleet.fleet.llmfleet_read_only
options:
  node_ip:
    description: This node's fabric IP (selects the socket interface and the RoCE GIDs).
    type: str
  sysfs_root:
    description: sysfs to read.
    type: path
    default: /sys
  overrides:
    description: Variables to force (validated against what exists), e.g. C(NCCL_IB_HCA) or C(NCCL_IB_GID_INDEX).
    type: dict
    default: {}
  extra_env:
    description: Variables added as they are (e.g. C(NCCL_NVLS_ENABLE=0)); one-line values only.
    type: dict
    default: {}
  use_nvml:
    description: Use NVML when pynvml is installed.
    type: bool
    default: true
  fabric_env:
    description:
      - The fabric env file the topology role writes. When given, I(fabric_env_now) says how it and its directory
        are now, so the role skips writing what is already as it must be (without following a symlink).
    type: path
attributes:
  facts:
    description: Action returns an C(ansible_facts) dictionary that will update existing host facts.
    support: full
    details: Sets C(ansible_facts.llmfleet_topology).
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Discover the fabric
  llmfleet.fleet.llmfleet_topology_facts:
    node_ip: "{{ llmfleet_fabric_ip }}"

- name: Show the NCCL interface
  ansible.builtin.debug:
    msg: "{{ ansible_facts['llmfleet_topology']['socket_ifname'] }}"
"""

RETURN = r"""
env:
  description: Variables for C(/etc/llmfleet/fabric.env).
  returned: success
  type: dict
warnings_list:
  description: Things an operator should know (ports down, no HCA, GID disagreement); also given as warnings.
  returned: success
  type: list
  elements: str
fabric_env_now:
  description:
    - I(fabric_env) as it is - C(sha1) of its text, and whether it (C(file_ok)) and its directory (C(dir_ok)) are
      root-owned with modes 0644 and 0755. C(sha1) is null when it is missing or not a regular file.
  returned: when I(fabric_env) is given
  type: dict
ansible_facts:
  description: Facts added to the host.
  returned: success
  type: complex
  contains:
    llmfleet_topology:
      description:
        - C({gpus, hcas, netdevs, numa, env, socket_ifname, ib_ports, warnings, rails, non_rail_hcas, rail_rule})
          of this node.
        - I(rails) the HCA names chosen as GPU rails; I(non_rail_hcas) C([{hca, bdf, netdevs, reason}]) the others;
          I(rail_rule) C(pcie-affinity), or the fallback C(no-affinity) / C(no-gpu).
        - Each GPU's I(hca) is its nearest ACTIVE rail (for the engine); each HCA has I(rail) and I(affinity)
          C({gpu, level}).
      returned: success
      type: dict
"""

import hashlib
import os
import socket
import stat

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.checks.topology import (
    OverrideError,
    TopologyError,
    report,
)


def argument_spec() -> dict:
    """The options (a fresh dict each call: AnsibleModule stores defaults by reference)."""
    return {
        "node_ip": {"type": "str"},
        "sysfs_root": {"type": "path", "default": "/sys"},
        "overrides": {"type": "dict", "default": {}},
        "extra_env": {"type": "dict", "default": {}},
        "use_nvml": {"type": "bool", "default": True},
        "fabric_env": {"type": "path"},
    }


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p = module.params
    try:
        out = report(
            p["sysfs_root"],
            node_ip=p["node_ip"],
            overrides={k: str(v) for k, v in p["overrides"].items()},
            use_nvml=p["use_nvml"],
            extra_env=p["extra_env"],
        )
    except OverrideError as e:  # a variable of the topology role is wrong, not the node
        module.fail_json(msg=f"{socket.gethostname()}: {e} (fix topology_{e.source})")
    except TopologyError as e:
        module.fail_json(msg=f"{socket.gethostname()}: {e}")
    for w in out["warnings"]:
        module.warn(f"{socket.gethostname()}: {w}")
    topo = out["topology"]
    facts = {
        "gpus": topo["gpus"],
        "hcas": topo["hcas"],
        "netdevs": topo["netdevs"],
        "numa": {str(k): v for k, v in topo["numa"].items()},
        "env": out["env"],
        "socket_ifname": out["socket_ifname"],
        "ib_ports": out["ib_ports"],
        "warnings": out["warnings"],
    }
    # The rail rule (docs/topology.md): which HCAs are GPU rails, and why the others are not.
    facts.update({k: topo[k] for k in ("rails", "non_rail_hcas", "rail_rule")})
    now = {"fabric_env_now": file_now(p["fabric_env"])} if p["fabric_env"] else {}
    module.exit_json(
        changed=False, env=out["env"], warnings_list=out["warnings"], ansible_facts={"llmfleet_topology": facts}, **now
    )


def file_now(path: str) -> dict:
    """sha1 of a root-owned config file's text and whether it and its directory have the owner and modes the role
    sets (lstat: a symlink is not the file, whatever it points at)."""

    def ok(st: os.stat_result | None, kind: int, mode: int) -> bool:
        return st is not None and stat.S_IFMT(st.st_mode) == kind and stat.S_IMODE(st.st_mode) == mode and \
            st.st_uid == 0 and st.st_gid == 0  # fmt: skip

    def lstat(p: str) -> os.stat_result | None:
        try:
            return os.lstat(p)
        except OSError:
            return None

    st = lstat(path)
    digest = None
    if st is not None and stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:
            digest = hashlib.sha1(f.read()).hexdigest()  # noqa: S324 (a content fingerprint, as Ansible's checksum)
    return {"sha1": digest, "file_ok": ok(st, stat.S_IFREG, 0o644),
            "dir_ok": ok(lstat(os.path.dirname(path) or "."), stat.S_IFDIR, 0o755)}  # fmt: skip


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
