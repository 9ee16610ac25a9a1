#!/usr/bin/python
"""Ansible module (run on the ops host): judge preflight measurements of the whole fleet."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_preflight_evaluate
short_description: Judge preflight measurements across nodes and name the odd node
description:
  - Every check is pass / warn / fail with the measured value per node; consistency checks name the node that
    differs from the others. Fails (with the table in the message) when any check fails.
  - Runs anywhere (the preflight role delegates it to the ops host); reads only its options.
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
  - llmfleet.fleet.llmfleet_read_only
options:
  measurements:
    description: Node -> I(measurements) from M(llmfleet.fleet.llmfleet_preflight_info).
    type: dict
    required: true
  ports:
    description: "Node -> C({peer: {port: state}}) from M(llmfleet.fleet.llmfleet_port_check) probes."
    type: dict
    default: {}
  fabric_ips:
    description: Node -> fabric IP.
    type: dict
    default: {}
  expect_gpus:
    description: GPUs are required (false in the lab - no GPU is a warning).
    type: bool
    default: true
  gpus_per_node:
    description: Expected GPU count per node (0 = just equal across nodes).
    type: int
    default: 0
  expect_rdma:
    description: GPUDirect RDMA expected (nvidia_peermem must be loaded).
    type: bool
    default: false
  engine_python:
    description: Set when the NCCL version was measured (it must then match across nodes).
    type: str
  min_free_bytes:
    description: Free bytes needed on the NVMe root.
    type: int
    default: 0
  max_clock_offset_s:
    description: Largest acceptable NTP offset in seconds.
    type: float
    default: 0.1
attributes:
  check_mode:
    details: Reads only its options; runs the same in check mode.
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Judge the fleet
  llmfleet.fleet.llmfleet_preflight_evaluate:
    measurements: "{{ dict(ansible_play_hosts | zip(ansible_play_hosts | map('extract', hostvars, ['_m', 'measurements']))) }}"
  delegate_to: localhost
  run_once: true
"""

RETURN = r"""
rows:
  description: One row per check and node (check, node, value, status, message).
  returned: always
  type: list
  elements: dict
table:
  description: The rows as a text table, problems first.
  returned: always
  type: str
status:
  description: The worst row's status.
  returned: always
  type: str
  choices: [pass, warn, fail]
failed_nodes:
  description: Nodes with a failing check.
  returned: always
  type: list
  elements: str
failed_checks:
  description: Checks that failed on some node.
  returned: always
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.checks.preflight import evaluate, summary, table


def argument_spec() -> dict:
    """The options (a fresh dict each call: AnsibleModule stores defaults by reference)."""
    return {
        "measurements": {"type": "dict", "required": True},
        "ports": {"type": "dict", "default": {}},
        "fabric_ips": {"type": "dict", "default": {}},
        "expect_gpus": {"type": "bool", "default": True},
        "gpus_per_node": {"type": "int", "default": 0},
        "expect_rdma": {"type": "bool", "default": False},
        "engine_python": {"type": "str"},
        "min_free_bytes": {"type": "int", "default": 0},
        "max_clock_offset_s": {"type": "float", "default": 0.1},
    }


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p = dict(module.params)
    measurements = p.pop("measurements")
    rows = evaluate(measurements, p)
    s = summary(rows)
    text = table(rows)
    if s["status"] == "fail":
        module.fail_json(
            msg=f"preflight failed on {', '.join(s['failed_nodes'])} ({', '.join(s['failed_checks'])}):\n{text}",
            rows=rows, table=text, **s,
        )  # fmt: skip
    module.exit_json(changed=False, rows=rows, table=text, **s)


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
