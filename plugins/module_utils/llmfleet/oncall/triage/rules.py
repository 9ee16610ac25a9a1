"""What ``llmfleet why`` knows (triage.py applies it): the NVIDIA Xid numbers, which exceptions and log lines are
symptoms of a failure elsewhere, systemd's and the engines' lines about how a unit ended, and the verdicts' names.
Pure tables and matchers. Stdlib only, Python >= 3.8.
"""

from __future__ import annotations

import re
from typing import Any

# ---- verdicts ---------------------------------------------------------------------------------------------------

LABELS = {
    "stopped-by-operator": "stopped by operator",
    "ended-cleanly": "ended cleanly (its start is before the bundle)",
    "running": "running",
    "engine-crash": "engine crash",
    "oom-kill": "OOM kill of this unit",
    "gpu-xid": "GPU Xid",
    "storage": "storage: NFS not responding",
    "hung-task": "hung task",
    "io-error": "I/O error",
    "segfault": "segfault",
    "nccl-error": "NCCL error / timeout",
    "worker-died": "engine worker died",
    "start-timeout": "start timeout",
    "stop-timeout": "stop timeout",
    "watchdog": "watchdog timeout",
    "unrequested-exit-0": "exit 0 without a stop request",
    "exit-code": "exited with an error code",
    "signal": "killed by a signal",
    "core-dump": "core dump",
    "exec-failed": "could not start the engine",
    "start-limit": "start limit hit",
    "peer-failed": "stopped: another node failed",
    "deployment-stopped": "stopped with the deployment",
    "link-failed": "could not join the deployment link",
    "unhealthy-while-serving": "hung while serving",
    "unknown": "ended, cause not found",
}
NOT_FAILED = ("running", "stopped-by-operator", "deployment-stopped", "ended-cleanly")

# ---- GPU Xid (NVIDIA's Xid catalog, in our words) -----------------------------------------------------------------
# class: hardware (the GPU or its firmware failed: a cause), application (a GPU fault raised by the code running
# on it: usually the engine's or a library's bug), consequence (follows a process's end), informational.

XID: dict[int, tuple[str, str, str]] = {
    13: ("Graphics Engine Exception: a GPU kernel faulted (illegal instruction or out-of-range access)", "application",
         "usually a bug in a CUDA kernel of the engine or a library; repeated on one GPU only: dcgmi diag -r 3"),
    31: ("GPU memory page fault: a kernel touched an address it does not own", "application",
         "usually an engine or library bug (illegal memory access); the same GPU faulting under other software: "
         "hardware"),
    43: ("GPU stopped processing: the driver reset a channel after an application fault", "application",
         "the GPU is fine; the faulting process is the one to look at"),
    45: ("preemptive cleanup: the driver tore down a process's GPU channels because the process was ending",
         "consequence", "follows a process's end (a kill, an OOM kill, another Xid): a consequence, not a cause"),
    48: ("double-bit ECC error: uncorrectable GPU memory error", "hardware",
         "processes on the GPU were killed; reset the GPU (nvidia-smi -r) or reboot; repeated: replace the GPU"),
    61: ("internal micro-controller breakpoint/warning", "hardware",
         "driver/firmware fault; reset the GPU; repeated: nvidia-bug-report.sh to NVIDIA"),
    62: ("internal micro-controller halt", "hardware", "the GPU's firmware halted: reset the GPU or reboot"),
    63: ("ECC row remapping / page retirement recorded", "informational",
         "not a failure by itself: the remap applies at the next GPU reset; watch nvidia-smi -q -d ROW_REMAPPER"),
    64: ("ECC row remapping / page retirement failed", "hardware",
         "memory errors the GPU cannot remap: drain the node, replace the GPU"),
    74: ("NVLink error", "hardware",
         "check nvidia-smi nvlink -e and the fabric manager; reset the GPUs; repeated on one link: hardware"),
    79: ("GPU has fallen off the bus: it no longer answers on PCIe", "hardware",
         "the GPU is gone until the node is rebooted (often power-cycled); repeated: PCIe, power or thermal fault, "
         "replace the GPU or baseboard"),
    92: ("high single-bit ECC error rate", "informational",
         "correctable errors, not a failure by itself; the GPU is trending towards uncorrectable ones"),
    94: ("contained ECC error: uncorrectable, limited to the processes using that memory", "hardware",
         "those processes were killed, the GPU keeps running: restart the engine; reset the GPU to remap the row"),
    95: ("uncontained ECC error: uncorrectable, may have hit every process on the GPU", "hardware",
         "reset the GPU or reboot before using it again"),
    119: ("GSP RPC timeout: the GPU's system processor firmware did not answer the driver", "hardware",
          "the GPU is unusable until reset/reboot; seen with some driver branches: check the driver version"),
    120: ("GSP error: the GPU's system processor firmware failed", "hardware",
          "reset the GPU or reboot; update the driver if it repeats"),
}  # fmt: skip


