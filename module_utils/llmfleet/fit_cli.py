"""`llmfleet fit` and `llmfleet startscan`: the will-it-fit estimate and architecture check before a launch, and
the start-up log scan after it (docs/engine-fit.md), for operators and for the engine role to call on a node.

    llmfleet fit MODEL_DIR --engine vllm --engine-version 0.32.0 --tp 8 --pp 1 --max-model-len 131072 \\
        [--max-seqs 16] [--mem-fraction 0.9] [--gpu-memory-gib 96] [--kv-cache-dtype auto] [--json]
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
    p.add_argument("--max-model-len", type=int, required=True, help="context length the KV cache must hold")
    p.add_argument("--max-seqs", type=int, default=1, help="full-length requests it must hold at once (default 1)")
    p.add_argument("--mem-fraction", type=float, help="vLLM --gpu-memory-utilization / SGLang --mem-fraction-static")
    p.add_argument("--gpu-memory-gib", type=float, help="one GPU's memory (default: nvidia-smi's memory.total)")
    p.add_argument("--kv-cache-dtype", default="auto", help="the engine's --kv-cache-dtype (default auto)")
    p.add_argument("--json", action="store_true", help="print the architecture check and every term as JSON")


def _gpu_memory(args: argparse.Namespace) -> int | None:
    if args.gpu_memory_gib:
        return int(args.gpu_memory_gib * GIB)
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    cp = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                        capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    return fit.gpu_memory_from_smi(cp.stdout) if cp.returncode == 0 else None


def run_fit(args: argparse.Namespace) -> int:
    version = args.engine_version or archcheck.captured(args.engine)[-1]
    try:
        known, arch_msg = archcheck.check_config(fit.read_config(args.model_dir), args.engine, version)
        mem = _gpu_memory(args)
        est = None
        if mem is not None:
            fraction = args.mem_fraction or (VLLM_DEFAULT_FRACTION if args.engine == "vllm" else None)
            if fraction is None:
                raise fit.FitError(
                    "SGLang picks its own --mem-fraction-static: give the one it runs with (--mem-fraction)"
                )
            est = fit.estimate_checkpoint(
                args.model_dir, tp=args.tp, pp=args.pp, gpu_memory_bytes=mem, mem_fraction=fraction,
                engine=args.engine, max_model_len=args.max_model_len, max_seqs=args.max_seqs,
                kv_cache_dtype=args.kv_cache_dtype,
            )  # fmt: skip
    except (fit.FitError, archcheck.ArchCheckError, OSError) as e:
        print(f"llmfleet fit: {e}", file=sys.stderr)
        return 2
    fits = est is None or est["verdict"] != "does_not_fit"
    if args.json:
        print(json.dumps({"architecture_known": known, "architecture": arch_msg, "estimate": est}, indent=2))
    else:
        print(("" if known else "ERROR ") + arch_msg)
        if est is None:
            print("memory: not judged (no NVIDIA GPU here: give --gpu-memory-gib)")
        else:
            print(("WARNING " if est["verdict"] == "tight" else "" if fits else "ERROR ") + est["message"])
    return 0 if known and fits else 1


def add_scan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=sorted(fit.ENGINES), help="only this engine's rules (default: every rule)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--unit", help="read this systemd unit's journal (journalctl -u UNIT -o cat)")
    src.add_argument("file", nargs="?", metavar="FILE", help="a start-up log ('-': standard input)")
    p.add_argument("--json", action="store_true", help="print the findings and the memory breakdown as JSON")


def run_scan(args: argparse.Namespace) -> int:
    try:
        if args.unit:
            cp = subprocess.run(["journalctl", "-u", args.unit, "-o", "cat", "--no-pager"],
                                capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
            if cp.returncode != 0:
                print(f"llmfleet startscan: journalctl -u {args.unit}: {cp.stderr.strip()}", file=sys.stderr)
                return 2
            text = cp.stdout
        elif args.file == "-":
            text = sys.stdin.read()
        else:
            with open(args.file, encoding="utf-8", errors="replace") as f:
                text = f.read()
    except OSError as e:
        print(f"llmfleet startscan: {e}", file=sys.stderr)
        return 2
    findings = startscan.scan(text, args.engine)
    breakdown = fit.parse_breakdown(text, args.engine) if args.engine else None
    if args.json:
        print(json.dumps({"findings": findings, "breakdown": breakdown}, indent=2))
        return 0
    print(startscan.summary(findings) or "no known fall-back line in the start-up log")
    if breakdown is not None:
        print(fit.breakdown_message(breakdown))
    return 0


class _Fit:
    add_arguments = staticmethod(add_fit_arguments)
    run = staticmethod(run_fit)


class _Scan:
    add_arguments = staticmethod(add_scan_arguments)
    run = staticmethod(run_scan)


fit_command = _Fit()
scan_command = _Scan()
