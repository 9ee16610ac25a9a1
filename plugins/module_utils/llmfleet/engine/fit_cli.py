"""`llmfleet fit` and `llmfleet startscan`: the will-it-fit estimate and architecture check before a launch, and
the start-up log scan after it (docs/engine-fit.md), for operators and for the engine role to call on a node.

    llmfleet fit MODEL_DIR --engine vllm --engine-version 0.32.0 --tp 8 --pp 1 --max-model-len 131072 \\
        [--max-seqs 16] [--mem-fraction 0.9] [--gpu-memory-gib 96] [--kv-cache-dtype auto] [--argv-json JSON] [--json]
    llmfleet startscan --engine vllm (--unit llmfleet-main.service | FILE | -) [--json]

fit exits 0 when the model's architecture is known and it fits (or is tight: a warning), 1 when it does not
fit or the engine does not know the architecture, 2 on bad input. startscan exits 0 (its findings are
warnings)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

from .. import engines
from ..cli_grammar import finite_positive
from . import archcheck, fit, startscan

GIB = 1024**3
# vLLM's default --gpu-memory-utilization. SGLang derives its --mem-fraction-static from the GPU and the
# shape when it is not given, so for SGLang the fraction must be given.
VLLM_DEFAULT_FRACTION = 0.9


def add_fit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", metavar="MODEL_DIR", help="the checkpoint directory (config.json, *.safetensors)")
    p.add_argument("--engine", required=True, choices=sorted(fit.ENGINES), help="the engine that will serve it")
    p.add_argument("--engine-version", help="its version, for the architecture check (default: the newest captured)")
    p.add_argument("--tp", type=int, required=True, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default 1)")
    p.add_argument(
        "--max-model-len",
        type=int,
        help="context length the KV cache must hold (default: --argv-json, else max_position_embeddings)",
    )
    p.add_argument("--max-seqs", type=int, default=1, help="full-length requests it must hold at once (default 1)")
    p.add_argument("--mem-fraction", type=finite_positive("fraction"),
                   help="vLLM --gpu-memory-utilization / SGLang --mem-fraction-static")  # fmt: skip
    p.add_argument("--gpu-memory-gib", type=finite_positive("GiB"),
                   help="one GPU's memory (default: nvidia-smi's memory.total)")  # fmt: skip
    p.add_argument("--kv-cache-dtype", default="auto", help="the engine's --kv-cache-dtype (default auto)")
    p.add_argument(
        "--argv-json",
        help="the engine's planned command line as a JSON list: the context length, "
        "concurrency, memory fraction and KV cache dtype the engine will use are read from it",
    )
    p.add_argument("--json", action="store_true", help="print the architecture check and every term as JSON")


# The engine flags that size the KV cache, per engine (the profiles'): (max_model_len, max_seqs, mem_fraction,
# kv_cache_dtype).
ARGV_FLAGS = {e: engines.get(e).fit_argv_flags for e in fit.ENGINES}
_VLLM, _SGLANG = engines.VLLM.engine, engines.SGLANG.engine


def flags_from_argv(argv: list[str], engine: str) -> dict[str, str]:
    """The sizing flags' values in an engine command line (`--flag value` or `--flag=value`; vLLM also takes
    underscores), keyed max_model_len / max_seqs / mem_fraction / kv_cache_dtype."""
    keys = ("max_model_len", "max_seqs", "mem_fraction", "kv_cache_dtype")
    want = dict(zip(ARGV_FLAGS[engine], keys))
    out: dict[str, str] = {}
    for i, a in enumerate(argv):
        flag, eq, val = a.partition("=")
        flag = "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag
        if flag in want:
            if not eq and i + 1 < len(argv):
                val = argv[i + 1]
            out[want[flag]] = val
    return out


def uses_mtp(argv: list[str], engine: str) -> bool:
    """Whether the command line runs speculative decoding with the checkpoint's own MTP layers, which the engine
    then loads too (vLLM --speculative-config method mtp; SGLang --speculative-algorithm NEXTN)."""
    for i, a in enumerate(argv):
        flag, eq, val = a.partition("=")
        val = val if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        if engine == _VLLM and flag.replace("_", "-") in ("--speculative-config", "-sc"):
            try:
                doc = json.loads(val)
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get("method") == "mtp":
                return True
        if engine == _VLLM and flag.replace("_", "-") in ("--speculative-config.method", "-sc.method") and val == "mtp":
            return True
        if engine == _SGLANG and flag == "--speculative-algorithm" and val.upper() == "NEXTN":
            return True
    return False


def _apply_argv(args: argparse.Namespace, config: dict) -> None:
    """Fill what the command line did not give from the engine's argv, then from config.json."""
    if args.argv_json:
        try:
            argv = json.loads(args.argv_json)
            if not isinstance(argv, list):
                raise ValueError("not a list")
            got = flags_from_argv([str(a) for a in argv], args.engine)
            args.max_model_len = args.max_model_len or (int(got["max_model_len"]) if "max_model_len" in got else None)
            args.max_seqs = args.max_seqs if args.max_seqs != 1 or "max_seqs" not in got else int(got["max_seqs"])
            args.mem_fraction = args.mem_fraction or (float(got["mem_fraction"]) if "mem_fraction" in got else None)
            if args.kv_cache_dtype == "auto" and "kv_cache_dtype" in got:
                args.kv_cache_dtype = got["kv_cache_dtype"]
            args.include_mtp = uses_mtp([str(a) for a in argv], args.engine)
        except ValueError as e:
            raise fit.FitError(f"--argv-json: {e}: give the engine's command line as a JSON list of strings") from None
    if not args.max_model_len:
        ctx = fit.text_config(config).get("max_position_embeddings")
        if not isinstance(ctx, int) or ctx < 1:
            raise fit.FitError("no context length: give --max-model-len (config.json has no max_position_embeddings)")
        args.max_model_len = ctx


