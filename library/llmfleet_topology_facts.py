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
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
    support: full
    details: Read-only; runs the same in check mode.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in --diff mode).
    support: none
    details: Changes nothing.
  facts:
    description: Action returns an C(ansible_facts) dictionary that will update existing host facts.
    support: full
    details: Sets C(ansible_facts.llmfleet_topology).
author: llmfleet developers
"""

EXAMPLES = r"""
- name: Discover the fabric
  llmfleet_topology_facts:
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

import socket

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.llmfleet.topology import OverrideError, TopologyError, report


def argument_spec() -> dict:
    """The options (a fresh dict each call: AnsibleModule stores defaults by reference)."""
    return {
        "node_ip": {"type": "str"},
        "sysfs_root": {"type": "path", "default": "/sys"},
        "overrides": {"type": "dict", "default": {}},
        "extra_env": {"type": "dict", "default": {}},
        "use_nvml": {"type": "bool", "default": True},
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
    module.exit_json(
        changed=False, env=out["env"], warnings_list=out["warnings"], ansible_facts={"llmfleet_topology": facts}
    )


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
