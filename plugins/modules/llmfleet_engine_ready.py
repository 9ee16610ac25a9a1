#!/usr/bin/python
"""Ansible module (run on the ops host): readiness gate of a multi-node engine (or of a vLLM P/D
deployment through its router, with proof that the KV cache moved); on failure, ordered stop of every
node and the first failed node/rank with its termination record and journal tail."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_engine_ready
short_description: Wait until a deployment answers correctly, or stop it in order and say why
description:
  - Polls every node's unit over SSH (state, restarts, the wrapper's live status with phases) and, once all
    are active, the head's port, C(/v1/models) and one deterministic chat completion. Returns a cold-start
    timeline per node.
  - If a unit fails or I(deadline) passes, stops the head first and then the workers, and fails naming the
    first node (and rank) that failed, with its termination record and journal tail.
  - With I(router) (vLLM prefill/decode disaggregation) every node is an instance of its own (I(nodes[].api_base),
    I(nodes[].pd_role)) and the router a unit on the head; each instance must answer alone, then the question goes
    through the router at I(api_base), and the decode instances' C(/metrics), read just before and after, must show
    C(vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}) rising. An answer computed by the decode
    instance itself (only C(local_compute) rising) fails naming that node. The router is stopped first.
  - Never asks SGLang workers' C(/health) (a dummy that always answers 200).
  - Runs on the ops host (C(delegate_to=localhost), C(become=false)); on the nodes its scripts run as root,
    directly or through C(sudo -n) when the SSH user is not root (passwordless sudo is required then).
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
  - llmfleet.fleet.llmfleet_job
  - llmfleet.fleet.llmfleet_no_diff
options:
  nodes:
    description: The nodes of one deployment (with I(router), every P/D instance); node rank 0 (the head) must be among them.
    type: list
    elements: dict
    required: true
    suboptions:
      name:
        description: Inventory name of the node.
        type: str
        required: true
      rank:
        description: Node rank (0 = the head, which serves the API).
        type: int
        required: true
      ssh:
        description: The OpenSSH argv prefix that reaches the node (C(ConnectTimeout=) is replaced by I(connect_timeout)).
        type: list
        elements: str
        required: true
      api_base:
        description: With I(router), this node's own instance API as the ops host reaches it, e.g. C(http://10.0.0.12:8000).
        type: str
      pd_role:
        description: With I(router), this node's instance role.
        type: str
        choices: [prefill, decode]
  unit:
    description: Unit name on every node.
    type: str
    required: true
  status_file:
    description: The wrapper's live status JSON on the nodes.
    type: str
    required: true
  record_file:
    description: The wrapper's termination record on the nodes.
    type: str
    required: true
  api_base:
    description: The deployment's API as the ops host reaches it, e.g. C(http://10.0.0.11:30000) - the head's, or the router's with I(router).
    type: str
    required: true
  model:
    description: Served model name.
    type: str
    required: true
  api_key:
    description: API key sent as a bearer token (no_log - never logged).
    type: str
  prompt:
    description: Deterministic question asked once every unit is active.
    type: str
    default: "What is 37\u00d719? Reply with only the number."
  expect:
    description: The exact answer.
    type: str
    default: "703"
  deadline:
    description: Seconds to wait for ready.
    type: float
    default: 3600
  poll:
    description: Seconds between polls.
    type: float
    default: 0.5
  stop_timeout:
    description: Bound for each node's stop, in seconds.
    type: float
    default: 300
  journal_lines:
    description: Journal lines of the first failed node.
    type: int
    default: 40
  unreachable_after:
    description: Seconds of failing SSH polls after which a node fails the gate (named, with the SSH error).
    type: float
    default: 30
  connect_timeout:
    description: SSH connect timeout per poll, in seconds.
    type: float
    default: 10
  read_as:
    description:
      - The engine's service user. Files in its state directory are read as that user, never by root (a planted
        symlink gets nothing).
    type: str
  router:
    description: The P/D router's unit on the head (node rank 0); given, the gate runs the P/D checks.
    type: dict
    suboptions:
      unit:
        description: The router's unit name.
        type: str
        required: true
      status_file:
        description: The router wrapper's live status JSON.
        type: str
        required: true
      record_file:
        description: The router wrapper's termination record.
        type: str
        required: true
  require_kv_transfer:
    description:
      - With I(router), fail when the router's answer came without a KV transfer (no decode instance's external_kv_transfer
        prompt tokens rose, three answers in a row) or the metric is missing; false only reports the evidence.
    type: bool
    default: true
  progress_path:
    description:
      - A JSON file the gate rewrites on every poll with each unit's state and start-up phase and the API's last
        problem, for progress lines while it runs as an async job (M(llmfleet.fleet.llmfleet_job_wait) with C(progress=gate)). Put
        it in a private directory; it is written as C(<path>.tmp) and renamed. With I(detach) and no path, the
        job's own, beside its job file in the private job directory (returned as C(progress_path); the wait removes it).
    type: path
  job_timeout:
    description: With I(detach), the job is killed after this many seconds, as an async task's limit would kill it.
    type: int
    default: 21600
attributes:
  check_mode:
    support: partial
    details: In check mode nothing is polled or stopped; the module returns C(ready=false) and C(skipped_in_check_mode=true).
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Readiness gate from the ops host
  llmfleet.fleet.llmfleet_engine_ready:
    nodes:
      - {name: node1, rank: 0, ssh: [ssh, node1]}
      - {name: node2, rank: 1, ssh: [ssh, node2]}
    unit: llmfleet-qwen.service
    status_file: /var/lib/llmfleet/engine/qwen/status.json
    record_file: /var/lib/llmfleet/engine/qwen/termination.json
    api_base: http://10.0.0.11:30000
    model: qwen
    detach: true
  delegate_to: localhost
  become: false
  run_once: true
  register: _gate_job
  changed_when: false

- name: Wait for the readiness gate, showing each node's start
  llmfleet.fleet.llmfleet_job_wait:
    jid: "{{ _gate_job.ansible_job_id }}"
    results_file: "{{ _gate_job.results_file }}"
    what: engine readiness gate
    progress_path: "{{ _gate_job.progress_path }}"
    progress: gate
    # The gate ends itself at its deadline (3600 s by default), then stops the deployment (300 s at most).
    timeout: 4020
  delegate_to: localhost
  become: false
  run_once: true
  register: _gate

- name: P/D readiness gate through the router, with the KV transfer proven
  llmfleet.fleet.llmfleet_engine_ready:
    nodes:
      - {name: node1, rank: 0, ssh: [ssh, node1], api_base: "http://10.0.0.11:8000", pd_role: prefill}
      - {name: node2, rank: 1, ssh: [ssh, node2], api_base: "http://10.0.0.12:8000", pd_role: decode}
    unit: llmfleet-glm.service
    status_file: /var/lib/llmfleet/engine/glm/status.json
    record_file: /var/lib/llmfleet/engine/glm/termination.json
    router:
      unit: llmfleet-glm-router.service
      status_file: /var/lib/llmfleet/engine/glm/router-status.json
      record_file: /var/lib/llmfleet/engine/glm/router-termination.json
    api_base: http://10.0.0.11:30000
    model: glm
    detach: true
  delegate_to: localhost
  become: false
  run_once: true
  register: _pd_gate_job
  changed_when: false
"""

