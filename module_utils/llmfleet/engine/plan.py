"""One node's engine plan: everything its unit needs, composed from llmfleet.engine.command's pure parts
(the argv, the ExecStart and shell lines, the READY rule, whether it serves the API, ranks per node,
its GPUs and the loader fan-out); and the P/D router's (vllm_pd). Stdlib only; the engine role's
llmfleet_engine_plan and llmfleet_router_plan filters call them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .command import (
    ROUTER_READY_RE,
    PlanError,
    check_layout,
    loader_fanout,
    ready_rule,
    render_argv,
    render_router_argv,
    serves_api,
    shell_line,
    systemd_command_line,
)
from .gpuset import GpuSetError, resolve
from .precompile import compile_argv


def node_plan(spec: Mapping, node_rank: int) -> dict[str, Any]:
    """Everything one node's unit needs: argv, the ExecStart line, the READY rule, whether it serves
    the API, ranks per node and the loader fan-out. Raises engine.PlanError naming the variable to fix."""
    spec = dict(spec)
    rank = int(node_rank)
    nnodes = 1 if spec["profile"] == "vllm_pd" else int(spec.get("nnodes") or 1)
    rpn = check_layout(int(spec.get("tp") or 1), int(spec.get("pp") or 1), nnodes, int(spec.get("gpus_per_node") or 0))
    try:
        gpus = resolve(spec.get("gpus"), int(spec.get("gpus_per_node") or 0), spec.get("topo_gpus"), rpn)
    except GpuSetError as e:
        raise PlanError(str(e)) from e
    if gpus["named"]:  # the visible GPUs are the deployment's: their NUMA nodes, in local rank order
        spec["gpu_numa_nodes"] = gpus["numa_nodes"]
    argv = render_argv(spec, rank)
    precompile = None
    if spec.get("deepgemm_precompile"):
        if spec["profile"] != "sglang":
            raise PlanError(
                f"engine_deepgemm_precompile is SGLang's (python -m sglang.compile_deep_gemm); engine_profile="
                f"{spec['profile']} has no such step: set it to false"
            )
        skip = len(spec.get("command") or ["sglang", "serve"])
        timeout = int(spec.get("start_timeout") or 3600)
        precompile = compile_argv(str(spec.get("python") or "python3"), argv, skip, timeout)
    threads = spec.get("loader_threads") or None
    return {
        "argv": argv,
        "exec_line": systemd_command_line(argv),
        "shell_line": shell_line(argv),
        "ready": ready_rule(spec["profile"], rank, nnodes, rpn, argv),
        "serves_api": serves_api(spec["profile"], rank),
        "ranks_per_node": rpn,
        "nnodes": nnodes,
        "gpus": gpus,
        "precompile": precompile,
        "fanout": loader_fanout(
            spec["profile"], nnodes, rpn, int(threads) if threads else None, bool(spec.get("shared_storage"))
        ),
    }


def router_plan(spec: Mapping) -> dict[str, Any]:
    """The P/D router's unit (vllm_pd, on the head): argv, the ExecStart and shell lines, the READY rule
    (one `Router ready` line: every worker answered /health) and the instances it routes to."""
    spec = dict(spec)
    argv = render_router_argv(spec)
    instances = list(spec.get("instances") or [])
    return {
        "argv": argv,
        "exec_line": systemd_command_line(argv),
        "shell_line": shell_line(argv),
        "ready": {"regex": ROUTER_READY_RE, "count": 1},
        "prefill": [i["name"] for i in instances if i.get("role") == "prefill"],
        "decode": [i["name"] for i in instances if i.get("role") == "decode"],
    }