def _gpu_memory(args: argparse.Namespace) -> int | None:
    if args.gpu_memory_gib:
        return int(args.gpu_memory_gib * GIB)
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    cp = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                        capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    return fit.gpu_memory_from_smi(cp.stdout) if cp.returncode == 0 else None


def sglang_own_fraction(gpu_memory_bytes: int, tp: int, pp: int, max_seqs: int) -> float:
    """The --mem-fraction-static SGLang picks when none is given: what its reserve for activations and graphs
    (fit.default_margin_bytes, SGLang 0.5.23's memory_hook.py rule) leaves of the GPU."""
    margin = fit.default_margin_bytes(gpu_memory_bytes, tp=tp, pp=pp, activation_tokens=8192, max_seqs=max_seqs)
    return 1 - margin / gpu_memory_bytes


def run_fit(args: argparse.Namespace) -> int:
    args.include_mtp = False
    fraction_note = None
    version = args.engine_version or archcheck.captured(args.engine)[-1]
    try:
        config = fit.read_config(args.model_dir)
        _apply_argv(args, config)
        known, arch_msg = archcheck.check_config(config, args.engine, version)
        mem = _gpu_memory(args)
        est = None
        if mem is not None:
            fraction = args.mem_fraction or (VLLM_DEFAULT_FRACTION if args.engine == _VLLM else None)
            if fraction is None:
                fraction = sglang_own_fraction(mem, args.tp, args.pp, args.max_seqs)
                fraction_note = f"--mem-fraction-static {fraction:.3f} by SGLang's own rule (none given)"
            est = fit.estimate_checkpoint(
                args.model_dir, tp=args.tp, pp=args.pp, gpu_memory_bytes=mem, mem_fraction=fraction,
                engine=args.engine, max_model_len=args.max_model_len, max_seqs=args.max_seqs,
                kv_cache_dtype=args.kv_cache_dtype, include_mtp=args.include_mtp,
            )  # fmt: skip
    except (fit.FitError, archcheck.ArchCheckError, OSError) as e:
        print(f"llmfleet fit: {e}", file=sys.stderr)
        return 2
    fits = est is None or est["verdict"] != "does_not_fit"
    if args.json:
        print(json.dumps({"architecture_known": known, "architecture": arch_msg, "estimate": est,
                          "mem_fraction_note": fraction_note}, indent=2))  # fmt: skip
    else:
        print(("" if known else "ERROR ") + arch_msg)
        if est is None:
            print("memory: not judged (no NVIDIA GPU here: give --gpu-memory-gib)")
        else:
            print(("WARNING " if est["verdict"] == "tight" else "" if fits else "ERROR ") + est["message"])
            if fraction_note:
                print(f"(assumed {fraction_note})")
    return 0 if known and fits else 1


def add_scan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=sorted(fit.ENGINES), help="only this engine's rules (default: every rule)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--unit", help="read this systemd unit's journal of its current start")
    src.add_argument("file", nargs="?", metavar="FILE", help="a start-up log ('-': standard input)")
    p.add_argument("--json", action="store_true", help="print the findings and the memory breakdown as JSON")


def run_scan(args: argparse.Namespace) -> int:
    try:
        if args.unit:  # this start's lines only (the unit's current invocation); a unit with none is an error
            text = startscan.unit_journal(args.unit)
        elif args.file == "-":
            text = startscan.require_text(sys.stdin.read(), "standard input")
        else:
            with open(args.file, encoding="utf-8", errors="replace") as f:
                text = startscan.require_text(f.read(), args.file)
    except (OSError, startscan.ScanInputError) as e:
        print(f"llmfleet startscan: {e}", file=sys.stderr)
        return 2
    findings = startscan.scan(text, args.engine)
    breakdown = fit.parse_breakdown(text, args.engine) if args.engine else None
    said = startscan.summary(findings) or "no known fall-back line in the start-up log"
    memory = fit.breakdown_message(breakdown) if breakdown is not None else None
    if args.json:
        # summary / memory: the lines the plain output prints (the engine role shows them per node).
        print(json.dumps({"findings": findings, "breakdown": breakdown, "summary": said, "memory": memory}, indent=2))
        return 0
    print(said)
    if memory is not None:
        print(memory)
    return 0


# The two commands in the shape cli.PLUGGED takes (add_arguments, run).
fit_command = SimpleNamespace(add_arguments=add_fit_arguments, run=run_fit)
scan_command = SimpleNamespace(add_arguments=add_scan_arguments, run=run_scan)
