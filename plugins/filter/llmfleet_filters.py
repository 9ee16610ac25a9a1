"""Pure helpers for llmfleet templates and assertions."""

from __future__ import annotations

from collections.abc import Mapping

from ansible.errors import AnsibleFilterError


def llmfleet_duplicates(mapping: Mapping) -> dict:
    """{value: [keys...]} for every value that more than one key has (empty values ignored).

    Used to name the nodes that share something that must be unique (fabric IP, machine-id).
    """
    if not isinstance(mapping, Mapping):
        raise AnsibleFilterError(
            f"llmfleet_duplicates expects a mapping of host -> value, got {type(mapping).__name__}"
        )
    seen: dict = {}
    for key, value in mapping.items():
        if value in (None, ""):
            continue
        seen.setdefault(value, []).append(key)
    return {value: sorted(keys) for value, keys in seen.items() if len(keys) > 1}


def llmfleet_node_order(hosts: list, head_hosts: list) -> list:
    """Node order = node rank: the head first, then the other hosts in the order given (play order).
    The one place that decides it: engine node ranks, NCCL check ranks and the stop order."""
    heads = [h for h in head_hosts or [] if h in hosts]
    return heads + [h for h in hosts if h not in heads]


def llmfleet_layout_error(tp: int, pp: int, nnodes: int, gpus_per_node: int) -> str:
    """'' when TP x PP can be placed on nnodes nodes of gpus_per_node GPUs, else what to fix: the
    engine plan's own rule (check_layout), so validation checks exactly what the engine role consumes."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.command import PlanError, check_layout

    try:
        check_layout(int(tp), int(pp), int(nnodes), int(gpus_per_node))
    except (PlanError, ValueError, TypeError) as e:
        return str(e)
    return ""


def llmfleet_gpu_set_error(gpus: list, tp: int, pp: int, nnodes: int, gpus_per_node: int, *, topo_gpus=()) -> str:
    """'' when llmfleet_gpus names one usable GPU per rank of a node, else what to fix (the engine plan's rule)."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.command import PlanError, check_layout
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.gpuset import GpuSetError, resolve

    try:
        rpn = check_layout(int(tp), int(pp), int(nnodes), int(gpus_per_node))
        resolve(list(gpus or []), int(gpus_per_node), list(topo_gpus or []), rpn)
    except (PlanError, GpuSetError, ValueError, TypeError) as e:
        return str(e)
    return ""


def llmfleet_gpu_set(gpus: list, gpus_per_node: int, topo_gpus: list, ranks_per_node: int) -> dict:
    """One node's GPUs for ranks_per_node ranks: {named, indexes, visible, numa_nodes} (engine.gpuset.resolve)."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.gpuset import GpuSetError, resolve

    try:
        return resolve(list(gpus or []), int(gpus_per_node), list(topo_gpus or []), int(ranks_per_node))
    except GpuSetError as e:
        raise AnsibleFilterError(str(e)) from e


def llmfleet_gpu_claim(deployment: str, gpu_set: Mapping, ports: Mapping) -> dict:
    """What a deployment holds on a node: its GPUs ('all' when it names none) and its TCP ports (0 = none)."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.gpuset import claim

    return claim(str(deployment), dict(gpu_set), dict(ports))


def llmfleet_gpu_claim_conflicts(mine: Mapping, others: list) -> list:
    """What this deployment's claim on a node (GPUs, ports) shares with the other deployments' claims there."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.gpuset import conflicts

    return conflicts(dict(mine), [dict(o) for o in others or []])


def llmfleet_pair_rounds(nodes: list) -> list:
    """Rounds of node pairs (each node at most once per round): every pair exactly once."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.checks.nccl_verdict import pair_rounds

    return [[list(p) for p in r] for r in pair_rounds(list(nodes))]


def llmfleet_pick(hostvars_of_one: Mapping, keys: list) -> dict:
    """The subset of one host's variables named by keys (missing ones are None)."""
    return {k: hostvars_of_one.get(k) for k in keys}


def llmfleet_gpu_model(hostvars_of_one: Mapping) -> str | None:
    """GPU model of a node from the topology role's facts (None before topology ran)."""
    gpus = ((hostvars_of_one.get("ansible_facts") or {}).get("llmfleet_topology") or {}).get("gpus") or []
    return gpus[0].get("model") if gpus else None


def llmfleet_nccl_cut_off(by_node: Mapping) -> list:
    """Nodes cut off from the head's rendezvous store in the full world ({node: {_nccl_check_full: ...}})."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.checks.nccl_verdict import cut_off

    return cut_off({n: ((v or {}).get("_nccl_check_full") or {}).get("ranks", []) for n, v in by_node.items()})


def llmfleet_nccl_verdict(by_node: Mapping, floors: Mapping | None = None, ref_bytes: int = 0,
                               models: Mapping | None = None) -> dict:  # fmt: skip
    """Verdict of the three phases from every node's results: {node: {_nccl_check_single,
    _nccl_check_full, _nccl_check_pairs}} -> ok, culprit ranks, bad/slow nodes, bad links, one line each.
    floors: {GPU model substring: GB/s} for the single-node all_reduce busbw at ref_bytes."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.checks.nccl_verdict import fleet_verdict

    return fleet_verdict(by_node, floors, ref_bytes, models)


