"""Engine launch plans: the command line each node runs (SGLang, vLLM, vLLM P/D, custom), the P/D
router's command line, when a node counts as up, the compile-cache fingerprint, the loader fan-out,
engine-flag checks against the engine's own --help, and systemd ExecStart quoting.

Pure functions over plain data (stdlib only): the engine role's modules and filters call them, and
the golden tests pin the command lines they render for the field reports' deployments.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from typing import Any

from .. import engines
from . import specdecode

# The profiles and everything engine-specific (ports, commands, flags, log lines, routers): llmfleet.engines.


class PlanError(ValueError):
    """A deployment that cannot be rendered; the message names the variable and the fix."""


def check_layout(tp: int, pp: int, nnodes: int, gpus_per_node: int | None = None) -> int:
    """Ranks per node for TP x PP over nnodes (both engines put TP inside a node, PP across)."""
    if tp < 1 or pp < 1 or nnodes < 1:
        raise PlanError(f"llmfleet_tp_size={tp}, llmfleet_pp_size={pp}, nodes={nnodes}: all must be >= 1")
    world = tp * pp
    if world % nnodes:
        raise PlanError(
            f"TP{tp} x PP{pp} = {world} ranks cannot be split evenly over {nnodes} nodes: "
            "set llmfleet_tp_size / llmfleet_pp_size so tp x pp is a multiple of the node count"
        )
    rpn = world // nnodes
    if gpus_per_node is not None and gpus_per_node and rpn > gpus_per_node:
        raise PlanError(
            f"TP{tp} x PP{pp} over {nnodes} nodes = {rpn} ranks per node, but llmfleet_gpus_per_node={gpus_per_node}: "
            "lower llmfleet_tp_size x llmfleet_pp_size or add nodes"
        )
    return rpn


def _loader_config(profile: str, threads: int | None) -> list[str]:
    if threads is None:
        return []
    cfg = (
        {"enable_multithread_load": threads > 1, "num_threads": threads}
        if threads > 1
        else {"enable_multithread_load": False}
    )
    return ["--model-loader-extra-config", json.dumps(cfg, separators=(", ", ": "))]


def _or1(v: Any) -> Any:
    return 1 if v is None or v == "" else v


def speculative_flags(spec: dict[str, Any]) -> list[str]:
    """engine_speculative as this profile's engine flags ([] when unset or engine_speculative_enabled is false);
    refuses the same flags in engine_extra_args (two sources for one setting)."""
    profile, cfg = spec.get("profile"), spec.get("speculative") or {}
    # Ansible's argument spec gives absent sub-options as null: a mapping of nulls is no setting.
    if not isinstance(cfg, dict):
        raise PlanError(f"engine_speculative must be a mapping (method, num_steps, ...), got {cfg!r}")
    if not any(v not in (None, "") for v in cfg.values()):
        return []
    prof = engines.get(profile)
    if not prof.spec_flags:
        raise PlanError(
            f"engine_speculative is set but engine_profile={profile} runs engine_custom_argv as given: put the "
            "engine's speculative flags there, or leave engine_speculative empty"
        )
    given = [
        a.split("=", 1)[0]
        for a in (str(x) for x in spec.get("extra_args") or [])
        if a.startswith("--speculative") or a == "-sc"
    ]
    if given:
        raise PlanError(
            f"engine_extra_args holds {', '.join(sorted(set(given)))} and engine_speculative is set: the role writes "
            "the speculative flags from engine_speculative; remove them from engine_extra_args"
        )
    try:
        return specdecode.render_flags(
            cfg, prof.engine, spec.get("speculative_enabled", True) not in (False, "false", "False")
        )
    except specdecode.SpecError as e:
        raise PlanError(str(e)) from None


def numa_flags(spec: dict[str, Any], profile: str, ranks_per_node: int) -> list[str]:
    """engine_numa_bind=auto: bind each GPU worker to its GPU's NUMA node (topology facts, in GPU index order),
    when the node's GPUs span more than one NUMA node and every one is known; [] otherwise, for an engine without
    NUMA flags (custom), and when engine_extra_args already sets the engine's NUMA flags (the operator's placement
    wins). The engines place their GPU worker processes themselves (ranks are processes the engine spawns, so a
    unit-wide CPUAffinity/NUMAPolicy would put every rank on one node's CPUs)."""
    prof = engines.get(profile)
    if spec.get("numa_bind", "auto") != "auto" or not prof.numa_flags:
        return []
    nodes = list(spec.get("gpu_numa_nodes") or [])
    if prof.numa_per_rank:
        nodes = nodes[:ranks_per_node]
    if len(nodes) < ranks_per_node or any(n is None or int(n) < 0 for n in nodes) or len(set(nodes)) < 2:
        return []
    if any(str(a).split("=", 1)[0] in prof.numa_flags for a in spec.get("extra_args") or []):
        return []
    return list(prof.numa_bind) + [str(int(n)) for n in nodes]


def render_argv(spec: dict[str, Any], node_rank: int) -> list[str]:
    """The argv one node runs. spec keys: profile, command, model_path, served_model_name, tp, pp,
    nnodes, head_addr, dist_port, host, port, dist_timeout, context_length, loader_threads,
    speculative and speculative_enabled (engine_speculative), numa_bind and gpu_numa_nodes (engine_numa_bind,
    the topology's NUMA node per GPU), extra_args, kv_transfer_config and pd_role (vllm_pd), custom_argv
    (custom). The layout, the checks and the flags every engine shares are here; the engine's own words are
    its profile's (llmfleet.engines)."""
    profile = spec.get("profile")
    try:
        prof = engines.get(profile)
    except engines.UnknownProfile as e:
        raise PlanError(str(e)) from None
    extra = [str(a) for a in spec.get("extra_args") or []]
    spec_flags = speculative_flags(spec)
    extra = spec_flags + extra
    if prof.render is None:  # custom: the operator's command as given
        argv = [str(a) for a in spec.get("custom_argv") or []]
        if not argv:
            raise PlanError(f"engine_profile={profile} needs engine_custom_argv (the full command as a list)")
        return argv + extra
    command = [str(c) for c in (spec.get("command") or prof.command)]
    model = spec.get("model_path")
    if not model:
        raise PlanError("engine_model_path is empty: point it at the staged revision (<root>/<model>/current)")
    tp, pp = int(_or1(spec.get("tp"))), int(_or1(spec.get("pp")))
    nnodes = node_count(profile, spec.get("nnodes"))
    check_layout(tp, pp, nnodes)
    if not 0 <= node_rank < nnodes:
        raise PlanError(f"node rank {node_rank} outside 0..{nnodes - 1}")
    extra = numa_flags(spec, profile, tp * pp // nnodes) + extra
    multi = nnodes > 1
    if multi and (not spec.get("head_addr") or not spec.get("dist_port")):
        raise PlanError("a multi-node deployment needs the head's fabric address and engine_dist_port")
    host, port = spec.get("host"), spec.get("port")
    parts = {
        "command": command,
        "model": str(model),
        "tp": tp,
        "pp": pp,
        "nnodes": nnodes,
        "node_rank": node_rank,
        "loader": _loader_config(profile, spec.get("loader_threads")),
        "extra": extra,
        "listen": (["--host", str(host)] if host else []) + (["--port", str(port)] if port else []),
    }
    try:
        return prof.render(spec, parts)
    except engines.ProfileError as e:
        raise PlanError(str(e)) from None


def node_count(profile: str, nnodes: Any) -> int:
    """Nodes one engine instance spans: the play's, or 1 where every node is an instance of its own (vllm_pd)."""
    return 1 if engines.get(profile).separate_instances else int(_or1(nnodes))


def render_router_argv(spec: dict[str, Any]) -> list[str]:
    """The argv of the profile's router on the head (vllm_pd: vllm-router; the profile's router renders it).
    spec keys: profile (default: the profile with a router), command, host, port, instances, startup_timeout,
    extra_args."""
    try:
        return engines.router(spec.get("profile")).render(spec)
    except (engines.ProfileError, engines.UnknownProfile) as e:
        raise PlanError(str(e)) from None


def ready_rule(profile: str, node_rank: int, nnodes: int, ranks_per_node: int, argv: list[str]) -> dict:
    """When the wrapper may send READY=1 for this node: the head when it serves; another node when its
    start-up is done (SGLang: every local rank captured CUDA graphs, or loaded weights when graphs are off;
    vLLM: the node's once-per-node graph / weights line, or the CPU build's KV-cache line)."""
    prof = engines.get(profile)
    if serves_api(profile, node_rank) or not prof.node_up_re:
        return {"regex": prof.serving_re, "count": 1}
    mode = "eager" if prof.no_graph_flag in argv else "graphs"
    return {"regex": prof.node_up_re[mode], "count": max(1, ranks_per_node) if prof.node_up_per_rank else 1}


def serves_api(profile: str, node_rank: int) -> bool:
    """Whether this node answers the OpenAI API (SGLang workers only fake /health)."""
    return node_rank == 0 or engines.get(profile).separate_instances


# ---------------------------------------------------------------------------------------------
# Engine flags against the engine's own --help: llmfleet.engine.helpflags reads the help and argv as the engine
# does (parse_help_flags, argv_flags, unknown_flags); this says what it found.

# Why a flag was refused (helpflags.resolve_flag's "how"), said to the operator after the hints.
_WHY = {
    "ambiguous": "a prefix of more than one option, which the engine refuses",
    "abbreviation": "an abbreviation: spell the option out (a later version can make a prefix ambiguous)",
    "malformed": "a dotted key or value the engine cannot read (dotted keys need an option that takes JSON)",
}


def describe_unknown(problems: list[dict[str, Any]], engine: str) -> str:
    """One sentence naming every flag helpflags.unknown_flags refused, its did-you-mean (option strings the
    help lists) and why when it is not plainly unknown."""
    parts = []
    for p in problems:
        hints = p.get("did_you_mean") or []
        why = _WHY.get(p.get("why") or "unknown")
        text = " ".join(t for t in (f"did you mean {' or '.join(hints)}?" if hints else "", why or "") if t)
        parts.append(f"{p['flag']} ({text})" if text else p["flag"])
    return (
        f"{engine} does not accept: {'; '.join(parts)}. The flags come from the engine's own --help on the head; "
        "fix engine_extra_args (or the engine version) before starting 8 GPUs x N nodes for minutes"
    )


# ---------------------------------------------------------------------------------------------
# Compile caches, loader fan-out


FINGERPRINT_KEYS = (
    "engine",
    "engine_version",
    "kernel_libs",
    "cuda",
    "driver",
    "compute_capability",
    "tp",
    "pp",
    "model_revision",
    "quantization",
    "extra",
)


def fingerprint(inputs: dict[str, Any]) -> str:
    """16 hex digits over the things a JIT/compile cache is only valid for (a cache built for another
    engine/GPU/layout is wrong or rebuilt): engine commit + kernel libs + CUDA/driver + GPU compute
    capability + TP + revision/quantization."""
    canon = {k: inputs.get(k) for k in FINGERPRINT_KEYS}
    return hashlib.sha256(json.dumps(canon, sort_keys=True, default=str).encode()).hexdigest()[:16]


# Every JIT/compile cache the engines and their kernel libraries write, pointed into one directory
# per fingerprint (defaults are scattered under ~/.cache and /tmp and survive incompatible upgrades).
# SGLang 0.5.23 (srt/environ.py) keeps its own caches under SGLANG_CACHE_DIR (~/.cache/sglang) and
# redirects Triton, inductor, CUDA's, TileLang's and FlashInfer's there unless they are set already.
CACHE_ENV = {
    "XDG_CACHE_HOME": "xdg",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "DG_JIT_CACHE_DIR": "deep_gemm",
    "SGLANG_DG_CACHE_DIR": "deep_gemm",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "TVM_FFI_CACHE_DIR": "tvm-ffi",
    "TILELANG_CACHE_DIR": "tilelang",
    "CUDA_CACHE_PATH": "nv",
    # the engines' own cache roots (each profile's cache_env)
    **{var: sub for e in engines.engines() for var, sub in engines.get(e).cache_env.items()},
}


def cache_env(cache_dir: str) -> dict[str, str]:
    """The cache variables, and HOME: the unit's ProtectSystem=strict makes the service user's home
    read-only, and anything that still writes under ~ (a library's ~/.config, ~/.triton) needs a
    writable one; the fingerprint directory is the engine's own and writable."""
    base = cache_dir.rstrip("/")
    return {"HOME": base, **{var: f"{base}/{sub}" for var, sub in CACHE_ENV.items()}}


def loader_fanout(
    profile: str, nnodes: int, ranks_per_node: int, threads: int | None, shared_storage: bool
) -> dict[str, Any]:
    """Concurrent readers of the model files at load time (8 ranks x 8 threads = 64-way on one node in the field)."""
    t = threads if threads is not None else engines.get(profile).loader_threads
    per_node = ranks_per_node * t
    total = per_node * (nnodes if shared_storage else 1)
    where = "shared storage" if shared_storage else "each node's local disk"
    return {
        "threads_per_rank": t,
        "per_node": per_node,
        "readers": total,
        "where": where,
        "formula": (f"{nnodes} nodes x " if shared_storage else "")
        + f"{ranks_per_node} ranks x {t} loader threads = {total} concurrent readers of {where}",
    }


# ---------------------------------------------------------------------------------------------
# systemd


def systemd_quote(arg: str) -> str:
    """One ExecStart word (not the first: its prefix characters are special): systemd expands
    %specifiers and $VARS and splits on spaces, so escape % and $ always and double-quote anything
    beyond a safe set (C-style escapes inside quotes)."""
    s = str(arg).replace("%", "%%").replace("$", "$$")
    if s and re.fullmatch(r"[A-Za-z0-9_@+=:,./%$-]+", s):
        return s
    s = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{s}"'


def systemd_command_line(argv: list[str]) -> str:
    return " ".join(systemd_quote(a) for a in argv)


def shell_line(argv: list[str]) -> str:
    return shlex.join(str(a) for a in argv)
