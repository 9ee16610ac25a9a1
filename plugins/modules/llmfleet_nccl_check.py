#!/usr/bin/python
"""Ansible module: run this node's ranks of one NCCL check world and return their results."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_nccl_check
short_description: Run this node's ranks of an NCCL check world (NCCL or Gloo)
description:
  - Starts one rank per entry of I(ranks) with the engine's Python (I(python)) and the node's fabric
    environment (I(env_file)), waits with a deadline (ranks that outlive it are killed), and returns each
    rank's JSON (wrong-element counts per source rank, busbw, culprit ranks, phases of stalled ranks).
  - Fire it async on every node of the world at once, then poll.
  - Read-only; the logic lives in C(llmfleet.checks.nccl_check).
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
  - llmfleet.fleet.llmfleet_job
  - llmfleet.fleet.llmfleet_no_diff
options:
  python:
    description: The engine's Python (torch and the NCCL the engine uses).
    type: path
    required: true
  run_as:
    description:
      - The engine's service account (C(llmfleet_user)) - the ranks run as that account, with its groups (the GPU
        access the engine has), so an engine venv that account can write gains it nothing.
      - Empty (or C(root)) - the ranks run as root, and only when no other account can change what I(python)
        executes (the interpreter, the directories above it, its venv's site-packages and what is in it); otherwise
        the task fails naming the path and its owner.
    type: str
    default: ""
  pythonpath:
    description: Where the llmfleet package lives for that Python.
    type: path
    default: /opt/llmfleet/lib
  env_file:
    description: Fabric environment file (NCCL/Gloo interface, HCAs, GID) that the ranks get.
    type: path
    default: /etc/llmfleet/fabric.env
  visible_devices:
    description:
      - The deployment's GPUs on this node (llmfleet_gpus as nvidia-smi indexes, comma-separated). The ranks get them as
        C(CUDA_VISIBLE_DEVICES) with C(CUDA_DEVICE_ORDER=PCI_BUS_ID), so local rank i runs on the i-th of them, as the
        engine's ranks will. Empty = every GPU of the node (local rank i on GPU i).
    type: str
    default: ""
  world:
    description: World size, 1 to 16129 ranks (beyond that the check's values cannot all be exact, and it refuses).
    type: int
    required: true
  master:
    description: Fabric IP of global rank 0's node.
    type: str
    required: true
  port:
    description: TCPStore port on the master.
    type: int
    required: true
  ranks:
    description: This node's C([global_rank, local_rank]) pairs.
    type: list
    elements: list
    required: true
  backend:
    description: Collective backend.
    type: str
    choices: [nccl, gloo]
    default: gloo
  ops:
    description: Collectives to run.
    type: list
    elements: str
    default: [all_reduce, broadcast, sendrecv, all_gather]
  sizes:
    description: Bytes per rank (C(8), C(64K), C(1M), ...).
    type: list
    elements: str
    default: ["8", "64K", "1M"]
  iters:
    description: Timed iterations.
    type: int
    default: 5
  timeout:
    description: Rendezvous timeout in seconds.
    type: float
    default: 30
  unreachable_after:
    description:
      - Seconds without any TCP answer (no connection, no refusal) after which a node is named cut off at once,
        instead of at the end of the rendezvous timeout - rank 0's node by a rank connecting to its store, a
        missing rank's node by rank 0 (with I(hosts)). A refusal is an answer - the node is there, its rank is
        not listening yet.
    type: float
    default: 5
  hosts:
    description:
      - The world's nodes' fabric IPs in node order (each node's ranks consecutive), for rank 0 to probe the
        nodes of ranks that do not arrive. Empty - rank 0 waits out the rendezvous timeout.
    type: list
    elements: str
    default: []
  op_timeout:
    description: Per-collective timeout in seconds.
    type: float
    default: 30
  deadline:
    description: Outer watchdog per rank in seconds.
    type: float
    default: 120
  corrupt_rank:
    description: Fault injection - this global rank contributes a wrong value (C(-1) = none).
    type: int
    default: -1
  delay_ranks:
    description: "Fault injection - C({global rank: seconds}) to start late."
    type: dict
    default: {}
  numa_nodes:
    description:
      - NUMA node of each local rank's GPU (from the topology facts); ranks are bound with C(numactl) when
        it is installed. An empty or null entry leaves that rank unbound.
    type: list
    elements: raw
    default: []
  then:
    description:
      - This node's ranks of a second world, started as soon as this node's ranks of the first have ended, from
        the same processes (torch imported once, no round trip to the controller). The nccl_check role chains
        the full world to each node's single-node world this way.
      - Their deadline is agreed once every rank of that world has arrived, from the slowest first-world rank
        of every node, as the role derives it for a world it starts itself.
      - The first world's options (python, env, backend, ops, sizes, iters, timeouts, NUMA binding) apply;
        I(corrupt_rank) and I(delay_ranks) of the first world do not.
    type: dict
    suboptions:
      world:
        description: World size of the second world.
        type: int
        required: true
      master:
        description: Fabric IP of its global rank 0's node.
        type: str
        required: true
      port:
        description: Its TCPStore port on the master.
        type: int
        required: true
      ranks:
        description: This node's C([global_rank, local_rank]) pairs in it (the same local ranks as I(ranks)).
        type: list
        elements: list
        required: true
      deadline:
        description: The most its ranks may run, in seconds.
        type: float
        required: true
      hosts:
        description: Its nodes' fabric IPs in node order, as I(hosts).
        type: list
        elements: str
        default: []
      deadline_factor:
        description:
          - Its ranks' deadline is the slowest first-world rank's wall time (every node's) times this plus
            I(timeout), at most I(then.deadline). C(0) = I(then.deadline).
        type: float
        default: 3
      corrupt_rank:
        description: Fault injection - this global rank of the second world contributes a wrong value (C(-1) = none).
        type: int
        default: -1
      delay_ranks:
        description: "Fault injection - C({global rank: seconds}) of the second world to start late."
        type: dict
        default: {}
attributes:
  check_mode:
    support: partial
    details: In check mode no rank is started; the module returns C(ranks=[]), C(ok=true) and C(skipped_in_check_mode=true).
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Start this node's ranks of the full world (returns at once; the ranks run detached)
  llmfleet.fleet.llmfleet_nccl_check:
    python: /opt/engine/bin/python
    world: 32
    master: 10.10.0.11
    port: 29600
    ranks: [[0, 0], [1, 1]]
    backend: nccl
    detach: true
  register: _nccl_job
  changed_when: false

- name: Wait for the world's verdict
  llmfleet.fleet.llmfleet_job_wait:
    jid: "{{ _nccl_job.ansible_job_id }}"
    results_file: "{{ _nccl_job.results_file }}"
    what: the full NCCL world
    # The job ends itself at its deadline (120 s by default); this only bounds the wait.
    timeout: 180
  register: _nccl
"""