def xid_info(n: int) -> tuple[str, str, str]:
    return XID.get(n, (f"Xid {n} (not in llmfleet's table)", "hardware", "look it up in NVIDIA's Xid catalog"))


# ---- exceptions ---------------------------------------------------------------------------------------------------

# (pattern on "Type: message extra", finding kind, why it is a symptom). Matched first to last.
CONSEQUENCE_EXC = (
    (re.compile(r"remote process exited or there was a network error|ncclRemoteError"), "nccl-error",
     "NCCL saying a peer rank went away: the peer's death (or the network) is the cause"),
    (re.compile(r"Connection closed by peer|Connection reset by peer|remote worker crashing"), "nccl-error",
     "a peer rank closed its connection: the peer died first"),
    (re.compile(r"Watchdog caught collective operation timeout|collective operation timeout"), "nccl-error",
     "a collective waited for a rank that never came"),
    (re.compile(r"EngineDeadError"), "engine-crash", "the API server reporting an engine core that had already died"),
    (re.compile(r"Executor failed|Worker failed with error|Engine core initialization failed"), "engine-crash",
     "the engine core reporting that a worker had failed"),
    (re.compile(r"^(?:KeyboardInterrupt|SystemExit|(?:asyncio\.)?(?:exceptions\.)?CancelledError)\b"), "engine-crash",
     "shutdown, not a fault"),
    (re.compile(r"^(?:BrokenPipeError|EOFError|ConnectionResetError)\b"), "engine-crash",
     "a pipe to a process that had already died"),
)  # fmt: skip

EXC_HINTS = (
    (re.compile(r"OutOfMemoryError|CUDA out of memory"),
     "GPU memory (CUDA), not host memory: the kernel's OOM killer had no part; lower --gpu-memory-utilization, "
     "the batch or the context length, or free the GPU"),
    (re.compile(r"CUDA error|cudaError|device-side assert|illegal memory access|CUBLAS_STATUS|NCCL error"),
     "a CUDA error: with an Xid in kernel.txt at the same time the GPU failed; without one, a kernel bug"),
    (re.compile(r"^(?:OSError|IOError|TimeoutError|PermissionError|FileNotFoundError)\b|Input/output error|"
                r"Stale file handle|safetensors"),
     "reading files failed: look at the storage (kernel.txt: NFS, I/O errors)"),
)  # fmt: skip
IO_EXC = re.compile(r"^(?:OSError|IOError|TimeoutError)\b|Input/output error|Stale file handle|Errno 5\b|Errno 116\b")
DEVICE_EXC = re.compile(r"CUDA|cuda|NCCL|device|ECC|Xid|GPU")


def exception_text(tb: dict[str, Any]) -> str:
    return " ".join([f"{tb['type']}: {tb['message']}", *tb.get("extra", [])])


def exception_consequence(tb: dict[str, Any]) -> tuple[str, str] | None:
    """(finding kind, why) when this exception is what a process says after a failure elsewhere, else None."""
    text = exception_text(tb)
    for rx, kind, why in CONSEQUENCE_EXC:
        if rx.search(text):
            return kind, why
    return None


def exception_hint(tb: dict[str, Any]) -> str | None:
    text = exception_text(tb)
    for rx, hint in EXC_HINTS:
        if rx.search(text):
            return hint
    return None


# ---- systemd's lines about a unit (journalctl -u shows them as `systemd[1]: UNIT: ...`) ----------------------------

