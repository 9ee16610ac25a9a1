"""One node's engine plan: everything its unit needs, composed from llmfleet.engine.command's pure parts
(the argv, the ExecStart and shell lines, the READY rule, whether it serves the API, ranks per node,
its GPUs and the loader fan-out); and the P/D router's (vllm_pd). Stdlib only; the engine role's
llmfleet_engine_plan and llmfleet_router_plan filters call them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import engines
from .command import (
    PlanError,
    check_layout,
    loader_fanout,
    node_count,
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
    try:
        prof = engines.get(spec.get("profile"))
    except engines.UnknownProfile as e:
        raise PlanError(str(e)) from None
    nnodes = node_count(spec["profile"], spec.get("nnodes"))
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
        if not prof.precompile:
            raise PlanError(
                f"engine_deepgemm_precompile is SGLang's (python -m sglang.compile_deep_gemm); engine_profile="
                f"{spec['profile']} has no such step: set it to false"
            )
        skip = len(spec.get("command") or prof.command)
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
        "ready": {"regex": engines.router(spec.get("profile")).ready_re, "count": 1},
        "prefill": [i["name"] for i in instances if i.get("role") == "prefill"],
        "decode": [i["name"] for i in instances if i.get("role") == "decode"],
    }


# ---------------------------------------------------------------------------------------------
# The wrapper's command line (`llmfleet exec ... -- <engine argv>`, docs/wrapper.md), beside the engine's: the
# engine unit's ExecStart and, for a profile with a router, the router unit's.

# Hosts that mean "every address": the health probe then asks the node's own loopback.
_ANY_ADDRESS = ("", "0.0.0.0", "::", "[::]", "*")  # noqa: S104 (matched, never bound)


def _probe_host(host: Any) -> str:
    return "127.0.0.1" if host is None or str(host) in _ANY_ADDRESS else str(host)


def _on(value: Any) -> bool:
    """An Ansible boolean as the role passes it (true, 'true', 'yes', 1, ...)."""
    return str(value).strip().lower() in ("true", "yes", "on", "1", "y", "t")


def _wrapper_head(record: str, status: str, ready: Mapping, w: Mapping) -> list[str]:
    return [
        "exec", "--record", str(record), "--status", str(status),
        "--ready-regex", str(ready["regex"]), "--ready-count", str(ready["count"]),
        "--stop-timeout", str(max(1, int(w["stop_timeout"]) - 10)),
        "--extend-timeout", str(w["extend_timeout"]),
    ]  # fmt: skip


def _health_common(w: Mapping) -> list[str]:
    """The probe's question and answer (engine_health_prompt/expect, else the readiness gate's) and its key."""
    prompt = w.get("health_prompt") or w.get("ready_prompt")
    expect = w.get("health_expect") or w.get("ready_expect")
    return [
        "--health-model", w["served_model_name"], "--health-interval", str(w["health_interval"]),
        "--health-timeout", str(w["health_timeout"]), "--health-failures", str(w["health_failures"]),
        "--health-prompt", prompt, "--health-expect", expect,
    ] + (["--health-key", "api-key"] if w.get("api_key") else [])  # fmt: skip


def wrapper_args(w: Mapping, plan: Mapping, router_plan: Mapping | None = None) -> dict[str, list]:
    """The wrapper's options for this node, each group by name, and the whole command lines: "exec" (the engine
    unit's) and "router_exec" (the router unit's; [] but on the head of a started profile with a router).

    w (the engine role's _engine_wrapper): profile, node, head (this node is the head), started, api_key (a key is
    set: the credential's name goes in, never the key), record, status, router_record, router_status,
    stop_timeout, extend_timeout; link_on, link_head (host:port), peers (the other nodes, in rank order),
    start_timeout, link_timeout; metrics_dir,
    deployment; secret_env (the engine_secret_env names); health, health_interval, health_timeout,
    health_failures, health_prompt, health_expect, ready_prompt, ready_expect, served_model_name, host, port,
    router_host, router_port. plan: node_plan's; router_plan: router_plan's (the head of a router profile)."""
    try:
        prof = engines.get(w.get("profile"))
    except engines.UnknownProfile as e:
        raise PlanError(str(e)) from None
    node, link_on, started, key = str(w["node"]), _on(w.get("link_on")), _on(w.get("started")), _on(w.get("api_key"))
    w = {**w, "api_key": key}
    # The deployment link (docs/wrapper.md): the head listens, the others join it; no engine starts until every
    # node has joined (the barrier at the head, waiting for its peers up to engine_start_timeout); the fabric key
    # proves each.
    link: list[str] = []
    if link_on:
        head = str(w["link_head"])
        peers = ",".join(str(p) for p in w.get("peers") or [])
        link = ["--link-listen", head, "--link-peers", peers] if _on(w.get("head")) else ["--link-head", head]
        link += ["--link-wait", str(w["start_timeout"]), "--link-node", node]
        link += ["--link-timeout", str(w["link_timeout"]), "--link-key", "fabric-key"]
    # Termination metrics into node_exporter's textfile directory (docs/metrics.md); the node's name comes with
    # the link's options when there is a link.
    metrics: list[str] = []
    if w.get("metrics_dir"):
        metrics = ["--metrics-dir", str(w["metrics_dir"]), "--deployment", str(w["deployment"])]
        metrics += [] if link_on else ["--link-node", node]
    # Secrets by credential name only: the API key the engine's way, each engine_secret_env variable as itself.
    names = sorted(str(v) for v in w.get("secret_env") or [])
    secret = list(prof.secret_args) if key else []
    secret += [a for v in names for a in ("--secret-env", f"{v}=env-{v}")]
    # Serving health: this node's own API (the loopback when it listens everywhere), for a known API only.
    health: list[str] = []
    if _on(w.get("health")) and plan.get("serves_api") and prof.api_known and started:
        health = ["--health-url", f"http://{_probe_host(w.get('host'))}:{w['port']}", *_health_common(w)]
    out = {"link": link, "metrics": metrics, "secret": secret, "health": health}
    out["exec"] = (
        _wrapper_head(w["record"], w["status"], plan["ready"], w)
        + link + metrics + secret + health + ["--"] + [str(a) for a in plan["argv"]]
    )  # fmt: skip
    router = prof.router
    out["router_secret"] = list(router.secret_args) if router is not None and key else []
    out["router_health"] = (
        ["--health-url", f"http://{_probe_host(w.get('router_host'))}:{w['router_port']}", *_health_common(w)]
        if router is not None and _on(w.get("health")) and started
        else []
    )
    out["router_exec"] = []
    if router is not None and _on(w.get("head")) and started and router_plan:
        out["router_exec"] = (
            _wrapper_head(w["router_record"], w["router_status"], router_plan["ready"], w)
            + metrics + out["router_secret"] + out["router_health"] + ["--"] + [str(a) for a in router_plan["argv"]]
        )  # fmt: skip
    return out