def llmfleet_engine_plan(spec: Mapping, node_rank: int) -> dict:
    """Everything one node's unit needs: argv, the ExecStart line, the READY rule, whether it serves
    the API, ranks per node and the loader fan-out. Errors name the variable to fix."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.command import PlanError
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.plan import node_plan

    try:
        return node_plan(spec, node_rank)
    except PlanError as e:
        raise AnsibleFilterError(str(e)) from e


def llmfleet_router_plan(spec: Mapping) -> dict:
    """vllm_pd: the P/D router's unit on the head (argv, ExecStart line, READY rule, the instances it
    routes to). Errors name the variable to fix."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.command import PlanError
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.plan import router_plan

    try:
        return router_plan(spec)
    except PlanError as e:
        raise AnsibleFilterError(str(e)) from e


def llmfleet_wrapper_args(wrapper: Mapping, plan: Mapping, router_plan: Mapping | None = None) -> dict:
    """The wrapper's command lines for this node's units (engine.plan.wrapper_args): "exec" for the engine's,
    "router_exec" for the router's, and each option group by name. Errors name the variable to fix."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.command import PlanError
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.plan import wrapper_args

    try:
        return wrapper_args(wrapper, plan, router_plan)
    except PlanError as e:
        raise AnsibleFilterError(str(e)) from e


def llmfleet_engine_profile(name: str) -> dict:
    """engine_profile's profile (llmfleet.engines) as plain data: default_port, engine, separate_instances, ..."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet import engines

    try:
        return engines.get(name).as_dict()
    except engines.UnknownProfile as e:
        raise AnsibleFilterError(str(e)) from e


def llmfleet_engine_bench_tool(name: str, command: list, python: str) -> list:
    """The engine's own serving benchmark from the engine's environment ([] for an engine without one)."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet import engines

    return engines.bench_tool(name, list(command or []), str(python or ""))


def llmfleet_systemd_line(argv: list) -> str:
    """ExecStart words for argv (quoted for systemd, % and $ escaped)."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.command import systemd_command_line

    return systemd_command_line([str(a) for a in argv])


def llmfleet_cache_env(cache_dir: str) -> dict:
    """Environment that points every JIT/compile cache into the fingerprint directory."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.command import cache_env

    return cache_env(str(cache_dir))


def llmfleet_ssh_argv(hostvars_of_one: Mapping, name: str) -> list:
    """OpenSSH argv that reaches a host the way Ansible does (for controller-side gates)."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.gate import ssh_argv

    keys = ("ansible_host", "ansible_user", "ansible_port", "ansible_ssh_private_key_file",
            "ansible_ssh_common_args", "ansible_ssh_extra_args")  # fmt: skip
    host = {k: hostvars_of_one.get(k) for k in keys}
    host["inventory_hostname"] = name
    return ssh_argv(host)


