"""The termination record of ``llmfleet exec`` (``llmfleet.termination/1``): the verdict and exit code of a run,
the sentence that explains it, the record's keys in their documented order, and its files (rotated, written
atomically). docs/wrapper.md has the contract: other code reads these names.

Stdlib only, Python >= 3.8 (copied to nodes).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from typing import Any

from ..engine.logobserver import LogObserver
from .cgroup import unit_of
from .process import STOP_SIGNALS, EngineProcess, signal_name

SCHEMA = "llmfleet.termination/1"
RECORD_KEYS = (  # the documented order (docs/wrapper.md); other code reads these names
    "schema", "host", "unit", "invocation_id", "argv", "wrapper_pid", "child_pid", "started_at", "started_at_iso",
    "ended_at", "ended_at_iso", "duration_s", "stop_requested", "stop_signal", "stop_requested_at",
    "killed_after_timeout", "child", "exit_code", "verdict", "reason", "oom_kill", "left_over_pids", "phase", "phases",
    "ready", "ready_at", "failed_rank", "first_error", "link", "health", "tail",
)  # fmt: skip
# EX_SOFTWARE: an engine that exits 0 without a stop request has failed (Restart=on-failure must fire).
EXIT_UNREQUESTED = 70
# EX_UNAVAILABLE: the serving health probe failed --health-failures times in a row (Restart=on-failure fires).
EXIT_UNHEALTHY = 69
EXIT_USAGE = 2
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
RECORD_KEEP = 5  # FILE.1 .. FILE.5


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


def rotate(path: str, keep: int = RECORD_KEEP) -> None:
    """path -> path.1 -> ... -> path.<keep>, so a restart does not overwrite the crash record."""
    if not os.path.exists(path):
        return
    for i in range(keep - 1, 0, -1):
        if os.path.exists(f"{path}.{i}"):
            os.replace(f"{path}.{i}", f"{path}.{i + 1}")
    os.replace(path, f"{path}.1")


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o644)  # independent of the unit's UMask
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())  # the record must survive the node rebooting right after a crash
    os.replace(tmp, path)


def decide(
    *, stop_requested: bool, killed_after_timeout: bool, exit_code: int | None, sig: int | None, core: bool, oom: int
) -> tuple[int, str]:
    """(wrapper exit code, verdict) from how the child ended. oom: rise of the cgroup's oom_kill counter."""
    if sig is not None:
        code = 128 + sig
        if stop_requested and killed_after_timeout and sig == signal.SIGKILL:
            verdict = "stop-timeout"
        elif stop_requested and sig in STOP_SIGNALS:
            code, verdict = 0, "clean-stop"  # systemd counts 143 from a main process as a failure
        elif core:
            verdict = "core-dump"
        elif sig == signal.SIGKILL and oom > 0:
            verdict = "oom-kill"
        else:
            verdict = "signal"
        return code, verdict
    code = exit_code or 0
    # A shell or launcher that reports its child's SIGTERM death as 128+15 stopped cleanly too.
    if stop_requested and (code == 0 or code - 128 in STOP_SIGNALS):
        return 0, "clean-stop"
    if code == 0 and not stop_requested:
        return EXIT_UNREQUESTED, "unrequested-exit-0"
    return code, "exit-code"


def child_fields(exit_code: int | None, sig: int | None, core: bool) -> dict[str, Any]:
    """The record's ``child``: how the engine's main process ended."""
    return {"exit_code": exit_code, "signal": sig, "signal_name": signal_name(sig), "core_dumped": core}


