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

import contextlib
import os
import stat
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


def stamp_state(stamp: str) -> str | None:
    """Whether the compile is done: "done" (a non-empty regular file), None (not yet: compile), or why the stamp
    cannot be used. Nothing here creates a directory: the stamp's directory is the fingerprint cache's (made by the
    engine role) or one the compile makes in it (DG_JIT_CACHE_DIR), so one of those two must exist; a stamp that is
    not a regular file (a directory, a link, a FIFO) is never read as done."""
    parent = os.path.dirname(os.path.abspath(stamp))
    if not os.path.isdir(parent) and not os.path.isdir(os.path.dirname(parent)):
        return (f"--stamp {stamp}: neither {parent} nor {os.path.dirname(parent)} exists: the stamp belongs in the "
                "fingerprint's cache directory, which the engine role creates (engine_cache_root)")  # fmt: skip
    try:
        st = os.lstat(stamp)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        return f"--stamp {stamp}: {e.strerror or e}"
    if not stat.S_ISREG(st.st_mode):
        return f"--stamp {stamp} is not a regular file: remove it (rm -r {stamp}) and start the unit again"
    return "done" if st.st_size > 0 else None  # an empty stamp is a write cut short: compile again


def write_stamp(stamp: str, text: str) -> None:
    """The stamp, written whole (temporary file + rename in its directory) and never through a link."""
    tmp = f"{stamp}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, stamp)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def run(args: Any) -> int:
    """Run CMD unless the stamp says it is done; its exit status, the stamp written only after exit 0. 2: a bad
    stamp path (its directory missing, not a regular file) or no CMD, before anything runs."""
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd  # only the separator, never an argument of CMD
    state = stamp_state(args.stamp) if cmd else "give the precompile command after --stamp STAMP --"
    if state == "done":
        print(f"llmfleet precompile: already done for this fingerprint ({args.stamp}); skipped", flush=True)
        return 0
    if state is not None:
        print(f"llmfleet precompile: {state}", file=sys.stderr, flush=True)
        return 2
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
    try:
        write_stamp(args.stamp, f"compiled in {took:.0f} s\n")  # its directory missing: said, never created
        print(f"llmfleet precompile: done in {took:.0f} s", flush=True)
    except OSError as e:  # the engine may start: only the next start compiles again
        print(f"llmfleet precompile: compiled in {took:.0f} s, but cannot write the stamp {args.stamp}: "
              f"{e.strerror or e}; the next start compiles again", file=sys.stderr, flush=True)  # fmt: skip
    return 0