def llmfleet_gate_groups(hostvars: Mapping, nodes: list, separate: bool = False) -> list:
    """Readiness-gate instances: [[{name, rank, ssh}, ...]] in node-rank order; with separate (P/D),
    every node is an instance of its own (its own head)."""
    rows = [{"name": n, "rank": i, "ssh": llmfleet_ssh_argv(hostvars[n], n)} for i, n in enumerate(nodes)]
    return [[dict(r, rank=0)] for r in rows] if separate else [rows]


def llmfleet_pd_gate_nodes(hostvars: Mapping, nodes: list) -> list:
    """vllm_pd readiness gate: every node in node-rank order with its own API as the ops host reaches it
    and its role, [{name, rank, ssh, api_base, pd_role}] (from the engine role's per-host
    _engine_pd_instance fact: {name, role, url, api_base})."""
    rows = []
    for i, n in enumerate(nodes):
        inst = hostvars[n].get("_engine_pd_instance") or {}
        if not inst.get("api_base") or inst.get("role") not in ("prefill", "decode"):
            raise AnsibleFilterError(f"{n}: no P/D instance planned (engine_pd_role prefill|decode and the plan tasks)")
        rows.append({"name": n, "rank": i, "ssh": llmfleet_ssh_argv(hostvars[n], n),
                     "api_base": inst["api_base"], "pd_role": inst["role"]})  # fmt: skip
    return rows


def llmfleet_accept_table(report: Mapping) -> str:
    """The acceptance report (llmfleet accept --json) as the table the CLI prints."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.accept.run import render_table

    return render_table(dict(report))


def llmfleet_engine_record(gates: list, meta: Mapping) -> dict:
    """engine-<deployment>.json for the report: this run's gate results, the failure (if any) up front."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.gate import deployment_record

    return deployment_record(list(gates or []), **dict(meta))


def llmfleet_timeline_table(timeline: Mapping) -> list:
    """The cold-start timeline as fixed-width lines in seconds (play output)."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.gate import timeline_table

    return timeline_table(dict(timeline or {}))


def llmfleet_failed_msg(result) -> str:
    """A failed task's result (ansible_failed_result) as one message: a failed loop's first failed item's."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.failures import failed_message

    return failed_message(result)


class FilterModule:
    def filters(self) -> dict:
        return {
            "llmfleet_accept_table": llmfleet_accept_table,
            "llmfleet_duplicates": llmfleet_duplicates,
            "llmfleet_node_order": llmfleet_node_order,
            "llmfleet_layout_error": llmfleet_layout_error,
            "llmfleet_gpu_set_error": llmfleet_gpu_set_error,
            "llmfleet_gpu_set": llmfleet_gpu_set,
            "llmfleet_gpu_claim": llmfleet_gpu_claim,
            "llmfleet_gpu_claim_conflicts": llmfleet_gpu_claim_conflicts,
            "llmfleet_pair_rounds": llmfleet_pair_rounds,
            "llmfleet_pick": llmfleet_pick,
            "llmfleet_nccl_verdict": llmfleet_nccl_verdict,
            "llmfleet_nccl_cut_off": llmfleet_nccl_cut_off,
            "llmfleet_gpu_model": llmfleet_gpu_model,
            "llmfleet_engine_plan": llmfleet_engine_plan,
            "llmfleet_engine_profile": llmfleet_engine_profile,
            "llmfleet_engine_bench_tool": llmfleet_engine_bench_tool,
            "llmfleet_wrapper_args": llmfleet_wrapper_args,
            "llmfleet_systemd_line": llmfleet_systemd_line,
            "llmfleet_ssh_argv": llmfleet_ssh_argv,
            "llmfleet_cache_env": llmfleet_cache_env,
            "llmfleet_gate_groups": llmfleet_gate_groups,
            "llmfleet_router_plan": llmfleet_router_plan,
            "llmfleet_pd_gate_nodes": llmfleet_pd_gate_nodes,
            "llmfleet_engine_record": llmfleet_engine_record,
            "llmfleet_timeline_table": llmfleet_timeline_table,
            "llmfleet_failed_msg": llmfleet_failed_msg,
        }
