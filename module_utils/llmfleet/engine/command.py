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

from . import specdecode

PROFILES = ("sglang", "vllm", "vllm_pd", "custom")
DEFAULT_PORT = {"sglang": 30000, "vllm": 8000, "vllm_pd": 8000, "custom": 8000}
DEFAULT_COMMAND = {"sglang": ["sglang", "serve"], "vllm": ["vllm", "serve"], "vllm_pd": ["vllm", "serve"]}
# "router": vLLM's P/D router (vllm-router), whose flags the engine role checks like the engine's.
HELP_ARGS = {"sglang": ["--help"], "vllm": ["--help=all"], "vllm_pd": ["--help=all"], "custom": ["--help"],
             "router": ["--help"]}  # fmt: skip
# Loader threads per rank when the deployment does not say: SGLang enables its multithread loader
# with 8 threads by default (8 ranks x 8 threads = 64 readers per node in the field), vLLM's default
# loader reads with one.
DEFAULT_LOADER_THREADS = {"sglang": 8, "vllm": 1, "vllm_pd": 1, "custom": 1}

# Log phrases that mean "this node's part is up" (the wrapper counts matching lines and sends READY=1).
# The head (the API server): once per API server process. vLLM 0.32's uvicorn line (stderr, untagged) comes
# after `Starting vLLM server on` and exactly once on a one-API-server head (tests/fixtures/engines/*.log).
SERVING_RE = {
    "sglang": r"The server is fired up and ready to roll!",
    "vllm": r"Application startup complete",
}
# A node without the API, SGLang: every rank's scheduler logs its own last start-up line (count: local ranks).
SGLANG_RANK_UP_RE = {"graphs": r"Capture cuda graph end", "eager": r"Load weight end"}
# A node without the API, vLLM (--headless): count 1. The GPU model runner logs `Graph capturing finished` and
# `Model loading took` with logger.info_once, whose default scope is the node's local rank 0 (vllm/logger.py,
# v1/worker/gpu_model_runner.py in 0.32 and 0.33): once per node, so counting one per local rank never
# completes. The CPU build logs neither; its last start-up line is each rank's `Explicitly set (1.0/13.84) GiB
# for KV cache on node 0.` (`Auto set (...) GiB for KV cache on node N, ...` without VLLM_CPU_KVCACHE_SPACE;
# v1/worker/cpu_worker.py, eager or not). The engine core sizes the KV cache on all local workers in one
# collective call, so the first of those lines is as good as the last.
VLLM_NODE_UP_RE = {
    "graphs": r"Graph capturing finished|GiB for KV cache on node",
    "eager": r"Model loading took|GiB for KV cache on node",
}
NO_GRAPH_FLAGS = {"sglang": "--disable-cuda-graph", "vllm": "--enforce-eager"}

# vllm_pd: each node's KV role follows its engine_pd_role (vLLM 0.32 deprecates kv_both for NixlConnector:
# "Please set kv_role='kv_producer' for prefill instances and kv_role='kv_consumer' for decode instances").
PD_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
PD_DEFAULT_CONNECTOR = "NixlConnector"
# vllm-router 0.1.17 logs `Router ready | workers: [...]` once every prefill and decode worker answered
# /health (src/server.rs), i.e. when it can route; it waits up to --worker-startup-timeout-secs for that,
# checking every --worker-startup-check-interval seconds (default 30: a ready deployment would wait for it).
ROUTER_READY_RE = r"Router ready"
ROUTER_CHECK_INTERVAL = 2


class PlanError(ValueError):
    """A deployment that cannot be rendered; the message names the variable and the fix."""


def _flavour(profile: str) -> str:
    return "sglang" if profile == "sglang" else "vllm"


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
    if profile == "custom":
        raise PlanError(
            "engine_speculative is set but engine_profile=custom runs engine_custom_argv as given: put the engine's "
            "speculative flags there, or leave engine_speculative empty"
        )
    flavour = _flavour(profile)
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
            cfg, flavour, spec.get("speculative_enabled", True) not in (False, "false", "False")
        )
    except specdecode.SpecError as e:
        raise PlanError(str(e)) from None


# The engines' own NUMA placement of their GPU worker processes (ranks are processes the engine spawns, so a
# unit-wide CPUAffinity/NUMAPolicy would put every rank on one node's CPUs). vLLM >= 0.33: one NUMA node per
# visible GPU (applied with numactl); SGLang: one per subprocess (local TP rank i uses GPU i).
NUMA_FLAGS = {"vllm": ("--numa-bind", "--numa-bind-nodes", "--numa-bind-cpus"), "sglang": ("--numa-node",)}


