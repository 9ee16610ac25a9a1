#!/usr/bin/python
"""Ansible module: measure what preflight compares across nodes (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_preflight_info
short_description: Measure GPUs, driver, CUDA, NCCL, HCAs, limits, disk, clock and name resolution on a node
description:
  - Uses nvidia-smi (C(LC_ALL=C), csv) when installed, sysfs, /proc, systemd and chrony/timedatectl; a missing tool
    gives a null value, never an error.
  - Read-only; returns I(measurements) for M(llmfleet.fleet.llmfleet_preflight_evaluate), not C(ansible_facts).
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
  - llmfleet.fleet.llmfleet_read_only
options:
  sys_root:
    description: sysfs root.
    type: path
    default: /sys
  driver_version_file:
    description: Where the NVIDIA driver version is read when nvidia-smi is absent.
    type: path
    default: /proc/driver/nvidia/version
  nvme_path:
    description: Staging disk whose free space is measured.
    type: path
    default: /mnt/nvme
  peers:
    description: Node name -> fabric IP; each name must resolve to that IP here.
    type: dict
    default: {}
  engine_python:
    description: The engine's Python; its torch's NCCL version is reported (run as I(engine_user)).
    type: path
  engine_env:
    description:
      - The engine's Python or command whose environment is checked - the file, the directories above it, its venv's
        pyvenv.cfg, site-packages and each entry there - for accounts other than root that can change it
        (C(engine_env) in the measurements).
    type: path
  engine_user:
    description:
      - The engine's service account. I(engine_python) runs as that account; an engine environment only it can
        change (besides root) is told apart from one any other account can change.
      - Empty, or an account not created yet - I(engine_python) runs as root only when no other account can change
        it.
    type: str
  clock_source:
    description: A file holding C(chronyc tracking) / C(timedatectl timesync-status) output to use instead of running them.
    type: path
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Measure the node
  llmfleet.fleet.llmfleet_preflight_info:
    peers: "{{ dict(groups.llmfleet_nodes | zip(groups.llmfleet_nodes | map('extract', hostvars, 'llmfleet_fabric_ip'))) }}"
  register: _measured
"""

RETURN = r"""
measurements:
  description:
    - What was measured (gpu_count, driver_version, cuda_version, nccl_version, hca_*, default_memlock,
      nvme_free_bytes, clock_offset_s, resolves, engine_env, ...); a value is null when its tool is missing.
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.checks.preflight import measure


def argument_spec() -> dict:
    """The options (a fresh dict each call: AnsibleModule stores defaults by reference)."""
    return {
        "sys_root": {"type": "path", "default": "/sys"},
        "driver_version_file": {"type": "path", "default": "/proc/driver/nvidia/version"},
        "nvme_path": {"type": "path", "default": "/mnt/nvme"},
        "peers": {"type": "dict", "default": {}},
        "engine_python": {"type": "path"},
        "engine_env": {"type": "path"},
        "engine_user": {"type": "str"},
        "clock_source": {"type": "path"},
    }


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p = module.params
    m = measure(
        sys_root=p["sys_root"],
        driver_version_file=p["driver_version_file"],
        nvme_path=p["nvme_path"],
        peers=p["peers"],
        engine_python=p["engine_python"],
        clock_source=p["clock_source"],
        engine_env=p["engine_env"],
        engine_user=p["engine_user"],
    )
    module.exit_json(changed=False, measurements=m)


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
