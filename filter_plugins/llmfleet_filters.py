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


def llmfleet_pair_rounds(nodes: list) -> list:
    """Rounds of node pairs (each node at most once per round): every pair exactly once."""
    from llmfleet.collcheck import pair_rounds

    return [[list(p) for p in r] for r in pair_rounds(list(nodes))]


def llmfleet_pick(hostvars_of_one: Mapping, keys: list) -> dict:
    """The subset of one host's variables named by keys (missing ones are None)."""
    return {k: hostvars_of_one.get(k) for k in keys}


def llmfleet_gpu_model(hostvars_of_one: Mapping) -> str | None:
    """GPU model of a node from the topology role's facts (None before topology ran)."""
    gpus = ((hostvars_of_one.get("ansible_facts") or {}).get("llmfleet_topology") or {}).get("gpus") or []
    return gpus[0].get("model") if gpus else None


def llmfleet_collcheck_verdict(by_node: Mapping, floors: Mapping | None = None, ref_bytes: int = 0,
                               models: Mapping | None = None) -> dict:  # fmt: skip
    """Verdict of the three phases from every node's results: {node: {_nccl_check_single,
    _nccl_check_full, _nccl_check_pairs}} -> ok, culprit ranks, bad/slow nodes, bad links, one line each.
    floors: {GPU model substring: GB/s} for the single-node all_reduce busbw at ref_bytes."""
    from llmfleet.collcheck import isolate, judge, slow_nodes

    single = {n: bool((v.get("_nccl_check_single") or {}).get("ok")) for n, v in by_node.items()}
    full_ranks = [r for v in by_node.values() for r in (v.get("_nccl_check_full") or {}).get("ranks", [])]
    full = judge(full_ranks)
    pairs: dict = {}
    for v in by_node.values():
        for p in v.get("_nccl_check_pairs") or []:
            key = tuple(sorted(p["pair"]))
            pairs[key] = pairs.get(key, True) and bool(p["ok"])
    iso = (
        isolate(single, pairs)
        if pairs
        else {"bad_nodes": sorted(n for n, ok in single.items() if not ok), "bad_links": []}
    )
    slow = slow_nodes(
        {n: (v.get("_nccl_check_single") or {}).get("ranks", []) for n, v in by_node.items()},
        dict(floors or {}),
        dict(models or {}),
        int(ref_bytes),
    )
    ok = all(single.values()) and full["ok"] and not slow
    lines = [
        "phase 1 (each node alone): " + ", ".join(f"{n} {'PASS' if o else 'FAIL'}" for n, o in sorted(single.items())),
        f"phase 2 (full world, {len(full_ranks)} ranks): {full['verdict']}",
    ]
    if pairs:
        lines.append(
            "phase 3 (pairs): " + ", ".join(f"{a}+{b} {'PASS' if o else 'FAIL'}" for (a, b), o in sorted(pairs.items()))
        )
    culprits = []
    if full["culprit_ranks"]:
        culprits.append(f"rank(s) {full['culprit_ranks']} contribute wrong values")
    if iso["bad_nodes"]:
        culprits.append(f"bad node(s): {', '.join(iso['bad_nodes'])}")
    if iso["bad_links"]:
        culprits.append(f"bad link(s): {', '.join(iso['bad_links'])}")
    if full["missing_ranks"]:
        culprits.append(f"rank(s) {full['missing_ranks']} never arrived")
    for n, why in sorted(slow.items()):
        culprits.append(f"slow node {n}: {why}")
    verdict = "PASS: every phase exact" if ok else "FAIL: " + ("; ".join(culprits) or full["verdict"])
    lines.append("verdict: " + verdict)
    return {"ok": ok, "verdict": verdict, "lines": lines, "single": single, "full": full, "slow_nodes": slow,
            "pairs": [{"pair": list(k), "ok": v} for k, v in sorted(pairs.items())], **iso,
            "ranks": full_ranks}  # fmt: skip


def llmfleet_engine_plan(spec: Mapping, node_rank: int) -> dict:
    """Everything one node's unit needs: argv, the ExecStart line, the READY rule, whether it serves
    the API, ranks per node and the loader fan-out. Errors name the variable to fix."""
    from llmfleet.engine import (
        PlanError,
        check_layout,
        loader_fanout,
        ready_rule,
        render_argv,
        serves_api,
        shell_line,
        systemd_command_line,
    )

    spec = dict(spec)
    rank = int(node_rank)
    try:
        argv = render_argv(spec, rank)
        nnodes = 1 if spec["profile"] == "vllm_pd" else int(spec.get("nnodes") or 1)
        rpn = check_layout(int(spec.get("tp") or 1), int(spec.get("pp") or 1), nnodes)
    except PlanError as e:
        raise AnsibleFilterError(str(e)) from e
    threads = spec.get("loader_threads") or None
    return {
        "argv": argv,
        "exec_line": systemd_command_line(argv),
        "shell_line": shell_line(argv),
        "ready": ready_rule(spec["profile"], rank, nnodes, rpn, argv),
        "serves_api": serves_api(spec["profile"], rank),
        "ranks_per_node": rpn,
        "nnodes": nnodes,
        "fanout": loader_fanout(
            spec["profile"], nnodes, rpn, int(threads) if threads else None, bool(spec.get("shared_storage"))
        ),
    }


def llmfleet_systemd_line(argv: list) -> str:
    """ExecStart words for argv (quoted for systemd, % and $ escaped)."""
    from llmfleet.engine import systemd_command_line

    return systemd_command_line([str(a) for a in argv])


def llmfleet_cache_env(cache_dir: str) -> dict:
    """Environment that points every JIT/compile cache into the fingerprint directory."""
    from llmfleet.engine import cache_env

    return cache_env(str(cache_dir))


def llmfleet_ssh_argv(hostvars_of_one: Mapping, name: str) -> list:
    """OpenSSH argv that reaches a host the way Ansible does (for controller-side gates)."""
    from llmfleet.gate import ssh_argv

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


class FilterModule:
    def filters(self) -> dict:
        return {
            "llmfleet_duplicates": llmfleet_duplicates,
            "llmfleet_pair_rounds": llmfleet_pair_rounds,
            "llmfleet_pick": llmfleet_pick,
            "llmfleet_collcheck_verdict": llmfleet_collcheck_verdict,
            "llmfleet_gpu_model": llmfleet_gpu_model,
            "llmfleet_engine_plan": llmfleet_engine_plan,
            "llmfleet_systemd_line": llmfleet_systemd_line,
            "llmfleet_ssh_argv": llmfleet_ssh_argv,
            "llmfleet_cache_env": llmfleet_cache_env,
            "llmfleet_gate_groups": llmfleet_gate_groups,
        }