RETURN = r"""
ansible_job_id:
  description: The detached job's id, for M(llmfleet.fleet.llmfleet_job_wait).
  returned: when I(detach) is true, not in check mode
  type: str
results_file:
  description: The detached job's file (async_wrapper's format) that M(llmfleet.fleet.llmfleet_job_wait) reads.
  returned: when I(detach) is true, not in check mode
  type: str
progress_path:
  description: The progress file the detached gate rewrites, for M(llmfleet.fleet.llmfleet_job_wait) with C(progress=gate).
  returned: when I(detach) is true, not in check mode
  type: str
started:
  description: The detached job started.
  returned: when I(detach) is true, not in check mode
  type: bool
finished:
  description: The detached job has not finished yet (always false here).
  returned: when I(detach) is true, not in check mode
  type: bool
ready:
  description: The deployment answered correctly.
  returned: always (with I(detach), in the job's result)
  type: bool
timeline:
  description:
    - C({t0, nodes, head}) - per-node phases and the deployment API's events in seconds from the first unit start.
    - With I(router) also C(instances) (each instance's own port, models and answer events); the router's unit is a
      row of C(nodes) named C(<head>/router) and C(head) holds the router's events and C(kv_transfer_proven).
  returned: always (with I(detach), in the job's result)
  type: dict
kv_transfer:
  description:
    - With I(router), the evidence over the router's last correct answer - C(proven), C(decode) (the decode nodes
      the KV reached), C(metric), C(summary) (one line) and C(nodes), per instance its C(role), the change of
      C(tokens_by_source) (local_compute, local_cache_hit, external_kv_transfer) and of C(nixl) (bytes, transfers,
      failed_transfers, expired_requests).
  returned: with router
  type: dict
elapsed_s:
  description: Seconds the gate waited.
  returned: when the gate ran
  type: float
last_problem:
  description: The last API problem seen while waiting (empty when none).
  returned: when the gate ran
  type: str
answer:
  description: The engine's (correct) answer to I(prompt).
  returned: success
  type: str
reported_at:
  description: Epoch seconds of the verdict.
  returned: when the gate ran
  type: float
kind:
  description: Why the gate failed - C(a unit failed), C(bad answer) or C(deadline).
  returned: failure
  type: str
first_failed:
  description: C({node, node_rank, why, rank, record, journal_tail}) of the first node that failed.
  returned: failure
  type: dict
failed_nodes:
  description: Nodes whose unit failed.
  returned: failure
  type: list
  elements: str
stop:
  description: One row per node of the ordered stop.
  returned: failure
  type: list
  elements: dict
skipped_in_check_mode:
  description: Nothing was polled because of check mode.
  returned: check mode
  type: bool
"""

