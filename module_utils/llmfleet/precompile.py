"""DeepGEMM kernels compiled before the engine starts (engine_deepgemm_precompile; SGLang only).

SGLang's FP8 GEMMs JIT-compile DeepGEMM kernels per shape at start-up ("Entering DeepGEMM JIT Pre-Compile
session. It may take a long time (typically 10-20 mins) ..."); `python -m sglang.compile_deep_gemm` with the
server's own arguments compiles them ahead into the DeepGEMM cache, which the unit's environment points at the
fingerprinted cache directory (SGLANG_DG_CACHE_DIR / DG_JIT_CACHE_DIR). The unit runs it as an ExecStartPre
through `llmfleet precompile --stamp STAMP -- CMD`: once per fingerprint (the stamp lives in the cache
directory, so a new engine, revision or TP x PP compiles again), on every node at once (it starts the
server's distributed world like the serve does), its own server bound to 127.0.0.1 (it listens with no API
key while it compiles).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

MODULE = "sglang.compile_deep_gemm"


def compile_argv(python: str, serve_argv: list[str], skip: int, timeout: int) -> list[str]:
    """The precompile command: the engine's own serve arguments (after its `skip` command words), its server on
    127.0.0.1, sglang.compile_deep_gemm's --timeout (seconds for the whole compile)."""
    args = [str(a) for a in serve_argv[skip:]]
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--host" and i + 1 < len(args):
            i += 2
            continue
        if a.startswith("--host="):
            i += 1
            continue
        out.append(a)
        i += 1
    return [python, "-m", MODULE, *out, "--host", "127.0.0.1", "--timeout", str(int(timeout))]


def add_arguments(p: Any) -> None:
    p.add_argument("--stamp", required=True, help="done marker: skip when it exists, create it after a success")
    p.add_argument("cmd", nargs="+", metavar="-- CMD", help="the precompile command")


def run(args: Any) -> int:
    """Run CMD unless the stamp exists; its exit status, the stamp written only after exit 0."""
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd  # only the separator, never an argument of CMD
    if os.path.exists(args.stamp):
        print(f"llmfleet precompile: already done for this fingerprint ({args.stamp}); skipped", flush=True)
        return 0
    print(f"llmfleet precompile: {' '.join(cmd[:3])} ... (once per fingerprint; stamp {args.stamp})", flush=True)
    t0 = time.monotonic()
    try:
        rc = subprocess.call(cmd)
    except OSError as e:
        print(f"llmfleet precompile: cannot run {cmd[0]}: {e}; set engine_deepgemm_precompile: false or fix "
              "llmfleet_engine_python", file=sys.stderr, flush=True)  # fmt: skip
        return 2
    took = time.monotonic() - t0
    if rc != 0:
        what = cmd[2] if len(cmd) > 2 else cmd[0]
        print(f"llmfleet precompile: {what} exited {rc} after {took:.0f} s: the engine does not start "
              "(set engine_deepgemm_precompile: false to start without it)", file=sys.stderr, flush=True)  # fmt: skip
        return rc
    os.makedirs(os.path.dirname(args.stamp) or ".", exist_ok=True)
    with open(args.stamp, "w", encoding="utf-8") as f:
        f.write(f"compiled in {took:.0f} s\n")
    print(f"llmfleet precompile: done in {took:.0f} s", flush=True)
    return 0