def numa_flags(spec: dict[str, Any], profile: str, ranks_per_node: int) -> list[str]:
    """engine_numa_bind=auto: bind each GPU worker to its GPU's NUMA node (topology facts, in GPU index order),
    when the node's GPUs span more than one NUMA node and every one is known; [] otherwise, for custom, and when
    engine_extra_args already sets the engine's NUMA flags (the operator's placement wins)."""
    if spec.get("numa_bind", "auto") != "auto" or profile == "custom":
        return []
    nodes = list(spec.get("gpu_numa_nodes") or [])
    flavour = _flavour(profile)
    if flavour == "sglang":
        nodes = nodes[:ranks_per_node]
    if len(nodes) < ranks_per_node or any(n is None or int(n) < 0 for n in nodes) or len(set(nodes)) < 2:
        return []
    if any(str(a).split("=", 1)[0] in NUMA_FLAGS[flavour] for a in spec.get("extra_args") or []):
        return []
    values = [str(int(n)) for n in nodes]
    return ["--numa-bind", "--numa-bind-nodes", *values] if flavour == "vllm" else ["--numa-node", *values]


def render_argv(spec: dict[str, Any], node_rank: int) -> list[str]:
    """The argv one node runs. spec keys: profile, command, model_path, served_model_name, tp, pp,
    nnodes, head_addr, dist_port, host, port, dist_timeout, context_length, loader_threads,
    speculative and speculative_enabled (engine_speculative), numa_bind and gpu_numa_nodes (engine_numa_bind,
    the topology's NUMA node per GPU), extra_args, kv_transfer_config and pd_role (vllm_pd), custom_argv
    (custom)."""
    profile = spec.get("profile")
    if profile not in PROFILES:
        raise PlanError(f"engine_profile={profile!r}: choose one of {', '.join(PROFILES)}")
    extra = [str(a) for a in spec.get("extra_args") or []]
    spec_flags = speculative_flags(spec)
    extra = spec_flags + extra
    if profile == "custom":
        argv = [str(a) for a in spec.get("custom_argv") or []]
        if not argv:
            raise PlanError("engine_profile=custom needs engine_custom_argv (the full command as a list)")
        return argv + extra
    command = [str(c) for c in (spec.get("command") or DEFAULT_COMMAND[profile])]
    model = spec.get("model_path")
    if not model:
        raise PlanError("engine_model_path is empty: point it at the staged revision (<root>/<model>/current)")
    tp, pp = int(_or1(spec.get("tp"))), int(_or1(spec.get("pp")))
    nnodes = 1 if profile == "vllm_pd" else int(_or1(spec.get("nnodes")))
    check_layout(tp, pp, nnodes)
    if not 0 <= node_rank < nnodes:
        raise PlanError(f"node rank {node_rank} outside 0..{nnodes - 1}")
    extra = numa_flags(spec, profile, tp * pp // nnodes) + extra
    multi = nnodes > 1
    head_addr, dist_port = spec.get("head_addr"), spec.get("dist_port")
    if multi and (not head_addr or not dist_port):
        raise PlanError("a multi-node deployment needs the head's fabric address and engine_dist_port")
    name = spec.get("served_model_name")
    timeout, ctx = spec.get("dist_timeout"), spec.get("context_length")
    host, port = spec.get("host"), spec.get("port")
    listen = (["--host", str(host)] if host else []) + (["--port", str(port)] if port else [])
    if profile == "sglang":
        argv = [*command, "--model-path", str(model)]
        argv += ["--served-model-name", str(name)] if name else []
        argv += ["--tp-size", str(tp)] + (["--pp-size", str(pp)] if pp > 1 else [])
        if multi:
            argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
            argv += ["--dist-init-addr", f"{head_addr}:{dist_port}"]
        argv += ["--dist-timeout", str(timeout)] if timeout else []
        argv += ["--context-length", str(ctx)] if ctx else []
        argv += _loader_config(profile, spec.get("loader_threads"))
        # Non-head SGLang nodes still bind --port for their dummy health server.
        return argv + extra + listen
    return _vllm_argv(profile, spec, command, str(model), node_rank, nnodes, extra, listen)


def _vllm_argv(  # noqa: PLR0917 (private helper of render_argv)
    profile: str, spec: dict[str, Any], command: list[str], model: str, node_rank: int, nnodes: int,
    extra: list[str], listen: list[str],
) -> list[str]:  # fmt: skip
    tp, pp = int(_or1(spec.get("tp"))), int(_or1(spec.get("pp")))
    multi = nnodes > 1
    name, timeout, ctx = spec.get("served_model_name"), spec.get("dist_timeout"), spec.get("context_length")
    headless = multi and node_rank > 0
    argv = [*command, model]
    argv += ["--served-model-name", str(name)] if name else []
    argv += ["--tensor-parallel-size", str(tp)] + (["--pipeline-parallel-size", str(pp)] if pp > 1 else [])
    if multi:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
        argv += ["--master-addr", str(spec.get("head_addr")), "--master-port", str(spec.get("dist_port"))]
        argv += ["--headless"] if headless else []
    argv += ["--distributed-timeout-seconds", str(timeout)] if timeout else []
    argv += ["--max-model-len", str(ctx)] if ctx else []
    argv += _loader_config(profile, spec.get("loader_threads"))
    argv += extra
    if profile == "vllm_pd":
        if any(a == "--kv-transfer-config" or a.startswith(("--kv-transfer-config=", "--kv-transfer-config.",
                                                              "--kv_transfer_config")) for a in extra):  # fmt: skip
            raise PlanError(
                "engine_extra_args holds --kv-transfer-config: with engine_profile=vllm_pd the role writes it "
                "from engine_kv_transfer_config and engine_pd_role; put connector options in engine_kv_transfer_config"
            )
        kv = pd_kv_transfer_config(spec.get("kv_transfer_config"), spec.get("pd_role"))
        argv += ["--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
    return argv + ([] if headless else listen)


def pd_kv_transfer_config(config: dict[str, Any] | None, pd_role: str | None) -> dict[str, Any]:
    """vllm_pd: the --kv-transfer-config of one instance. engine_kv_transfer_config gives the connector
    (NixlConnector when it names none) and its options (kv_buffer_device, kv_connector_extra_config, ...);
    kv_role always follows engine_pd_role (prefill: kv_producer, decode: kv_consumer). A kv_role there that
    says otherwise is refused rather than silently overridden."""
    if pd_role not in PD_KV_ROLE:
        raise PlanError(
            f"engine_pd_role={pd_role!r}: every vllm_pd node needs engine_pd_role prefill or decode (set it per "
            "host, e.g. in host_vars)"
        )
    if config is not None and not isinstance(config, dict):
        raise PlanError(f"engine_kv_transfer_config must be a mapping (the --kv-transfer-config JSON), got {config!r}")
    cfg = {"kv_connector": PD_DEFAULT_CONNECTOR, **(config or {})}
    want = PD_KV_ROLE[pd_role]
    if cfg.get("kv_role") not in (None, want):
        raise PlanError(
            f"engine_kv_transfer_config.kv_role={cfg['kv_role']} contradicts engine_pd_role={pd_role} ({want}): "
            "leave kv_role out, the role sets it from engine_pd_role"
        )
    cfg["kv_role"] = want
    return cfg


def render_router_argv(spec: dict[str, Any]) -> list[str]:
    """vllm_pd: the argv of vLLM's P/D router (vllm-router 0.1.17) on the head. spec keys: command, host,
    port, instances ([{name, role, url}]: every prefill and decode instance as the router reaches it),
    startup_timeout (seconds the router waits for its workers' /health), extra_args."""
    command = [str(c) for c in spec.get("command") or ["vllm-router"]]
    instances = list(spec.get("instances") or [])
    prefill = [i for i in instances if i.get("role") == "prefill"]
    decode = [i for i in instances if i.get("role") == "decode"]
    if not prefill or not decode:
        roles = ", ".join(f"{i.get('name')}={i.get('role') or '(unset)'}" for i in instances) or "no nodes"
        raise PlanError(
            f"engine_profile=vllm_pd needs at least one node with engine_pd_role=prefill and one with decode "
            f"in the play (got {roles})"
        )
    host, port = spec.get("host"), spec.get("port")
    if not port:
        raise PlanError("engine_pd_router_port is unset: the P/D router needs a port")
    argv = [*command, "--vllm-pd-disaggregation"]
    argv += (["--host", str(host)] if host else []) + ["--port", str(port)]
    for i in prefill:
        argv += ["--prefill", str(i["url"])]
    for i in decode:
        argv += ["--decode", str(i["url"])]
    timeout = spec.get("startup_timeout")
    argv += ["--worker-startup-timeout-secs", str(int(timeout))] if timeout else []
    argv += ["--worker-startup-check-interval", str(ROUTER_CHECK_INTERVAL)]
    return argv + [str(a) for a in spec.get("extra_args") or []]


def ready_rule(profile: str, node_rank: int, nnodes: int, ranks_per_node: int, argv: list[str]) -> dict:
    """When the wrapper may send READY=1 for this node: the head when it serves; another node when its
    start-up is done (SGLang: every local rank captured CUDA graphs, or loaded weights when graphs are off;
    vLLM: the node's once-per-node graph / weights line, or the CPU build's KV-cache line)."""
    flavour = _flavour(profile)
    if profile == "custom":
        return {"regex": SERVING_RE["vllm"] + "|" + SERVING_RE["sglang"], "count": 1}
    if node_rank == 0 or profile == "vllm_pd":
        return {"regex": SERVING_RE[flavour], "count": 1}
    mode = "eager" if NO_GRAPH_FLAGS[flavour] in argv else "graphs"
    if flavour == "sglang":
        return {"regex": SGLANG_RANK_UP_RE[mode], "count": max(1, ranks_per_node)}
    return {"regex": VLLM_NODE_UP_RE[mode], "count": 1}


def serves_api(profile: str, node_rank: int) -> bool:
    """Whether this node answers the OpenAI API (SGLang workers only fake /health)."""
    return node_rank == 0 or profile == "vllm_pd"


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
    "SGLANG_CACHE_DIR": "sglang",
    "VLLM_CACHE_ROOT": "vllm",
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
    t = threads if threads is not None else DEFAULT_LOADER_THREADS.get(profile, 1)
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
