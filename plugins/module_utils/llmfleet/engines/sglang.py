"""SGLang (`sglang serve`, 0.5.23): everything llmfleet knows about it, as one profile."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .base import MOE_COST, Profile, StartRule


def _gib_sum(*groups: str | None) -> float:
    return round(sum(float(g) for g in groups if g), 2)


# The fit check's breakdown: real formats of the SGLang 0.5.23 wheel from PyPI, with the source of each.
BREAKDOWN = (
    # sglang/srt/model_executor/model_runner.py: "Load weight end. elapsed=… s, type=…, [quant, ]avail mem=… GB,
    # mem usage=… GB." (GB here is GiB: get_available_gpu_memory divides by 1 << 30)
    (re.compile(r"Load weight end\..*?mem usage=(-?[\d.]+) GB"), lambda m: {"weights_gib": float(m[1])}),
    # sglang/srt/mem_cache/memory_pool.py: "[label ]KV Cache is allocated. dtype: …, #tokens: N, K size: … GB,
    # V size: … GB" or "… KV size: … GB" (MLA); "VA upper bound" instead of "is allocated" after post-capture sizing
    (
        re.compile(
            r"KV Cache (?:is allocated|VA upper bound)\. dtype: \S+, #tokens: (\d+), "
            r"(?:K size: ([\d.]+) GB, V size: ([\d.]+) GB|KV size: ([\d.]+) GB)"
        ),
        lambda m: {"kv_tokens": int(m[1]), "kv_gib": _gib_sum(m[2], m[3], m[4])},
    ),
    # sglang/srt/model_executor/model_runner_components/cuda_graph_setup.py: "Capture target decode CUDA graph end.
    # bs=[…], elapsed=… s, mem usage=… GB, avail mem=… GB." (and prefill / draft variants; older: "cuda graph");
    # several captures add up
    (
        re.compile(r"Capture .*?(?:CUDA|cuda|CPU|NPU|XPU) graph end\..*?mem usage=(-?[\d.]+) GB"),
        lambda m: {"graph_gib+": float(m[1])},
    ),
    # sglang/srt/mem_cache/memory_pool.py: "Mamba Cache is allocated. max_mamba_cache_size: N, conv_state size:
    # …GB, ssm_state size: …GB"
    (
        re.compile(
            r"Mamba Cache is allocated\. max_mamba_cache_size: \d+, conv_state size: ([\d.]+)GB, "
            r"ssm_state size: ([\d.]+)GB"
        ),
        lambda m: {"state_gib": _gib_sum(m[1], m[2])},
    ),
    # sglang/srt/managers/scheduler.py (TP rank 0): "max_total_num_tokens=N, chunked_prefill_size=…, …,
    # max_running_requests=…, context_len=…, available_gpu_mem=… GB"
    (
        re.compile(r"max_total_num_tokens=(\d+), .*?max_running_requests=(\d+), context_len=(\d+)"),
        lambda m: {"max_total_num_tokens": int(m[1]), "max_running_requests": int(m[2]), "max_model_len": int(m[3])},
    ),
)


# The start-up scan's rules for this engine's lines (llmfleet.engine.startscan), each pattern the engine's own
# format string at the version and file named beside it.
START_RULES = (
    # sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py get_moe_configs (0.5.23):
    #   "Using default MoE kernel config. Performance might be sub-optimal! Config file not found at %s, you can
    #   create them with https://github.com/sgl-project/sglang/tree/main/benchmark/kernels/fused_moe_triton"
    StartRule(
        "sglang-moe-default-config",
        "sglang",
        re.compile(
            r"Using default MoE kernel config\. Performance might be sub-optimal! Config file not found at (.+?), you "
            r"can create them"
        ),
        "no tuned fused-MoE config for this GPU, expert shape, dtype and Triton version",
        MOE_COST,
        "tune it on one of these GPUs with SGLang's benchmark/kernels/fused_moe_triton/tuning_fused_moe_triton.py "
        "--model <checkpoint> --tp-size <TP> --dtype fp8_w8a8 --tune, and point SGLANG_MOE_CONFIG_DIR at a directory "
        "holding configs/triton_<version>/<that file> (engine_env)",
        place=2,
    ),
    # same file (0.5.23): "Config file not found at %s. Fallback to triton version %s and use MoE kernel config from
    #   %s. Performance might be sub-optimal!"
    StartRule(
        "sglang-moe-other-triton-config",
        "sglang",
        re.compile(r"Config file not found at (.+?)\. Fallback to triton version (\S+) and use MoE kernel config"),
        "the fused-MoE config was tuned under another Triton version",
        "SGLang keys configs by Triton version because a Triton 3.1.0 config under 3.2.0 gave negative gains (its "
        "comment in fused_moe_triton_config.py); this tool does not measure the loss here",
        "re-tune under the Triton version the engine runs (tuning_fused_moe_triton.py, as for a missing config)",
        place=3,
    ),
    # sglang/srt/layers/deep_gemm_wrapper/compile_utils.py (0.5.23): "Entering DeepGEMM JIT Pre-Compile session. It
    #   may take a long time (typically 10-20 mins) if you have not run `sglang.compile_deep_gemm`. ..."
    StartRule(
        "sglang-deepgemm-jit-precompile",
        "sglang",
        re.compile(r"Entering DeepGEMM JIT Pre-Compile session"),
        "DeepGEMM kernels are compiled at start-up (no warm cache for this shape)",
        "start-up time: 'typically 10-20 mins' by SGLang's own message, on every node whose cache is cold",
        "engine_deepgemm_precompile: true (the unit runs `python3 -m sglang.compile_deep_gemm` with the server's "
        "arguments once per cache fingerprint, before the engine); the engine role keeps DeepGEMM's cache under "
        "engine_cache_root, keyed by fingerprint",
        place=11,
    ),
    # sglang/srt/arg_groups/attention_hook.py (0.5.23): "Cuda graph is disabled because of using torch native
    #   attention backend" / "... torch Flex Attention backend"
    StartRule(
        "sglang-cuda-graph-disabled",
        "sglang",
        re.compile(r"Cuda graph is disabled because of using torch (?:native|Flex) (?:A|a)ttention backend"),
        "CUDA graphs are off because a torch-native attention backend was chosen",
        "decode runs without CUDA graphs (kernel launch overhead per step); slower, by an amount this tool does not "
        "measure",
        "choose a GPU attention backend (--attention-backend fa3, flashinfer or triton) unless debugging",
        place=12,
    ),
)


def render(spec: Mapping[str, Any], parts: Mapping[str, Any]) -> list[str]:
    """`sglang serve` for one node (parts: llmfleet.engine.command.render_argv's)."""
    name, timeout, ctx = spec.get("served_model_name"), spec.get("dist_timeout"), spec.get("context_length")
    tp, pp, nnodes = parts["tp"], parts["pp"], parts["nnodes"]
    argv = [*parts["command"], "--model-path", parts["model"]]
    argv += ["--served-model-name", str(name)] if name else []
    argv += ["--tp-size", str(tp)] + (["--pp-size", str(pp)] if pp > 1 else [])
    if nnodes > 1:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(parts["node_rank"])]
        argv += ["--dist-init-addr", f"{spec.get('head_addr')}:{spec.get('dist_port')}"]
    argv += ["--dist-timeout", str(timeout)] if timeout else []
    argv += ["--context-length", str(ctx)] if ctx else []
    argv += parts["loader"]
    # Non-head SGLang nodes still bind --port for their dummy health server.
    return argv + parts["extra"] + parts["listen"]


