#!/usr/bin/python
"""Ansible module: run this node's ranks of one collective-check world and return their results."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: collective_check
short_description: Run this node's ranks of a collective-check world (NCCL or Gloo)
description:
  - Starts one rank per entry of I(ranks) with the engine's Python (I(python)) and the node's fabric env
    (I(env_file)), waits with a deadline (ranks that outlive it are killed), and returns each rank's JSON
    (wrong-element counts, busbw, culprit ranks, phases of stalled ranks). Fire it async on every node of the
    world at once, then poll. Read-only.
options:
  python: {description: The engine's Python (torch + the NCCL the engine uses)., type: path, required: true}
  pythonpath: {description: Where the llmfleet package lives for that Python., type: path, default: /opt/llmfleet/lib}
  env_file: {description: Fabric env (NCCL/Gloo interface, HCAs, GID)., type: path, default: /etc/llmfleet/fabric.env}
  world: {description: World size., type: int, required: true}
  master: {description: Fabric IP of global rank 0's node., type: str, required: true}
  port: {description: TCPStore port on the master., type: int, required: true}
  ranks: {description: "This node's [global_rank, local_rank] pairs.", type: list, elements: list, required: true}
  backend: {description: nccl or gloo., type: str, choices: [nccl, gloo], default: gloo}
  ops: {description: Collectives., type: list, elements: str, default: [all_reduce, broadcast, sendrecv, all_gather]}
  sizes: {description: Bytes per rank., type: list, elements: str, default: ["8", "64K", "1M"]}
  iters: {description: Timed iterations., type: int, default: 5}
  timeout: {description: Rendezvous timeout (s)., type: float, default: 30}
  op_timeout: {description: Per-collective timeout (s)., type: float, default: 30}
  deadline: {description: Outer watchdog per rank (s)., type: float, default: 120}
  corrupt_rank: {description: Fault injection - this global rank contributes a wrong value., type: int, default: -1}
  delay_ranks: {description: "Fault injection - {global rank: seconds} to start late.", type: dict, default: {}}
  numa_nodes: {description: "NUMA node of each local rank's GPU (from topology facts); ranks are bound with numactl when installed.", type: list, elements: raw, default: []}
author: llmfleet developers
"""

EXAMPLES = r"""
- name: Ranks of the full world
  collective_check:
    python: /opt/engine/bin/python
    world: 32
    master: 10.10.0.11
    port: 29600
    ranks: [[0, 0], [1, 1]]
    backend: nccl
  async: 600
  poll: 0
"""

RETURN = r"""
ranks: {description: One result per local rank., returned: always, type: list}
ok: {description: Every local rank passed., returned: always, type: bool}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.llmfleet.collcheck import read_env_file, run_node_ranks


def build_module() -> AnsibleModule:
    return AnsibleModule(
        argument_spec={
            "python": {"type": "path", "required": True},
            "pythonpath": {"type": "path", "default": "/opt/llmfleet/lib"},
            "env_file": {"type": "path", "default": "/etc/llmfleet/fabric.env"},
            "world": {"type": "int", "required": True},
            "master": {"type": "str", "required": True},
            "port": {"type": "int", "required": True},
            "ranks": {"type": "list", "elements": "list", "required": True},
            "backend": {"type": "str", "choices": ["nccl", "gloo"], "default": "gloo"},
            "ops": {
                "type": "list",
                "elements": "str",
                "default": ["all_reduce", "broadcast", "sendrecv", "all_gather"],
            },
            "sizes": {"type": "list", "elements": "str", "default": ["8", "64K", "1M"]},
            "iters": {"type": "int", "default": 5},
            "timeout": {"type": "float", "default": 30},
            "op_timeout": {"type": "float", "default": 30},
            "deadline": {"type": "float", "default": 120},
            "corrupt_rank": {"type": "int", "default": -1},
            "delay_ranks": {"type": "dict", "default": {}},
            "numa_nodes": {"type": "list", "elements": "raw", "default": []},
        },
        supports_check_mode=True,
    )


def run(module: AnsibleModule) -> None:
    p = module.params
    if module.check_mode:
        module.exit_json(changed=False, ranks=[], ok=True, skipped_in_check_mode=True)
    args = ["--backend", p["backend"], "--ops", ",".join(p["ops"]), "--sizes", ",".join(p["sizes"]),
            "--iters", str(p["iters"]), "--warmup", "1", "--timeout", str(p["timeout"]),
            "--op-timeout", str(p["op_timeout"]), "--corrupt-rank", str(p["corrupt_rank"])]  # fmt: skip
    spec = {
        "python": p["python"],
        "pythonpath": p["pythonpath"],
        "env": read_env_file(p["env_file"]),
        "world": p["world"],
        "master": p["master"],
        "port": p["port"],
        "ranks": [[int(r), int(lr)] for r, lr in p["ranks"]],
        "args": args,
        "deadline": p["deadline"],
        "delay_ranks": {str(k): v for k, v in p["delay_ranks"].items()},
        "numa_nodes": [None if n in (None, "") else int(n) for n in p["numa_nodes"]],
    }
    ranks = run_node_ranks(spec)
    module.exit_json(changed=False, ranks=ranks, ok=all(r.get("ok") for r in ranks))


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
