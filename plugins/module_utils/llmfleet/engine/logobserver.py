"""What an engine's log lines say: its phase, READY, error lines and the rank an error comes from.

Pure (no I/O, times passed in): ``llmfleet exec`` (wrapper.py) feeds it every non-empty output line; the
readiness gate ranks the phases it reports. Stdlib only, Python >= 3.8 (copied to nodes).
"""

from __future__ import annotations

import re
from typing import Any

from .. import engines

LINE_KEEP = 500  # characters of a line kept in phases / failed_rank

# The phases an engine passes through, in order; each engine's phrase for each is its profile's (llmfleet.engines:
# phases, serving_re). A phase may be skipped (vLLM's CPU build prints no `Model loading took` / CUDA graph lines;
# `--enforce-eager` captures no graphs): the phase only moves forward, to whichever later phase a line names.
PHASES = ("dist_init", "dist_ready", "loading", "loaded", "warmup", "warm", "serving")


def _phrases(phase: str) -> str:
    said = ({**p.phases, "serving": p.serving_re} for p in (engines.get(e) for e in engines.engines()))
    return "|".join(d[phase] for d in said if d.get(phase))


PHASE_PATTERNS = tuple((name, re.compile(_phrases(name))) for name in PHASES)
PROGRESS_PATTERN = re.compile(r"Loading safetensors checkpoint shards:\s*\d+%")
# Words of an error line, for lines that carry no log level (SGLang's format has none; tracebacks, signals).
ERROR_PATTERN = re.compile(r"Traceback|Error|Exception|exited unexpectedly|died|SIGSEGV|Segmentation fault|fatal|FATAL")
DEFAULT_READY_REGEX = PHASE_PATTERNS[-1][1].pattern
# The log level where a line has one: vLLM's logger `(Tag pid=N) LEVEL mm-dd hh:mm:ss [file.py:N] ...` (the tag
# optional), uvicorn's `LEVEL:     ...`, glog/c10 `W1130 20:39:30.47 ...` / `[W1130 ...]`, Python's warnings
# module `file.py:138: FutureWarning: ...`.
_LEVEL_PATTERNS = (
    re.compile(r"^(?:\([^)]*\bpid=\d+[^)]*\)\s+)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d\s"),
    re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL):\s"),
    re.compile(r"^\[?([DIWEF])\d{4} \d\d:\d\d:\d\d"),
    re.compile(r"^\S+:\d+: \w*(Warning): "),
)
_LEVEL_IS_ERROR = {"ERROR": True, "CRITICAL": True, "E": True, "F": True}
# vLLM names a dead worker only in the executor's text: `Worker proc VllmWorker-1 died unexpectedly`
# (global rank 1; the line's tag is `(EngineCore pid=N)` or, headless, `(MainProcess pid=N)`); Ray's executor
# says `RayWorkerProc rank=1 died unexpectedly`.
_VLLM_DEAD_WORKER = re.compile(r"\b(?:Worker proc VllmWorker-|RayWorkerProc rank=)(\d+) died\b")
_SGL_TAG = re.compile(r"\[([^\]]*)\]")
_SGL_TP = re.compile(r"\bTP(\d+)\b")
_SGL_PP = re.compile(r"\bPP(\d+)\b")
_VLLM_TAG = re.compile(r"\(([\w-]+)(?:\s+rank=(\d+))?\s+pid=\d+[^)]*\)")
_VLLM_WORKER_N = re.compile(r"^VllmWorker-(\d+)$")  # the process name before a worker knows its TP/PP place
_VLLM_TP = re.compile(r"(?:^|_)TP(\d+)(?:_|$)")
_VLLM_PP = re.compile(r"(?:^|_)PP(\d+)(?:_|$)")


def rank_of(line: str) -> dict[str, int | None] | None:
    """The rank an engine log line is about: SGLang ``[time TP3 PP1]`` (first [...]), vLLM ``(Worker_PP1_TP0 pid=1)``,
    ``(VllmWorker rank=3 pid=1)`` or ``(VllmWorker-3 pid=1)``, or the worker a vLLM executor reports dead
    (``Worker proc VllmWorker-3 died unexpectedly``: global rank 3); None when the line names none."""
    m = _SGL_TAG.search(line)
    if m:
        tp, pp = _SGL_TP.search(m.group(1)), _SGL_PP.search(m.group(1))
        if tp or pp:
            return {"tp": int(tp.group(1)) if tp else None, "pp": int(pp.group(1)) if pp else None, "rank": None}
    for m in _VLLM_TAG.finditer(line):
        name, rank = m.group(1), m.group(2)
        tp, pp, numbered = _VLLM_TP.search(name), _VLLM_PP.search(name), _VLLM_WORKER_N.match(name)
        rank = rank if rank is not None else (numbered.group(1) if numbered else None)
        if tp or pp or rank is not None:
            return {
                "tp": int(tp.group(1)) if tp else None,
                "pp": int(pp.group(1)) if pp else None,
                "rank": int(rank) if rank is not None else None,
            }
    dead = _VLLM_DEAD_WORKER.search(line)
    if dead:
        return {"tp": None, "pp": None, "rank": int(dead.group(1))}
    return None