PROFILE = Profile(
    name="sglang",
    engine="sglang",
    label="SGLang",
    default_port=30000,
    command=("sglang", "serve"),
    help_args=("--help",),
    # SGLang enables its multithread loader with 8 threads by default (8 ranks x 8 threads = 64 readers per node
    # in the field).
    loader_threads=8,
    serving_re=r"The server is fired up and ready to roll!",
    phases={
        "dist_init": r"Init torch distributed begin",
        "dist_ready": r"Init torch distributed ends",
        "loading": r"Load weight begin",
        "loaded": r"Load weight end",
        "warmup": r"Capture cuda graph begin",
        "warm": r"Capture cuda graph end",
    },
    # A node without the API: every rank's scheduler logs its own last start-up line (count: local ranks).
    node_up_re={"graphs": r"Capture cuda graph end", "eager": r"Load weight end"},
    node_up_per_rank=True,
    no_graph_flag="--disable-cuda-graph",
    render=render,
    # One NUMA node per subprocess (local TP rank i uses GPU i).
    numa_flags=("--numa-node",),
    numa_bind=("--numa-node",),
    numa_per_rank=True,
    spec_flags=(
        "--speculative-algorithm",
        "--speculative-num-steps",
        "--speculative-eagle-topk",
        "--speculative-num-draft-tokens",
        "--speculative-draft-model-path",
    ),
    fit_flags={
        "fraction": "--mem-fraction-static",
        "max_len": "--context-length",
        "seqs": "--max-running-requests",
        "kv_fp8": "--kv-cache-dtype fp8_e4m3",
    },
    fit_breakdown=BREAKDOWN,
    argv_reader="argparse",
    # "[… PP1 TP3]"
    rank_re=re.compile(r"^\[[^\]]*?((?: ?(?:DP|PP|ATTN_CP|MOE_DP|TP|EP)\d+)+)\]"),
    # `sglang serve` itself takes --model-type (sglang/cli/serve.py, mentioned in prose at the top of its help).
    help_extra_flags={"--model-type": True},
    # The deprecated path works in every SGLang release (0.5.23 moved the code to sglang.benchmark.serving and
    # keeps this one as an alias with a FutureWarning).
    bench_tool=("python3", "-m", "sglang.bench_serving"),
    bench_result_ext="jsonl",
    bench_tool_from="python",
    tool_parser_flags="--tool-call-parser",
    # SGLang reads the key from a 0600 --config file.
    secret_args=("--secret-config", "config:api-key=api-key"),
    registry="sglang",
    listens_everywhere=False,  # SGLang's default host is 127.0.0.1
    metrics="SGLang's own metrics: served only when the engine runs with --enable-metrics (engine_extra_args)",
    cache_env={"SGLANG_CACHE_DIR": "sglang"},
    precompile=True,
    start_rules=START_RULES,
)