RETURN = r"""
ranks:
  description: One result per local rank (rank, ok, wrong elements, busbw, culprits, phases, node, gpu).
  returned: always
  type: list
  elements: dict
ok:
  description: Every local rank passed.
  returned: always
  type: bool
then_ranks:
  description: One result per local rank of the second world (I(then)), as I(ranks).
  returned: when I(then) is given
  type: list
  elements: dict
then_ok:
  description: Every local rank of the second world passed.
  returned: when I(then) is given
  type: bool
ansible_job_id:
  description: The detached job's id, for M(llmfleet.fleet.llmfleet_job_wait).
  returned: when I(detach) is true
  type: str
results_file:
  description: The detached job's file on the node (async_wrapper's format) that M(llmfleet.fleet.llmfleet_job_wait) reads.
  returned: when I(detach) is true
  type: str
started:
  description: The detached job started.
  returned: when I(detach) is true
  type: bool
finished:
  description: The detached job has not finished yet (always false here).
  returned: when I(detach) is true
  type: bool
skipped_in_check_mode:
  description: Nothing was run because of check mode.
  returned: check mode
  type: bool
"""

import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet import jobs
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.checks.nccl_check import (
    read_env_file,
    run_node_worlds,
    visible_env,
    world_error,
)
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine_env import EngineEnvError


def argument_spec() -> dict:
    """The options (a fresh dict each call: AnsibleModule stores defaults by reference)."""
    return {
        "python": {"type": "path", "required": True},
        "run_as": {"type": "str", "default": ""},
        "pythonpath": {"type": "path", "default": "/opt/llmfleet/lib"},
        "env_file": {"type": "path", "default": "/etc/llmfleet/fabric.env"},
        "world": {"type": "int", "required": True},
        "master": {"type": "str", "required": True},
        "port": {"type": "int", "required": True},
        "ranks": {"type": "list", "elements": "list", "required": True},
        "backend": {"type": "str", "choices": ["nccl", "gloo"], "default": "gloo"},
        "ops": {"type": "list", "elements": "str", "default": ["all_reduce", "broadcast", "sendrecv", "all_gather"]},
        "sizes": {"type": "list", "elements": "str", "default": ["8", "64K", "1M"]},
        "iters": {"type": "int", "default": 5},
        "timeout": {"type": "float", "default": 30},
        "unreachable_after": {"type": "float", "default": 5},
        "hosts": {"type": "list", "elements": "str", "default": []},
        "op_timeout": {"type": "float", "default": 30},
        "deadline": {"type": "float", "default": 120},
        "corrupt_rank": {"type": "int", "default": -1},
        "delay_ranks": {"type": "dict", "default": {}},
        "numa_nodes": {"type": "list", "elements": "raw", "default": []},
        "visible_devices": {"type": "str", "default": ""},
        "detach": {"type": "bool", "default": False},
        "then": {
            "type": "dict",
            "options": {
                "world": {"type": "int", "required": True},
                "master": {"type": "str", "required": True},
                "port": {"type": "int", "required": True},
                "ranks": {"type": "list", "elements": "list", "required": True},
                "deadline": {"type": "float", "required": True},
                "hosts": {"type": "list", "elements": "str", "default": []},
                "deadline_factor": {"type": "float", "default": 3},
                "corrupt_rank": {"type": "int", "default": -1},
                "delay_ranks": {"type": "dict", "default": {}},
            },
        },
    }


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def pairs_and_numa(ranks: list, numa_nodes: list) -> tuple[list[list[int]], list[int | None]]:
    """I(ranks) as [global, local] int pairs and I(numa_nodes) as ints or None; ValueError names the bad entry."""
    pairs = []
    for entry in ranks:
        try:
            r, lr = entry
            pairs.append([int(r), int(lr)])
        except (TypeError, ValueError):
            raise ValueError(f"ranks: {entry!r} is not a [global_rank, local_rank] pair of whole numbers") from None
    numa = []
    for n in numa_nodes:
        try:
            numa.append(None if n in (None, "") else int(n))
        except (TypeError, ValueError):
            raise ValueError(f"numa_nodes: {n!r} is not a NUMA node number (or empty)") from None
    return pairs, numa


