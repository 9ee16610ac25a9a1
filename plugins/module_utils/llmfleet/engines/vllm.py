"""vLLM (`vllm serve`, 0.32 / 0.33), and vLLM P/D (prefill and decode instances of vLLM behind vllm-router):
everything llmfleet knows about them, as two profiles of one engine."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from .base import MOE_COST, Profile, ProfileError, Router, StartRule

# The fit check's breakdown: real formats of vLLM 0.32.0 as installed, with the source of each.
BREAKDOWN = (
    # vllm/v1/worker/gpu_model_runner.py: "Model loading took %s GiB memory and %.6f seconds" (format_gib: 2 dp)
    (re.compile(r"Model loading took (-?[\d.]+) GiB memory"), lambda m: {"weights_gib": float(m[1])}),
    # vllm/v1/worker/gpu_worker.py: "Available KV cache memory: %s GiB"
    (re.compile(r"Available KV cache memory: (-?[\d.]+) GiB"), lambda m: {"kv_gib": float(m[1])}),
    # vllm/v1/core/kv_cache_utils.py: "%s KV cache size: %s tokens, Maximum concurrency for %s tokens per request:
    # %.2fx" (pools: GPU, CPU, "GPU + host"; numbers with thousands separators)
    (
        re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x"),
        lambda m: {
            "kv_tokens": int(m[1].replace(",", "")),
            "max_model_len": int(m[2].replace(",", "")),
            "max_concurrency": float(m[3]),
        },
    ),
    # vllm/v1/worker/gpu_model_runner.py: "Graph capturing finished in %.0f secs, took %.2f GiB"
    (
        re.compile(r"Graph capturing finished in \d+ secs, took (-?[\d.]+) GiB"),
        lambda m: {"graph_gib": float(m[1])},
    ),
    # vllm/v1/worker/cpu_worker.py (CPU build): "Explicitly set (1.0/13.84) GiB for KV cache on node 0."
    (
        re.compile(r"(?:Explicitly|Auto) set \(([\d.]+)/[\d.]+\) GiB for KV cache on node"),
        lambda m: {"kv_gib": float(m[1])},
    ),
)

# vllm_pd: each node's KV role follows its engine_pd_role (vLLM 0.32 deprecates kv_both for NixlConnector:
# "Please set kv_role='kv_producer' for prefill instances and kv_role='kv_consumer' for decode instances").
PD_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
PD_DEFAULT_CONNECTOR = "NixlConnector"


# The start-up scan's rules for this engine's lines (llmfleet.engine.startscan), each pattern the engine's own
# format string at the version and file named beside it.
START_RULES = (
    # vllm/model_executor/layers/fused_moe/fused_moe.py get_moe_configs (0.32.0): logger.warning_once(
    #   "Using default MoE config. Performance might be sub-optimal! Config file not found at %s", paths)
    StartRule(
        "vllm-moe-default-config",
        "vllm",
        re.compile(r"Using default MoE config\. Performance might be sub-optimal! Config file not found at (.+)$"),
        "no tuned fused-MoE config for this GPU, expert shape and dtype",
        MOE_COST,
        "tune it on one of these GPUs with vLLM's benchmarks/kernels/benchmark_moe.py --model <checkpoint> "
        "--tp-size <TP> --dtype fp8_w8a8 (or auto) --tune, put the JSON (the file name in the line) in a directory "
        "and set VLLM_TUNED_CONFIG_FOLDER to it in engine_env",
        place=1,
    ),
    # vllm/model_executor/layers/mamba/ops/mamba_ssm.py get_ssm_configs (0.32.0): "Using default Mamba SSU config.
    #   Performance might be sub-optimal! Config file not found at %s"
    StartRule(
        "vllm-mamba-default-config",
        "vllm",
        re.compile(
            r"Using default Mamba SSU config\. Performance might be sub-optimal! Config file not found at (.+)$"
        ),
        "no tuned selective-state-update config (linear-attention / Mamba layers) for this GPU",
        "the state-update kernel runs with a heuristic launch config; slower, by an amount this tool does not measure",
        "benchmarks/kernels/benchmark_selective_state_update.py --save-configs (vLLM's own hint in mamba_ssm.py), "
        "then VLLM_TUNED_CONFIG_FOLDER",
        place=5,
    ),
    # vllm/platforms/cuda.py get_attn_backend_cls (0.32.0): "--block-size %d precluded higher-priority backend(s)
    #   %s. Using %s instead, which may result in reduced performance. ..."
    StartRule(
        "vllm-attention-backend-block-size",
        "vllm",
        re.compile(r"--block-size \d+ precluded higher-priority backend\(s\) (.+?)\. Using (\S+) instead"),
        "--block-size ruled out the preferred attention backend; a lower-priority one runs",
        "vLLM's own words: 'may result in reduced performance'; this tool does not measure how much",
        "drop --block-size from engine_extra_args so vLLM picks the block size its best backend needs",
        place=6,
    ),
    # vllm/v1/attention/backends/fa_utils.py get_flash_attn_version (0.32.0): "Cannot use FA version 3 ...,
    #   defaulting to FA version 2." / "FA4's Blackwell head_size=256 kernel does not support %s, defaulting to FA
    #   version 2."
    StartRule(
        "vllm-flash-attention-fallback",
        "vllm",
        re.compile(r"(?:Cannot use FA version \d.*?|kernel does not support .*?), defaulting to FA version"),
        "FlashAttention fell back to an older kernel generation (FA3/FA4 not usable for this model or setting)",
        "an older attention kernel for this GPU generation; slower, by an amount this tool does not measure",
        "the line names the reason (ALiBi, batch invariance, a head size, Blackwell): change that setting if the "
        "model allows it, else accept the fallback",
        place=7,
    ),
    # vllm/model_executor/layers/quantization/utils/marlin_utils_fp8.py (0.32.0): "Your GPU does not have native
    #   support for FP8 computation but FP8 quantization is being used. Weight-only FP8 compression will be used
    #   leveraging the Marlin kernel. This may degrade performance for compute-heavy workloads."
    StartRule(
        "vllm-fp8-marlin-fallback",
        "vllm",
        re.compile(r"Your GPU does not have native support for FP8 computation"),
        "the GPU has no FP8 tensor cores: FP8 weights are dequantized in a weight-only Marlin kernel",
        "vLLM's own words: 'may degrade performance for compute-heavy workloads'; this tool does not measure how much",
        "FP8 compute needs compute capability 8.9 or newer (Ada, Hopper: H20/H100/H200); on older GPUs serve a BF16 "
        "or INT4/INT8 checkpoint",
        place=8,
    ),
    # vllm/distributed/device_communicators/custom_all_reduce.py (0.32.0): "Custom allreduce is disabled because
    #   it's not supported on more than two PCIe-only GPUs." / "because your platform lacks GPU P2P capability or
    #   P2P test failed." / "due to an unsupported world size: %d." (the "missing custom allreduce library" line
    #   is the CPU build and is not matched)
    StartRule(
        "vllm-custom-allreduce-disabled",
        "vllm",
        re.compile(
            r"Custom allreduce is disabled (?:because it's not supported on more than two PCIe|because your "
            r"platform lacks GPU P2P|due to an unsupported world size)"
        ),
        "vLLM's custom all-reduce is off: every TP all-reduce goes through NCCL",
        "small (decode-size) all-reduces are slower through NCCL, by an amount this tool does not measure",
        "P2P: check `nvidia-smi topo -p2p r` and that fabricmanager runs (NVSwitch systems); world size: expected "
        "for TP sizes vLLM's kernel does not support, nothing to fix",
        place=9,
    ),
    # vllm/config/vllm.py (0.32.0): logger.info_once("Cudagraph is disabled under eager mode")
    StartRule(
        "vllm-eager-mode",
        "vllm",
        re.compile(r"Cudagraph is disabled under eager mode"),
        "--enforce-eager: CUDA graphs are off",
        "decode runs without CUDA graphs (kernel launch overhead per step); slower, by an amount this tool does not "
        "measure",
        "drop --enforce-eager from engine_extra_args unless debugging",
        place=13,
    ),
    # vllm/v1/worker/gpu_worker.py (0.32.0): "CUDA graph memory profiling is disabled
    #   (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0). Without it, CUDA graph memory is not accounted for ..."
    StartRule(
        "vllm-cudagraph-memory-unprofiled",
        "vllm",
        re.compile(r"CUDA graph memory profiling is disabled \(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0\)"),
        "the KV cache was sized without counting CUDA-graph memory",
        "not speed: an out-of-memory risk once graphs are captured (vLLM's own warning)",
        "unset VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS, or lower --gpu-memory-utilization as the line suggests",
        place=14,
    ),
)


def render(spec: Mapping[str, Any], parts: Mapping[str, Any]) -> list[str]:
    """`vllm serve` for one node, or one P/D instance (parts: llmfleet.engine.command.render_argv's)."""
    tp, pp, nnodes, node_rank = parts["tp"], parts["pp"], parts["nnodes"], parts["node_rank"]
    extra = parts["extra"]
    multi = nnodes > 1
    name, timeout, ctx = spec.get("served_model_name"), spec.get("dist_timeout"), spec.get("context_length")
    headless = multi and node_rank > 0
    argv = [*parts["command"], parts["model"]]
    argv += ["--served-model-name", str(name)] if name else []
    argv += ["--tensor-parallel-size", str(tp)] + (["--pipeline-parallel-size", str(pp)] if pp > 1 else [])
    if multi:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
        argv += ["--master-addr", str(spec.get("head_addr")), "--master-port", str(spec.get("dist_port"))]
        argv += ["--headless"] if headless else []
    argv += ["--distributed-timeout-seconds", str(timeout)] if timeout else []
    argv += ["--max-model-len", str(ctx)] if ctx else []
    argv += parts["loader"]
    argv += extra
    if spec.get("profile") == PD_PROFILE.name:
        if any(
            a == "--kv-transfer-config"
            or a.startswith(("--kv-transfer-config=", "--kv-transfer-config.", "--kv_transfer_config"))
            for a in extra
        ):
            raise ProfileError(
                "engine_extra_args holds --kv-transfer-config: with engine_profile=vllm_pd the role writes it "
                "from engine_kv_transfer_config and engine_pd_role; put connector options in engine_kv_transfer_config"
            )
        kv = pd_kv_transfer_config(spec.get("kv_transfer_config"), spec.get("pd_role"))
        argv += ["--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
    return argv + ([] if headless else parts["listen"])


def pd_kv_transfer_config(config: Mapping[str, Any] | None, pd_role: str | None) -> dict[str, Any]:
    """vllm_pd: the --kv-transfer-config of one instance. engine_kv_transfer_config gives the connector
    (NixlConnector when it names none) and its options (kv_buffer_device, kv_connector_extra_config, ...);
    kv_role always follows engine_pd_role (prefill: kv_producer, decode: kv_consumer). A kv_role there that
    says otherwise is refused rather than silently overridden."""
    if pd_role not in PD_KV_ROLE:
        raise ProfileError(
            f"engine_pd_role={pd_role!r}: every vllm_pd node needs engine_pd_role prefill or decode (set it per "
            "host, e.g. in host_vars)"
        )
    if config is not None and not isinstance(config, dict):
        raise ProfileError(
            f"engine_kv_transfer_config must be a mapping (the --kv-transfer-config JSON), got {config!r}"
        )
    cfg = {"kv_connector": PD_DEFAULT_CONNECTOR, **(config or {})}
    want = PD_KV_ROLE[pd_role]
    if cfg.get("kv_role") not in (None, want):
        raise ProfileError(
            f"engine_kv_transfer_config.kv_role={cfg['kv_role']} contradicts engine_pd_role={pd_role} ({want}): "
            "leave kv_role out, the role sets it from engine_pd_role"
        )
    cfg["kv_role"] = want
    return cfg


def render_router_argv(spec: Mapping[str, Any]) -> list[str]:
    """vllm_pd: the argv of vLLM's P/D router (vllm-router 0.1.17) on the head. spec keys: command, host,
    port, instances ([{name, role, url}]: every prefill and decode instance as the router reaches it),
    startup_timeout (seconds the router waits for its workers' /health), extra_args."""
    command = [str(c) for c in spec.get("command") or ROUTER.command]
    instances = list(spec.get("instances") or [])
    prefill = [i for i in instances if i.get("role") == "prefill"]
    decode = [i for i in instances if i.get("role") == "decode"]
    if not prefill or not decode:
        roles = ", ".join(f"{i.get('name')}={i.get('role') or '(unset)'}" for i in instances) or "no nodes"
        raise ProfileError(
            f"engine_profile=vllm_pd needs at least one node with engine_pd_role=prefill and one with decode "
            f"in the play (got {roles})"
        )
    host, port = spec.get("host"), spec.get("port")
    if not port:
        raise ProfileError("engine_pd_router_port is unset: the P/D router needs a port")
    argv = [*command, "--vllm-pd-disaggregation"]
    argv += (["--host", str(host)] if host else []) + ["--port", str(port)]
    for i in prefill:
        argv += ["--prefill", str(i["url"])]
    for i in decode:
        argv += ["--decode", str(i["url"])]
    timeout = spec.get("startup_timeout")
    argv += ["--worker-startup-timeout-secs", str(int(timeout))] if timeout else []
    argv += ["--worker-startup-check-interval", str(ROUTER.check_interval)]
    return argv + [str(a) for a in spec.get("extra_args") or []]


PROFILE = Profile(
    name="vllm",
    engine="vllm",
    label="vLLM",
    default_port=8000,
    command=("vllm", "serve"),
    help_args=("--help=all",),
    loader_threads=1,  # vLLM's default loader reads with one
    # The head (the API server): once per API server process. vLLM 0.32's uvicorn line (stderr, untagged) comes
    # after `Starting vLLM server on` and exactly once on a one-API-server head (tests/fixtures/engines/*.log).
    serving_re=r"Application startup complete",
    # The loader logs `Loading weights took` (CPU and GPU builds), the GPU model runner then `Model loading took`;
    # the CPU build prints no `Model loading took` or CUDA graph lines, --enforce-eager captures no graphs.
    phases={
        "dist_init": r"distributed_init_method=",
        "dist_ready": r"rank \d+ in world size \d+ is assigned as",
        "loading": r"Starting to load model",
        "loaded": r"Loading weights took|Model loading took",
        "warmup": r"Capturing CUDA graphs",
        "warm": r"Graph capturing finished",
    },
    # A node without the API (--headless): count 1. The GPU model runner logs `Graph capturing finished` and
    # `Model loading took` with logger.info_once, whose default scope is the node's local rank 0 (vllm/logger.py,
    # v1/worker/gpu_model_runner.py in 0.32 and 0.33): once per node, so counting one per local rank never
    # completes. The CPU build logs neither; its last start-up line is each rank's `Explicitly set (1.0/13.84) GiB
    # for KV cache on node 0.` (`Auto set (...) GiB for KV cache on node N, ...` without VLLM_CPU_KVCACHE_SPACE;
    # v1/worker/cpu_worker.py, eager or not). The engine core sizes the KV cache on all local workers in one
    # collective call, so the first of those lines is as good as the last.
    node_up_re={
        "graphs": r"Graph capturing finished|GiB for KV cache on node",
        "eager": r"Model loading took|GiB for KV cache on node",
    },
    node_up_per_rank=False,
    no_graph_flag="--enforce-eager",
    render=render,
    # vLLM >= 0.33: one NUMA node per visible GPU (applied with numactl).
    numa_flags=("--numa-bind", "--numa-bind-nodes", "--numa-bind-cpus"),
    numa_bind=("--numa-bind", "--numa-bind-nodes"),
    spec_flags=("--speculative-config",),
    fit_flags={
        "fraction": "--gpu-memory-utilization",
        "max_len": "--max-model-len",
        "seqs": "--max-num-seqs",
        "kv_fp8": "--kv-cache-dtype fp8",
    },
    fit_breakdown=BREAKDOWN,
    argv_reader="flexible",
    # "(Worker_TP3 pid=…)" / "(Worker_PP1_TP3 pid=…)"
    rank_re=re.compile(r"\((Worker_[A-Z]+\d+(?:_[A-Z]+\d+)*) pid=\d+\)"),
    bench_tool=("vllm", "bench", "serve"),
    bench_result_ext="json",
    bench_tool_from="command",
    tool_parser_flags="--enable-auto-tool-choice --tool-call-parser",
    # vLLM reads the key from VLLM_API_KEY.
    secret_args=("--secret-env", "VLLM_API_KEY=api-key"),
    registry="vllm",
    listens_everywhere=True,
    metrics="vLLM's own metrics (served by default)",
    cache_env={"VLLM_CACHE_ROOT": "vllm"},
    start_rules=START_RULES,
)

# Capturing vLLM's model registry (engine/data/registries/; docs/engine-fit.md): run in the engine's venv.
REGISTRY_SNIPPET = (
    "import json, importlib.metadata as md; "
    "from vllm.model_executor.models.registry import ModelRegistry as R; "
    "a = sorted(R.get_supported_archs()); "
    "print(json.dumps({'version': md.version('vllm'), 'architectures': a, "
    "'transformers_backend': [x for x in a if R.models[x].module_name.endswith('.transformers')]}))"
)

# vllm-router 0.1.17 logs `Router ready | workers: [...]` once every prefill and decode worker answered /health
# (src/server.rs), i.e. when it can route; it waits up to --worker-startup-timeout-secs for that, checking every
# --worker-startup-check-interval seconds (default 30: a ready deployment would wait for it). It reads
# OPENAI_API_KEY for its requests to the instances.
ROUTER = Router(
    command=("vllm-router",),
    help_args=("--help",),
    ready_re=r"Router ready",
    check_interval=2,
    secret_args=("--secret-env", "OPENAI_API_KEY=api-key"),
    render=render_router_argv,
)

PD_PROFILE = replace(
    PROFILE,
    name="vllm_pd",
    label="vLLM P/D",
    separate_instances=True,
    router=ROUTER,
    metrics="the P/D router's address; each prefill and decode instance serves its own /metrics on its node "
    "(the gate reads the decode instance's)",
)