def explain(
    verdict: str,
    code: int,
    child: dict[str, Any],
    oom: dict | None,
    oom_why: str,
    *,
    engine: EngineProcess,
    hint: str,
) -> str:
    """One sentence: what happened and what to look at. hint: where the log points (LogObserver.hint)."""
    sig_name, stop = child["signal_name"], signal_name(engine.stop_signal)
    oom_note = ""
    if oom and oom["delta"] > 0:
        oom_note = f" (the cgroup's oom_kill counter rose by {oom['delta']} during the run: OOM kill)"
    if verdict == "clean-stop":
        how = f"by {sig_name}" if sig_name else f"with code {child['exit_code']}"
        msg = f"stopped on request ({stop}): the engine exited {how}"
    elif verdict == "stop-timeout":
        why = (
            "--link-stop-timeout: a peer failed or a rank died, nothing is left to shut down cleanly"
            if engine.short_deadline
            else "raise --stop-timeout and TimeoutStopSec if shutdown is legitimately slow"
        )
        msg = f"child ignored {stop} for {engine.stop_timeout:g} s; killed the process group with SIGKILL ({why}); "
        msg += hint
    elif verdict == "unrequested-exit-0":
        msg = (
            "the engine exited 0 without being asked to stop: an engine exiting 0 on its own is treated as a "
            f"failure (exit {EXIT_UNREQUESTED}) so Restart=on-failure fires (vLLM exits 0 when a worker dies; a "
            "shell pipeline like 'engine | tee' reports the last command's status and hides the engine's)"
            f"{oom_note}; {hint}"
        )
    elif verdict == "exit-code":
        who = f"stop requested ({stop}) but the engine" if engine.stop_requested else "the engine"
        msg = f"{who} exited with code {code}{oom_note}; {hint}"
    elif verdict == "core-dump":
        msg = f"killed by {sig_name} and dumped core: look at the core (coredumpctl list); {hint}"
    elif verdict == "oom-kill" and oom:
        msg = (
            f"killed by SIGKILL after running out of host memory: the cgroup's oom_kill counter rose by "
            f"{oom['delta']} ({oom['source']}); check the unit's MemoryMax= and the engine's CPU-side memory"
        )
    elif child["signal"] == signal.SIGKILL and oom is None:
        msg = (
            f"killed by SIGKILL and the cgroup's OOM counter is unavailable ({oom_why}): an OOM kill "
            f"(see journalctl -k) or SGLang's crash path, which kills itself this way; {hint}"
        )
    elif child["signal"] == signal.SIGKILL:
        msg = (
            "killed by SIGKILL with no OOM kill recorded in the cgroup: SGLang's crash path kills itself this "
            f"way; look at the first error line ({hint})"
        )
    else:
        msg = f"killed by {sig_name} ({child['signal']}){oom_note}; {hint}"
    return msg


def known_fields(
    *, argv: list[str], cgroup_text: str, started_at: float, engine: EngineProcess, obs: LogObserver
) -> dict[str, Any]:
    """The record's keys known while the engine runs (the live status has these)."""
    return {
        "schema": SCHEMA,
        "host": socket.gethostname(),
        "unit": unit_of(cgroup_text),
        "invocation_id": os.environ.get("INVOCATION_ID") or None,
        "argv": argv,
        "wrapper_pid": os.getpid(),
        "child_pid": engine.pid,
        "started_at": started_at,
        "started_at_iso": _iso(started_at),
        "stop_requested": engine.stop_requested,
        "stop_signal": signal_name(engine.stop_signal),
        "stop_requested_at": engine.stop_requested_at,
        "killed_after_timeout": engine.killed_after_timeout,
        "phase": obs.phase_name(),
        "phases": list(obs.phases),
        "ready": obs.ready,
        "ready_at": obs.ready_at,
        "failed_rank": obs.failed_rank,
        "first_error": obs.first_error,
    }


def termination_record(
    known: dict[str, Any],
    *,
    ended_at: float,
    code: int,
    verdict: str,
    reason: str,
    child: dict[str, Any],
    oom: dict | None,
    left: int,
    tail: list[str],
) -> dict[str, Any]:
    """The whole record, keys in RECORD_KEYS order. known: known_fields() at the end of the run."""
    rec = dict(
        known,
        ended_at=ended_at,
        ended_at_iso=_iso(ended_at),
        duration_s=round(ended_at - known["started_at"], 3),
        child=child,
        exit_code=code,
        verdict=verdict,
        reason=reason,
        oom_kill=oom,
        left_over_pids=left,
        tail=tail,
    )
    return {k: rec[k] for k in RECORD_KEYS}
