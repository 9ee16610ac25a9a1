#!/usr/bin/python
"""Ansible module: report a node's identity and capacity (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_node_info
short_description: Report an llmfleet node's identity and capacity
description:
  - Reads hostname, machine-id, boot id, PID 1, kernel, CPU count, memory, NVIDIA GPUs (from sysfs),
    the staging disk and the shared-storage mount of a node.
  - The logic lives in the C(llmfleet.nodeinfo) package module, shipped as module_utils.
  - Read-only.
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
  - llmfleet.fleet.llmfleet_read_only
options:
  nvme_path:
    description: Node-local staging disk mount point.
    type: path
    default: /mnt/nvme
  shared_path:
    description: Shared-storage mount point (model source).
    type: path
    default: /mnt/shared
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Describe the node
  llmfleet.fleet.llmfleet_node_info:
  register: node
"""

RETURN = r"""
node:
  description: Node facts (hostname, machine_id, boot_id, pid1, container, kernel, python, cpus,
    mem_total_bytes, gpus, nvme, shared, llmfleet_version).
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.nodeinfo import gather


def argument_spec() -> dict:
    """The options (a fresh dict each call: AnsibleModule stores defaults by reference)."""
    return {
        "nvme_path": {"type": "path", "default": "/mnt/nvme"},
        "shared_path": {"type": "path", "default": "/mnt/shared"},
    }


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    node = gather(nvme=module.params["nvme_path"], shared=module.params["shared_path"])
    module.exit_json(changed=False, node=node)


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