def dead_rank(line: str) -> int | None:
    """The rank an error line reports dead (``Worker proc VllmWorker-1 died unexpectedly``, from vLLM's executor), or
    None. During start-up vLLM's engine core logs it, shuts its executor down and then waits for ever."""
    if not is_error_line(line):
        return None
    m = _VLLM_DEAD_WORKER.search(line)
    return int(m.group(1)) if m else None


def log_level(line: str) -> str | None:
    """The level a line was logged at (``INFO``, ``WARNING``, ``ERROR``, glog's ``W``/``E``...), None when the line's
    format carries none (SGLang, tracebacks, raw prints)."""
    for rx in _LEVEL_PATTERNS:
        m = rx.match(line)
        if m:
            return m.group(1)
    return None


def is_error_line(line: str) -> bool:
    """An error line: logged at ERROR/CRITICAL (glog E/F) where the line has a level, else one that names an
    exception, a traceback, a death or a fatal error. A WARNING or INFO line never is, whatever it quotes (vLLM's
    start-up ``WARNING ... Found ulimit ... like `OSError: [Errno 24] Too many open files` ``, uvicorn's
    ``INFO: ... 500 Internal Server Error``)."""
    level = log_level(line)
    if level is not None:
        return _LEVEL_IS_ERROR.get(level, False)
    return bool(ERROR_PATTERN.search(line))


class LogObserver:
    """What the wrapper reads from the engine's output, line by line (pure: no I/O, times passed in).

    phases: the first line of each phase reached, moving forward only; ready: --ready-regex matched
    --ready-count lines; first_error: the first error line (is_error_line); failed_rank: the first error line
    of the whole run that names a rank (rank_of)."""

    def __init__(self, ready_regex: str | None = None, ready_count: int = 1) -> None:
        self.ready_rx = re.compile(ready_regex or DEFAULT_READY_REGEX)
        self.ready_count = ready_count
        self.phase_idx = -1
        self.phases: list[dict[str, Any]] = []
        self.ready = False
        self.ready_at: float | None = None
        self.ready_matches = 0
        self.failed_rank: dict[str, Any] | None = None
        self.first_error: dict[str, Any] | None = None

    def phase_name(self) -> str:
        return PHASES[self.phase_idx] if self.phase_idx >= 0 else "started"

    def feed(self, text: str, now: float) -> dict[str, Any]:
        """One output line (without its end of line). Returns what changed: {"phase": a new phase or None,
        "progress": a loading progress line, "ready": the ready condition was met by this line}."""
        event: dict[str, Any] = {"phase": None, "progress": bool(PROGRESS_PATTERN.search(text)), "ready": False}
        for idx in range(self.phase_idx + 1, len(PHASE_PATTERNS)):
            name, rx = PHASE_PATTERNS[idx]
            if rx.search(text):
                self.phase_idx = idx
                self.phases.append({"phase": name, "at": now, "line": text[:LINE_KEEP]})
                event["phase"] = name
                break
        if not self.ready and self.ready_rx.search(text):
            self.ready_matches += 1
            if self.ready_matches >= self.ready_count:
                self.ready, self.ready_at = True, now
                event["ready"] = True
        if (self.first_error is None or self.failed_rank is None) and is_error_line(text):
            if self.first_error is None:
                self.first_error = {"line": text[:LINE_KEEP], "at": now}
            if self.failed_rank is None:
                rank = rank_of(text)
                if rank is not None:
                    self.failed_rank = dict(rank, line=text[:LINE_KEEP], at=now)
        return event

    def hint(self) -> str:
        """Where to look first, for the termination record's reason: the first error line with a rank tag,
        else the first error line."""
        if self.failed_rank:
            r = self.failed_rank
            tag = " ".join(f"{k.upper()}{r[k]}" for k in ("tp", "pp") if r[k] is not None)
            tag = tag or f"rank {r['rank']}"
            return f"first error line with a rank tag is from {tag}: {r['line'][:200]}"
        if self.first_error:
            return f"first error line: {self.first_error['line'][:200]}"
        return "no error line in the output; look at the tail"
