#!/usr/bin/python
"""Ansible module (run on the ops host): readiness gate of a multi-node engine; on failure, ordered
stop of every node and the first failed node/rank with its termination record and journal tail."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: engine_ready
short_description: Wait until a deployment answers correctly, or stop it in order and say why
description:
  - Polls every node's unit over SSH (state, restarts, the wrapper's live status with phases) and, once all
    are active, the head's port, C(/v1/models) and one deterministic chat completion. Returns a cold-start
    timeline per node. If a unit fails or I(deadline) passes, stops the head first and then the workers,
    and fails naming the first node (and rank) that failed, with its termination record and journal tail.
  - Never asks SGLang workers' /health (a dummy that always answers 200).
  - Runs on the ops host (C(delegate_to=localhost), C(become=false)); on the nodes its scripts run as root,
    directly or through C(sudo -n) when the SSH user is not root (passwordless sudo is required then).
options:
  nodes: {description: "[{name, rank, ssh}] - ssh is the OpenSSH argv prefix that reaches the node.", type: list, elements: dict, required: true}
  unit: {description: Unit name on every node., type: str, required: true}
  status_file: {description: The wrapper's live status JSON on the nodes., type: str, required: true}
  record_file: {description: The wrapper's termination record on the nodes., type: str, required: true}
  api_base: {description: "Head API as the ops host reaches it, e.g. http://10.0.0.11:30000.", type: str, required: true}
  model: {description: Served model name., type: str, required: true}
  api_key: {description: API key (never logged)., type: str, no_log: true}
  prompt: {description: Deterministic question., type: str, default: "What is 37\u00d719? Reply with only the number."}
  expect: {description: The exact answer., type: str, default: "703"}
  deadline: {description: Seconds to wait for ready., type: float, default: 3600}
  poll: {description: Seconds between polls., type: float, default: 0.5}
  stop_timeout: {description: Bound for each node's stop (s)., type: float, default: 300}
  journal_lines: {description: Journal lines of the first failed node., type: int, default: 40}
  unreachable_after: {description: "Seconds of failing SSH polls after which a node fails the gate (named, with the SSH error).", type: float, default: 30}
  connect_timeout: {description: SSH connect timeout per poll (s)., type: float, default: 10}
  read_as: {description: "The engine's service user: files in its state directory are read as that user, never by root (a planted symlink gets nothing).", type: str}
author: llmfleet developers
"""

EXAMPLES = r"""
- name: Gate
  engine_ready:
    nodes: [{name: node1, rank: 0, ssh: [ssh, node1]}, {name: node2, rank: 1, ssh: [ssh, node2]}]
    unit: llmfleet-qwen.service
    status_file: /var/lib/llmfleet/engine/qwen/status.json
    record_file: /var/lib/llmfleet/engine/qwen/termination.json
    api_base: http://10.0.0.11:30000
    model: qwen
  delegate_to: localhost
  run_once: true
"""

RETURN = r"""
ready: {description: The deployment answered correctly., returned: always, type: bool}
timeline: {description: Per-node phases and head events (seconds from the first unit start)., returned: always, type: dict}
first_failed: {description: Node, rank, reason, termination record, journal tail., returned: on failure, type: dict}
stop: {description: One row per node of the ordered stop., returned: on failure, type: list}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.llmfleet.gate import DEFAULT_PROMPT, Gate, PrivilegeError, failure_message


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "nodes": {"type": "list", "elements": "dict", "required": True},
            "unit": {"type": "str", "required": True},
            "status_file": {"type": "str", "required": True},
            "record_file": {"type": "str", "required": True},
            "api_base": {"type": "str", "required": True},
            "model": {"type": "str", "required": True},
            "api_key": {"type": "str", "no_log": True},
            "prompt": {"type": "str", "default": DEFAULT_PROMPT},
            "expect": {"type": "str", "default": "703"},
            "deadline": {"type": "float", "default": 3600},
            "poll": {"type": "float", "default": 0.5},
            "stop_timeout": {"type": "float", "default": 300},
            "journal_lines": {"type": "int", "default": 40},
            "unreachable_after": {"type": "float", "default": 30},
            "connect_timeout": {"type": "float", "default": 10},
            "read_as": {"type": "str"},
        },
        supports_check_mode=True,
    )
    p = module.params
    if module.check_mode:
        module.exit_json(changed=False, ready=False, skipped_in_check_mode=True, timeline={})
    for n in p["nodes"]:
        # The connect timeout is the module's, whatever the argv prefix was built with.
        n["ssh"] = [a if not str(a).startswith("ConnectTimeout=") else f"ConnectTimeout={int(p['connect_timeout'])}"
                    for a in n["ssh"]]  # fmt: skip
    gate = Gate(
        p["nodes"], p["unit"], status_file=p["status_file"], record_file=p["record_file"], api_base=p["api_base"],
        model=p["model"],
        api_key=p["api_key"] or None, prompt=p["prompt"], expect=p["expect"], deadline=p["deadline"],
        poll=p["poll"], journal_lines=p["journal_lines"], stop_timeout=p["stop_timeout"],
        unreachable_after=p["unreachable_after"], read_as=p["read_as"],
    )  # fmt: skip
    try:
        res = gate.wait()
    except PrivilegeError as e:
        module.fail_json(msg=str(e), ready=False, timeline={})
    if res["ready"]:
        module.exit_json(changed=False, **res)
    module.fail_json(msg=failure_message(res), **res)


if __name__ == "__main__":
    main()