SYSTEMD = (
    ("starting", re.compile(r"^Starting (.*)\.\.\.$")),
    ("started", re.compile(r"^Started (.*)\.$")),
    ("stopping", re.compile(r"^Stopping (.*)\.\.\.$")),
    ("stopped", re.compile(r"^Stopped (.*)\.$")),
    ("start_timeout", re.compile(r"^[Ss]tart(?:-pre|-post)? operation timed out\. Terminating\.$")),
    ("stop_timeout", re.compile(r"^State 'stop-[\w-]+' timed out\. (?:Killing|Terminating|Skipping)|"
                                r"^Stopping timed out\. (?:Killing|Terminating)")),
    ("watchdog", re.compile(r"^Watchdog timeout \(limit ([^)]*)\)!$")),
    ("oom", re.compile(r"A process of this unit has been killed by the OOM killer|systemd-oomd killed")),
    ("main_exit", re.compile(r"^Main process exited, code=(\w+), status=(\d+)/(\S+)$")),
    ("result", re.compile(r"^Failed with result '([\w-]+)'\.$")),
    ("deactivated", re.compile(r"^Deactivated successfully\.$|^Succeeded\.$")),
    ("restart", re.compile(r"^Scheduled restart job, restart counter is at (\d+)\.$")),
    ("start_limit", re.compile(r"^Start request repeated too quickly\.$")),
    ("failed_start", re.compile(r"^Failed to start (.*)\.$")),
    ("exec_failed", re.compile(r"Failed at step (\w+) spawning (\S+): (.*)$|Failed to (?:execute|locate) (.*)$")),
    ("killing", re.compile(r"^Killing process (\d+) \((.*?)\) with signal (SIG\w+)\.$")),
)  # fmt: skip


def systemd_event(msg: str, unit: str) -> tuple[str, re.Match] | None:
    text = msg[len(unit) + 2 :] if msg.startswith(unit + ": ") else msg
    for kind, rx in SYSTEMD:
        m = rx.search(text)
        if m:
            return kind, m
    return None


# ---- engine lines -------------------------------------------------------------------------------------------------

# The wrapper's last stderr line (wrapper.py `_finish`): `llmfleet exec: VERDICT: exit N: reason`.
WRAPPER_END = re.compile(r"^llmfleet exec: ([a-z0-9-]+): exit (\d+): (.*)$")
# The deployment link stopping this node because another one failed or was stopped (wrapper_link.py).
LINK_STOP = re.compile(r"^llmfleet exec: link: (\S+) (failed|was stopped on request) \((.*)\); stopping")
# A worker's death as the engine's supervising process reports it (vLLM 0.32 multiproc / Ray; SGLang 0.5).
WORKER_DIED = re.compile(
    r"Worker proc VllmWorker-(\d+) died unexpectedly(?: \(exit code: (-?\d+|None)\))?|RayWorkerProc rank=(\d+) died|"
    r"Child process unexpectedly failed with ([^.]*?)\.?(?: pid=(\d+))?(?: \(global rank (\d+)\))?$"
)
NCCL_LINE = re.compile(
    r"NCCL WARN|Watchdog caught collective operation timeout|remote process exited or there was a network error|"
    r"Some NCCL operations have failed or timed out"
)
# torch's shutdown warning: printed whenever a process exits without tearing its process group down.
DESTROY_PG = re.compile(r"destroy_process_group\(\) was not called|process group has NOT been destroyed")
# Pids an engine's lines name (its own processes): vLLM tags, glog/c10 `W1130 20:46:13.515000 12124 `, NCCL's
# `host:pid:tid [dev]`, uvicorn's `Finished server process [pid]`, vLLM's `... sub process NAME pid N`.
PIDS = (
    re.compile(r"\bpid[= ](\d+)\b"),
    re.compile(r"^\[?[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ (\d+) "),
    re.compile(r"^[\w.-]+:(\d+):\d+ \[\d+\] "),
    re.compile(r"Finished server process \[(\d+)\]"),
    re.compile(r"^Killing process (\d+) "),
)

SIGNALS = {1: "SIGHUP", 2: "SIGINT", 4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}
# ExecMainCode= in `systemctl show` (waitid's si_code).
EXEC_MAIN_CODE = {"1": "exited", "2": "killed", "3": "dumped"}