import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet import jobs
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.gate import (
    DEFAULT_PROMPT,
    Gate,
    PrivilegeError,
    failure_message,
)


def argument_spec() -> dict:
    """The options (a fresh dict each call: AnsibleModule stores defaults by reference)."""
    return {
        "nodes": {
            "type": "list",
            "elements": "dict",
            "required": True,
            "options": {
                "name": {"type": "str", "required": True},
                "rank": {"type": "int", "required": True},
                "ssh": {"type": "list", "elements": "str", "required": True},
                "api_base": {"type": "str"},
                "pd_role": {"type": "str", "choices": ["prefill", "decode"]},
            },
        },
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
        "router": {
            "type": "dict",
            "options": {
                "unit": {"type": "str", "required": True},
                "status_file": {"type": "str", "required": True},
                "record_file": {"type": "str", "required": True},
            },
        },
        "require_kv_transfer": {"type": "bool", "default": True},
        "progress_path": {"type": "path"},
        "detach": {"type": "bool", "default": False},
        "job_timeout": {"type": "int", "default": 21600},
    }


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p = module.params
    if module.check_mode:
        module.exit_json(changed=False, ready=False, skipped_in_check_mode=True, timeline={})
    for n in p["nodes"]:
        # The connect timeout is the module's, whatever the argv prefix was built with.
        n["ssh"] = [a if not str(a).startswith("ConnectTimeout=") else f"ConnectTimeout={int(p['connect_timeout'])}"
                    for a in n["ssh"]]  # fmt: skip
    progress_path, jid = p["progress_path"], None
    if p["detach"] and not progress_path:
        jid = jobs.new_jid()
        progress_path = jobs.progress_file(os.path.join(jobs.job_dir(), jid))
    try:
        gate = Gate(
            p["nodes"], p["unit"], status_file=p["status_file"], record_file=p["record_file"],
            api_base=p["api_base"], model=p["model"],
            api_key=p["api_key"] or None, prompt=p["prompt"], expect=p["expect"], deadline=p["deadline"],
            poll=p["poll"], journal_lines=p["journal_lines"], stop_timeout=p["stop_timeout"],
            unreachable_after=p["unreachable_after"], read_as=p["read_as"], progress_path=progress_path,
            **({"router": p["router"], "require_kv_transfer": p["require_kv_transfer"]} if p["router"] else {}),
        )  # fmt: skip
    except ValueError as e:  # no head (node rank 0) among the nodes, or P/D nodes without api_base / pd_role
        module.fail_json(msg=f"nodes {[n['name'] for n in p['nodes']]}: {e}", ready=False, timeline={})
    if p["detach"]:
        job = jobs.start(lambda: gated(gate), p["job_timeout"], name="llmfleet-gate", jid=jid)
        module.exit_json(changed=False, progress_path=progress_path, **job)
    res = gated(gate)
    if res.get("failed"):
        module.fail_json(**res)
    module.exit_json(**res)


def gated(gate: Gate) -> dict:
    """The module's result: the gate's outcome, a failure (with its message) when the deployment is not ready."""
    try:
        res = gate.wait()
    except PrivilegeError as e:
        return {"failed": True, "changed": False, "msg": str(e), "ready": False, "timeline": {}}
    if res["ready"]:
        return {"changed": False, **res}
    return {"failed": True, "changed": False, "msg": failure_message(res), **res}


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