def run(module: AnsibleModule) -> None:
    p = module.params
    try:
        pairs, numa = pairs_and_numa(p["ranks"], p["numa_nodes"])
    except ValueError as e:
        module.fail_json(msg=f"{e} (fix the nccl_check role's rank layout)")
    then = p["then"]
    try:
        then_pairs = pairs_and_numa(then["ranks"], [])[0] if then else []
    except ValueError as e:
        module.fail_json(msg=f"then.{e} (fix the nccl_check role's rank layout)")
    if then and sorted(lr for _, lr in then_pairs) != sorted(lr for _, lr in pairs):
        module.fail_json(msg=f"then.ranks {then_pairs}: not the local ranks of ranks {pairs} (one rank per GPU)")
    for name, world in (("world", p["world"]), ("then.world", then and then["world"])):
        why = world and world_error(world)
        if why:  # before any rank starts: a result that cannot be exact would blame good links
            module.fail_json(msg=f"{name}: {why}")
    if module.check_mode:
        module.exit_json(changed=False, ranks=[], ok=True, skipped_in_check_mode=True)
    args = ["--backend", p["backend"], "--ops", ",".join(p["ops"]), "--sizes", ",".join(p["sizes"]),
            "--iters", str(p["iters"]), "--warmup", "1", "--timeout", str(p["timeout"]),
            "--unreachable-after", str(p["unreachable_after"]),
            "--op-timeout", str(p["op_timeout"]), "--corrupt-rank", str(p["corrupt_rank"])]  # fmt: skip
    spec = {
        "python": p["python"],
        "run_as": p["run_as"],
        "pythonpath": p["pythonpath"],
        "env": {**read_env_file(p["env_file"]), **visible_env(p["visible_devices"])},
        "world": p["world"],
        "master": p["master"],
        "port": p["port"],
        "ranks": pairs,
        "args": args,
        "deadline": p["deadline"],
        "hosts": p["hosts"],
        "delay_ranks": {str(k): v for k, v in p["delay_ranks"].items()},
        "numa_nodes": numa,
    }
    if then:
        spec["then"] = {
            "world": then["world"],
            "master": then["master"],
            "port": then["port"],
            "ranks": then_pairs,
            "deadline": then["deadline"],
            "hosts": then["hosts"],
            "deadline_factor": then["deadline_factor"],
            "args": ["--corrupt-rank", str(then["corrupt_rank"])],
            "delay_ranks": {str(k): v for k, v in then["delay_ranks"].items()},
        }
    if p["detach"]:
        # run_node_worlds bounds itself by the deadlines (every rank group killed past them); this only catches a
        # job that did not, as an async task's limit would.
        limit = p["deadline"] + (then["deadline"] if then else 0) + 120
        module.exit_json(
            changed=False, **jobs.start(lambda: node_result(spec, p["python"]), limit, name="llmfleet-nccl")
        )
    res = node_result(spec, p["python"])
    if res.get("failed"):
        module.fail_json(**res)
    module.exit_json(**res)


def node_result(spec: dict, python: str) -> dict:
    """The module's result: this node's ranks of each world (run_node_worlds), or a failure naming the fix."""
    try:
        worlds = run_node_worlds(spec)
    except EngineEnvError as e:  # root will not run it: the message names the path, its owner and the fix
        return {"failed": True, "changed": False, "msg": f"{os.uname().nodename}: {e}"}
    except OSError as e:  # the engine's Python (or numactl) cannot be started
        who = (f" as {spec['run_as']} (the engine's account: it must be able to run it, as the engine does)"
               if spec.get("run_as") and os.geteuid() == 0 else "")  # fmt: skip
        return {"failed": True, "changed": False,
                "msg": f"cannot start the NCCL check ranks with {python}{who}: {e}; check llmfleet_engine_python"}  # fmt: skip
    ranks = worlds[0]
    more = {"then_ranks": worlds[1], "then_ok": all(r.get("ok") for r in worlds[1])} if "then" in spec else {}
    return {"changed": False, "ranks": ranks, "ok": all(r.get("ok") for r in ranks), **more}


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
