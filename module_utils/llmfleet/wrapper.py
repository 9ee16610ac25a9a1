"""``llmfleet exec [options] -- CMD...``: the main process of an engine unit (Type=notify, KillMode=mixed).

Why it exists: engines crashed yet their units showed "exit 0" (``engine | tee log`` reports tee's status,
vLLM exits 0 when a worker dies, SGLang's crash path SIGKILLs itself). The wrapper runs CMD in its own
process group, passes its output through line by line, forwards stop signals, kills what is left of the
group when the engine ends, turns "exited 0 without being asked" into a failure, and writes a termination
record (JSON) that says what happened and which rank failed first. docs/wrapper.md has the contract.

Stdlib only, Python >= 3.8: it is copied to nodes and imported as ``ansible.module_utils.llmfleet.wrapper``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

SCHEMA = "llmfleet.termination/1"
RECORD_KEYS = (  # the documented order (docs/wrapper.md); other code reads these names
    "schema", "host", "unit", "invocation_id", "argv", "wrapper_pid", "child_pid", "started_at", "started_at_iso",
    "ended_at", "ended_at_iso", "duration_s", "stop_requested", "stop_signal", "stop_requested_at",
    "killed_after_timeout", "child", "exit_code", "verdict", "reason", "oom_kill", "left_over_pids", "phase", "phases",
    "ready", "ready_at", "failed_rank", "first_error", "tail",
)  # fmt: skip
# EX_SOFTWARE: an engine that exits 0 without a stop request has failed (Restart=on-failure must fire).
EXIT_UNREQUESTED = 70
EXIT_USAGE = 2
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
RECORD_KEEP = 5  # FILE.1 .. FILE.5
EXTEND_EVERY_S = 5.0
READER_JOIN_S = 2.0  # grandchildren outside the group may hold the pipes: never wait for EOF longer
LEFTOVER_WAIT_S = 2.0
POLL_S = 0.05
MAX_LINE = 65536  # a line without a newline is passed on in pieces of this size
LINE_KEEP = 500  # characters of a line kept in phases / failed_rank

# Real SGLang | vLLM log phrases, in the order an engine reaches them. A phase may be skipped (vLLM's CPU build
# prints no `Model loading took` / CUDA graph lines; `--enforce-eager` captures no graphs): the phase only
# moves forward, to whichever later phase a line names.
PHASE_PATTERNS = (
    ("dist_init", re.compile(r"Init torch distributed begin|distributed_init_method=")),
    ("dist_ready", re.compile(r"Init torch distributed ends|rank \d+ in world size \d+ is assigned as")),
    ("loading", re.compile(r"Load weight begin|Starting to load model")),
    # vLLM's loader logs `Loading weights took` (CPU and GPU builds), the GPU model runner then `Model loading took`.
    ("loaded", re.compile(r"Load weight end|Loading weights took|Model loading took")),
    ("warmup", re.compile(r"Capture cuda graph begin|Capturing CUDA graphs")),
    ("warm", re.compile(r"Capture cuda graph end|Graph capturing finished")),
    ("serving", re.compile(r"The server is fired up and ready to roll!|Application startup complete")),
)
PHASES = tuple(name for name, _ in PHASE_PATTERNS)
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
_EOL = re.compile(rb"\r\n|\n|\r")  # tqdm bars end their updates with \r: progress must be seen before \n
_SGL_TAG = re.compile(r"\[([^\]]*)\]")
_SGL_TP = re.compile(r"\bTP(\d+)\b")
_SGL_PP = re.compile(r"\bPP(\d+)\b")
_VLLM_TAG = re.compile(r"\(([\w-]+)(?:\s+rank=(\d+))?\s+pid=\d+[^)]*\)")
_VLLM_WORKER_N = re.compile(r"^VllmWorker-(\d+)$")  # the process name before a worker knows its TP/PP place
_VLLM_TP = re.compile(r"(?:^|_)TP(\d+)(?:_|$)")
_VLLM_PP = re.compile(r"(?:^|_)PP(\d+)(?:_|$)")
_CRED_NAME = r"[A-Za-z0-9_.@-]+"  # systemd credential names: no '/'
_SECRET_ENV = re.compile(rf"([A-Za-z_][A-Za-z0-9_]*)=({_CRED_NAME})")
_SECRET_CONFIG = re.compile(rf"([A-Za-z0-9][A-Za-z0-9_-]*):([A-Za-z_][A-Za-z0-9_.-]*)=({_CRED_NAME})")


class SetupError(Exception):
    """A configuration problem found before the child starts (exit 2)."""


def _err(msg: str) -> None:
    try:
        sys.stderr.write(f"llmfleet exec: {msg}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


def signal_name(sig: int | None) -> str | None:
    if sig is None:
        return None
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# --------------------------------------------------------------------------------------------
# Parsers (pure; unit-tested directly)


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


def _cgroup_lines(cgroup_text: str) -> list[tuple[str, list[str], str]]:
    out = []
    for line in cgroup_text.splitlines():
        parts = line.strip().split(":", 2)  # hierarchy-id:controllers:path (the path may hold ':')
        if len(parts) == 3:
            out.append((parts[0], parts[1].split(",") if parts[1] else [], parts[2]))
    return out


def oom_counter_file(cgroup_text: str, root: str = "/sys/fs/cgroup") -> tuple[str | None, str]:
    """(file holding this cgroup's oom_kill counter, "") or (None, why not). cgroup v2's memory.events is
    preferred; hybrid hosts mount v2 at <root>/unified without the memory controller, so v1 is the fallback."""
    v2 = v1 = None
    for hid, ctrls, path in _cgroup_lines(cgroup_text):
        if hid == "0" and not ctrls:
            v2 = path
        elif "memory" in ctrls:
            v1 = (",".join(ctrls), path)
    tried = []
    if v2 is not None:
        for base in (root, os.path.join(root, "unified")):
            f = os.path.join(base, v2.lstrip("/"), "memory.events")
            if os.path.isfile(f):
                return f, ""
            tried.append(f)
    if v1 is not None:
        for mount in dict.fromkeys(("memory", v1[0])):
            f = os.path.join(root, mount, v1[1].lstrip("/"), "memory.oom_control")
            if os.path.isfile(f):
                return f, ""
            tried.append(f)
    if not tried:
        return None, "no memory cgroup in /proc/self/cgroup"
    return None, f"no readable oom_kill counter (tried {', '.join(tried)})"


def read_oom_counters(path: str) -> dict[str, int]:
    """The 'key value' lines of memory.events / memory.oom_control (oom_kill, oom, ...)."""
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                out[parts[0]] = int(parts[1])
    return out


def unit_of(cgroup_text: str) -> str | None:
    """The systemd unit (*.service) the wrapper runs in, from its cgroup path; None outside a service."""
    lines = _cgroup_lines(cgroup_text)
    ordered = [p for h, c, p in lines if h == "0" and not c] + [p for h, c, p in lines if "name=systemd" in c]
    for path in ordered + [p for _, _, p in lines]:
        services = [part for part in path.split("/") if part.endswith(".service")]
        if services:
            return services[-1]
    return None


def pids_in_group(pgid: int, proc: str = "/proc") -> list[int]:
    """Live (not zombie) pids whose process group is pgid."""
    out = []
    try:
        names = os.listdir(proc)
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat"), "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2 :].split()  # comm may contain spaces and ')'
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            out.append(int(name))
    return out


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


class Notifier:
    """sd_notify(3) without libsystemd: a datagram to $NOTIFY_SOCKET ('@' = abstract); no-op when unset."""

    def __init__(self, address: str | None) -> None:
        self.addr = None
        if address and address[0] in "/@":
            self.addr = "\0" + address[1:] if address[0] == "@" else address
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()

    def send(self, *fields: str) -> None:
        if not self.addr:
            return
        with self.lock:
            try:
                if self.sock is None:
                    self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self.sock.sendto("\n".join(fields).encode("utf-8", "replace"), self.addr)
            except OSError:
                pass  # systemd gone or not listening: the engine must keep running regardless


# --------------------------------------------------------------------------------------------
# Secrets


def read_credential(cred: str) -> str:
    hint = f"add LoadCredential={cred}:/path/to/secret-file to the unit's [Service] section"
    cdir = os.environ.get("CREDENTIALS_DIRECTORY")
    if not cdir:
        raise SetupError(f"credential {cred!r}: $CREDENTIALS_DIRECTORY is not set; {hint}")
    path = os.path.join(cdir, cred)
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read()
    except OSError as e:
        raise SetupError(f"credential {cred!r}: cannot read {path}: {e.strerror}; {hint}") from None
    value = value.rstrip("\r\n")
    if not value:
        raise SetupError(f"credential {cred!r}: {path} is empty; point LoadCredential={cred}: at the secret")
    return value


REDACTED = "***"
MIN_SECRET_PART = 8  # a line of a multi-line secret shorter than this is not redacted on its own


def secret_forms(value: str) -> list[str]:
    """What to redact for one secret value: the value as it is, as it looks inside a JSON string or a
    Python repr (SGLang logs ``server_args=ServerArgs(..., api_key='...')``), and each line of a
    multi-line secret (output is handled line by line). Longest first."""
    forms = {value, json.dumps(value)[1:-1], repr(value)[1:-1]}
    for part in re.split(r"\r\n|\n|\r", value):
        if len(part.strip()) >= MIN_SECRET_PART:
            forms.update({part, part.strip()})
    return sorted((f for f in forms if f), key=lambda f: (-len(f), f))


class Redactor:
    """Replaces every loaded secret value with ``***`` in bytes (the stream) and text (the record)."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.raw: list[bytes] = []

    def add(self, value: str) -> None:
        self.texts = sorted(set(self.texts) | set(secret_forms(value)), key=lambda f: (-len(f), f))
        self.raw = [t.encode("utf-8") for t in self.texts]

    def __bool__(self) -> bool:
        return bool(self.texts)

    def data(self, raw: bytes) -> bytes:
        for s in self.raw:
            if s in raw:
                raw = raw.replace(s, REDACTED.encode())
        return raw

    def text(self, text: str) -> str:
        for s in self.texts:
            if s in text:
                text = text.replace(s, REDACTED)
        return text

    def deep(self, obj: Any) -> Any:
        """A copy of a JSON-able value with every string redacted."""
        if not self.texts:
            return obj
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, dict):
            return {k: self.deep(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.deep(v) for v in obj]
        return obj

    def safe_cut(self, buf: bytes, cut: int) -> int:
        """Where to cut an over-long line so that no secret is split between two pieces (each piece is
        redacted on its own): before the longest tail of buf[:cut] that starts a secret."""
        for k in range(min(cut - 1, max((len(s) for s in self.raw), default=1) - 1), 0, -1):
            tail = buf[cut - k : cut]
            if any(s.startswith(tail) for s in self.raw):
                return cut - k
        return cut


def parse_secret_specs(env_specs: list[str], config_specs: list[str]) -> tuple[list, dict]:
    envs = []
    for spec in env_specs:
        m = _SECRET_ENV.fullmatch(spec)
        if not m:
            raise SetupError(f"--secret-env {spec!r}: expected VAR=CREDENTIAL")
        envs.append((m.group(1), m.group(2)))
    configs: dict[str, list] = {}
    for spec in config_specs:
        m = _SECRET_CONFIG.fullmatch(spec)
        if not m:
            raise SetupError(f"--secret-config {spec!r}: expected OPTION:KEY=CREDENTIAL (e.g. config:api_key=api-key)")
        configs.setdefault(m.group(1), []).append((m.group(2), m.group(3)))
    return envs, configs


# --------------------------------------------------------------------------------------------
# The wrapper


class Wrapper:
    def __init__(self, args: argparse.Namespace, cmd: list[str]) -> None:
        self.args = args
        self.cmd = cmd
        self.argv = list(cmd)
        self.obs = LogObserver(args.ready_regex, args.ready_count)
        self.notifier = Notifier(os.environ.get("NOTIFY_SOCKET"))
        self.cgroup_root = os.environ.get("LLMFLEET_CGROUP_ROOT", "/sys/fs/cgroup")
        try:
            with open("/proc/self/cgroup", encoding="utf-8") as f:
                self.cgroup_text = f.read()
        except OSError:
            self.cgroup_text = ""
        # out_lock: writes to stdout/stderr/log; lock: tail, phases, status file. Kept apart so that a stuck
        # stdout (journald) blocks only the readers, never the stop deadline in the main thread.
        self.out_lock = threading.Lock()
        self.lock = threading.Lock()
        self.closed = False
        self.dead_streams: set[int] = set()
        self.log = None
        self.tail: collections.deque = collections.deque(maxlen=max(0, args.tail_lines))
        self.last_extend = 0.0
        self.child_pid: int | None = None
        self.pending_signals: list[int] = []
        self.stop_requested = False
        self.stop_signal: int | None = None
        self.stop_requested_at: float | None = None
        self.killed_after_timeout = False
        self.stop_deadline: float | None = None
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.secret_files: list[str] = []
        self.redact = Redactor()  # every secret value loaded: never in the output, the record or the status
        self.secret_dir: str | None = None

    # ---- setup

    def _prepare_env(self) -> dict[str, str]:
        envs, configs = parse_secret_specs(self.args.secret_env or [], self.args.secret_config or [])
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)  # the wrapper owns the notify protocol: an engine's READY=1 would lie
        for var, cred in envs:
            env[var] = read_credential(cred)
            self.redact.add(env[var])
        values = {name: [(key, read_credential(cred)) for key, cred in items] for name, items in configs.items()}
        for items in values.values():
            for _key, value in items:
                self.redact.add(value)
        if values:
            rt = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
            if not rt:
                self.secret_dir = rt = tempfile.mkdtemp(prefix="llmfleet-exec-")  # mode 0700
            for name, items in values.items():
                fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".yaml", dir=rt)  # mode 0600
                self.secret_files.append(path)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    for key, value in items:
                        f.write(f"{key}: {json.dumps(value)}\n")  # a JSON string is a valid YAML scalar
                self.argv += [f"--{name}", path]
        return env

    def _cleanup_secrets(self) -> None:
        for path in self.secret_files:
            try:
                os.unlink(path)
            except OSError:
                pass
        if self.secret_dir:
            try:
                os.rmdir(self.secret_dir)
            except OSError:
                pass

    def _oom_read(self) -> tuple[str | None, dict[str, int] | None, str]:
        path, why = oom_counter_file(self.cgroup_text, self.cgroup_root)
        if path is None:
            return None, None, why
        try:
            counters = read_oom_counters(path)
        except OSError as e:
            return path, None, f"cannot read {path}: {e.strerror}"
        if "oom_kill" not in counters:
            return path, None, f"{path} has no oom_kill field (kernel < 4.13?)"
        return path, counters, ""

    # ---- signals (the handler runs in the main thread between bytecodes: no locks, no I/O but kill)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.child_pid is None:
            self.pending_signals.append(signum)
        else:
            _killpg(self.child_pid, signum)
        if signum in STOP_SIGNALS and not self.stop_requested:
            self.stop_signal = signum
            self.stop_requested_at = time.time()
            self.stop_requested = True

    # ---- output

    def _reader(self, fd: int, out: Any) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            pos = 0
            for m in _EOL.finditer(buf):
                self._line(buf[pos : m.end()], out)
                pos = m.end()
            buf = buf[pos:]
            while len(buf) >= MAX_LINE:
                cut = self.redact.safe_cut(buf, MAX_LINE) if self.redact else MAX_LINE
                self._line(buf[:cut], out)
                buf = buf[cut:]
        if buf:
            self._line(buf, out)

    def _line(self, raw: bytes, out: Any) -> None:
        if self.redact:  # engines log their own arguments (SGLang: server_args=... at info level)
            raw = self.redact.data(raw)
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        with self.out_lock:
            if self.closed:
                return
            if out is not None and id(out) not in self.dead_streams:
                try:
                    out.write(raw)
                    out.flush()
                except (OSError, ValueError):  # EPIPE: journald gone; keep draining so the engine never blocks
                    self.dead_streams.add(id(out))
            if self.log is not None:
                try:
                    self.log.write(raw)
                    self.log.flush()
                except OSError as e:
                    _err(f"--log-file: {e.strerror}; no longer copying output there")
                    self.log = None
        if text.strip():
            with self.lock:
                self.tail.append(text)
                self._observe(text)

    def _observe(self, text: str) -> None:
        """Phases, READY, errors (caller holds self.lock)."""
        ev = self.obs.feed(text, time.time())
        if ev["phase"]:
            self.notifier.send(f"STATUS=engine phase: {ev['phase']}")
            self._extend()  # a new phase is progress too (graph capture alone can take minutes)
            self._write_status()
        if ev["progress"]:
            self._extend()
        if ev["ready"]:
            self.notifier.send("READY=1", f"STATUS=ready: engine phase {self.obs.phase_name()}")
            self._write_status()

    def _extend(self) -> None:
        """Push systemd's start timeout out while the engine makes progress (loading takes minutes)."""
        now = time.monotonic()
        if not self.obs.ready and now - self.last_extend >= EXTEND_EVERY_S:
            self.last_extend = now
            self.notifier.send(f"EXTEND_TIMEOUT_USEC={int(self.args.extend_timeout * 1e6)}")

    # ---- record

    def _base(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "host": socket.gethostname(),
            "unit": unit_of(self.cgroup_text),
            "invocation_id": os.environ.get("INVOCATION_ID") or None,
            "argv": self.argv,
            "wrapper_pid": os.getpid(),
            "child_pid": self.child_pid,
            "started_at": self.started_at,
            "started_at_iso": _iso(self.started_at),
            "stop_requested": self.stop_requested,
            "stop_signal": signal_name(self.stop_signal),
            "stop_requested_at": self.stop_requested_at,
            "killed_after_timeout": self.killed_after_timeout,
            "phase": self.obs.phase_name(),
            "phases": list(self.obs.phases),
            "ready": self.obs.ready,
            "ready_at": self.obs.ready_at,
            "failed_rank": self.obs.failed_rank,
            "first_error": self.obs.first_error,
        }

    def _write_status(self) -> None:
        """Live status (caller holds self.lock)."""
        if not self.args.status:
            return
        data = self._base()
        data["running"] = True
        data["tail"] = list(self.tail)
        try:
            write_json_atomic(self.args.status, self.redact.deep(data))
        except OSError as e:
            _err(f"--status {self.args.status}: {e.strerror}")

    def _finish(self, code: int, verdict: str, reason: str, *, child: dict, oom: dict | None, left: int) -> None:
        self.ended_at = time.time()
        with self.lock:
            rec = self._base()
            rec.update(
                ended_at=self.ended_at,
                ended_at_iso=_iso(self.ended_at),
                duration_s=round(self.ended_at - self.started_at, 3),
                child=child,
                exit_code=code,
                verdict=verdict,
                reason=reason,
                oom_kill=oom,
                left_over_pids=left,
                tail=list(self.tail),
            )
            rec = self.redact.deep({k: rec[k] for k in RECORD_KEYS})
        for path, data in ((self.args.record, rec), (self.args.status, dict(rec, running=False))):
            if path:
                try:
                    write_json_atomic(path, data)
                except OSError as e:
                    _err(f"cannot write {path}: {e.strerror}")
        self.notifier.send(f"STATUS=engine ended: {verdict}, exit {code}")
        _err(f"{verdict}: exit {code}: {rec['reason']}")

    def _hint(self) -> str:
        if self.obs.failed_rank:
            r = self.obs.failed_rank
            tag = " ".join(f"{k.upper()}{r[k]}" for k in ("tp", "pp") if r[k] is not None)
            tag = tag or f"rank {r['rank']}"
            return f"first error line with a rank tag is from {tag}: {r['line'][:200]}"
        if self.obs.first_error:
            return f"first error line: {self.obs.first_error['line'][:200]}"
        return "no error line in the output; look at the tail"

    def _reason(self, verdict: str, code: int, child: dict[str, Any], oom: dict | None, oom_why: str) -> str:
        """One sentence: what happened and what to look at."""
        sig_name, stop, hint = child["signal_name"], signal_name(self.stop_signal), self._hint()
        oom_note = ""
        if oom and oom["delta"] > 0:
            oom_note = f" (the cgroup's oom_kill counter rose by {oom['delta']} during the run: OOM kill)"
        if verdict == "clean-stop":
            how = f"by {sig_name}" if sig_name else f"with code {child['exit_code']}"
            msg = f"stopped on request ({stop}): the engine exited {how}"
        elif verdict == "stop-timeout":
            msg = (
                f"child ignored {stop} for {self.args.stop_timeout:g} s; killed the process group with SIGKILL "
                f"(raise --stop-timeout and TimeoutStopSec if shutdown is legitimately slow); {hint}"
            )
        elif verdict == "unrequested-exit-0":
            msg = (
                "the engine exited 0 without being asked to stop: an engine exiting 0 on its own is treated as a "
                f"failure (exit {EXIT_UNREQUESTED}) so Restart=on-failure fires (vLLM exits 0 when a worker dies; a "
                "shell pipeline like 'engine | tee' reports the last command's status and hides the engine's)"
                f"{oom_note}; {hint}"
            )
        elif verdict == "exit-code":
            who = f"stop requested ({stop}) but the engine" if self.stop_requested else "the engine"
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

    # ---- run

    def run(self) -> int:
        try:
            return self._run()
        finally:
            self._cleanup_secrets()
            if self.log is not None:
                self.log.close()

    def _setup(self) -> dict[str, str]:
        env = self._prepare_env()
        if self.args.log_file:
            os.makedirs(os.path.dirname(os.path.abspath(self.args.log_file)), exist_ok=True)
            self.log = open(self.args.log_file, "ab")  # closed once the readers are done
        if self.args.record:
            try:
                rotate(self.args.record)
            except OSError as e:
                _err(f"cannot rotate {self.args.record}: {e.strerror}")
        return env

    def _run(self) -> int:
        try:
            env = self._setup()
        except SetupError as e:
            _err(f"{e}; the engine was not started")
            return EXIT_USAGE
        except OSError as e:
            _err(f"{e.filename}: {e.strerror}; the engine was not started")
            return EXIT_USAGE
        oom_src, oom_before, oom_why = self._oom_read()
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, self._on_signal)
        self.started_at = time.time()
        try:
            proc = subprocess.Popen(
                self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env=env, bufsize=0
            )
        except OSError as e:
            code = EXIT_NOT_FOUND if isinstance(e, FileNotFoundError) else EXIT_NOT_EXECUTABLE
            child = {"exit_code": None, "signal": None, "signal_name": None, "core_dumped": False}
            why = f"cannot execute {self.argv[0]!r}: {e.strerror}; check the command and the unit's PATH"
            self._finish(code, "exec-failed", why, child=child, oom=None, left=0)
            return code
        self.child_pid = proc.pid
        pending, self.pending_signals = self.pending_signals, []
        for sig in pending:
            _killpg(proc.pid, sig)
        with self.lock:
            self._write_status()
        self.notifier.send(f"STATUS=started {os.path.basename(self.argv[0])} (pid {proc.pid})")
        pipes = (proc.stdout, proc.stderr)
        readers = []
        for pipe, out in zip(pipes, (sys.stdout, sys.stderr)):
            t = threading.Thread(target=self._reader, args=(pipe.fileno(), getattr(out, "buffer", None)), daemon=True)
            t.start()
            readers.append(t)

        status = self._wait(proc.pid)
        proc.returncode = -1  # reaped with os.waitpid: keep Popen from reaping or warning
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        core = bool(sig is not None and os.WCOREDUMP(status))
        left = self._kill_leftovers(proc.pid)

        oom = None
        _, oom_after, why_after = self._oom_read()
        if oom_before is not None and oom_after is not None:
            oom = {
                "source": oom_src,
                "before": oom_before["oom_kill"],
                "after": oom_after["oom_kill"],
                "delta": oom_after["oom_kill"] - oom_before["oom_kill"],
                # cgroup v2 only: times the cgroup hit its limit (OOM killer invoked, maybe nothing killed)
                "oom_events_delta": oom_after["oom"] - oom_before["oom"] if "oom" in oom_before else None,
            }
        oom_why = oom_why or why_after

        self._drain(readers, pipes)
        code, verdict = decide(
            stop_requested=self.stop_requested,
            killed_after_timeout=self.killed_after_timeout,
            exit_code=exit_code,
            sig=sig,
            core=core,
            oom=oom["delta"] if oom else 0,
        )
        child = {"exit_code": exit_code, "signal": sig, "signal_name": signal_name(sig), "core_dumped": core}
        reason = self._reason(verdict, code, child, oom, oom_why)
        self._finish(code, verdict, reason, child=child, oom=oom, left=left)
        return code

    def _kill_leftovers(self, pgid: int) -> int:
        """Orphaned ranks must never keep running (and holding GPUs): SIGKILL what is left of the group."""
        left = pids_in_group(pgid)
        _killpg(pgid, signal.SIGKILL)
        end = time.monotonic() + LEFTOVER_WAIT_S
        while left and pids_in_group(pgid) and time.monotonic() < end:
            time.sleep(0.02)
        return len(left)

    def _drain(self, readers: list[threading.Thread], pipes: tuple) -> None:
        end = time.monotonic() + READER_JOIN_S
        for t in readers:
            t.join(max(0.0, end - time.monotonic()))
        # Readers still blocked (a pipe held outside the group) must not write any more. A reader stuck in a
        # write to a full stdout holds out_lock: do not wait for it forever.
        got = self.out_lock.acquire(timeout=1.0)
        self.closed = True
        if got:
            if self.log is not None:
                self.log.close()
                self.log = None
            self.out_lock.release()
        for t, pipe in zip(readers, pipes):
            if not t.is_alive():  # closing an fd another thread reads from could hit a reused fd number
                pipe.close()

    def _wait(self, pid: int) -> int:
        """Poll the child (a blocking waitpid could not also watch the stop deadline) and act on stop requests."""
        while True:
            got, status = os.waitpid(pid, os.WNOHANG)
            self._stop_bookkeeping()  # also when the child died of the forwarded signal at once
            if got == pid:
                return status
            if self.stop_deadline is not None and not self.killed_after_timeout:
                if time.monotonic() >= self.stop_deadline:
                    self.killed_after_timeout = True
                    _killpg(pid, signal.SIGKILL)
            time.sleep(POLL_S)

    def _stop_bookkeeping(self) -> None:
        if self.stop_requested and self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.args.stop_timeout
            self.notifier.send("STOPPING=1", f"STATUS=stopping ({signal_name(self.stop_signal)})")
            with self.lock:
                self._write_status()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="llmfleet exec",
        usage="llmfleet exec [options] -- CMD [ARG...]",
        description="Run an engine as the main process of a systemd unit: pass its output through, forward "
        "SIGTERM/SIGINT/SIGHUP to its process group, send sd_notify READY/STATUS/EXTEND_TIMEOUT_USEC/STOPPING, "
        "and write a termination record. Details: docs/wrapper.md.",
        epilog=f"exit codes: 0 stopped on request; {EXIT_UNREQUESTED} the engine exited 0 without a stop request; "
        "n the engine's exit code; 128+s killed by signal s (137 also: ignored the stop signal past --stop-timeout); "
        "2 usage or missing credential; 126/127 cannot execute CMD.",
    )
    ap.add_argument("--record", metavar="FILE", help="termination record (JSON), previous ones kept as FILE.1..5")
    ap.add_argument("--status", metavar="FILE", help="live status (JSON), rewritten on each phase change")
    ap.add_argument("--log-file", metavar="FILE", help="also append the engine's output to FILE")
    ap.add_argument("--tail-lines", type=int, default=200, metavar="N", help="output lines kept in the record")
    ap.add_argument("--stop-timeout", type=float, default=60.0, metavar="SEC", help="SIGKILL the group this long "
                    "after a stop request (default 60; keep it below the unit's TimeoutStopSec)")  # fmt: skip
    ap.add_argument("--extend-timeout", type=float, default=300.0, metavar="SEC", help="EXTEND_TIMEOUT_USEC sent on "
                    "progress before READY (default 300)")  # fmt: skip
    ap.add_argument("--ready-regex", metavar="RE", help="READY=1 once RE matched --ready-count lines "
                    "(default: the serving phase)")  # fmt: skip
    ap.add_argument("--ready-count", type=int, default=1, metavar="N", help="lines matching --ready-regex needed")
    ap.add_argument("--secret-env", action="append", metavar="VAR=CRED", help="set VAR for the engine from "
                    "$CREDENTIALS_DIRECTORY/CRED (LoadCredential=)")  # fmt: skip
    ap.add_argument("--secret-config", action="append", metavar="OPT:KEY=CRED", help="write 'KEY: <secret>' to a "
                    "private YAML file and pass --OPT FILE to the engine")  # fmt: skip
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, cmd = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, None)
    ap = build_parser()
    try:
        args = ap.parse_args(opts)
    except SystemExit as e:  # argparse already printed the usage error (or --help)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    problem = None
    if cmd is None:
        problem = "missing '--' before the engine command (llmfleet exec [options] -- CMD [ARG...])"
    elif not cmd:
        problem = "no command after '--'"
    elif args.tail_lines < 0 or args.ready_count < 1 or args.stop_timeout <= 0 or args.extend_timeout <= 0:
        problem = "--tail-lines must be >= 0, --ready-count >= 1, --stop-timeout and --extend-timeout > 0"
    else:
        try:
            re.compile(args.ready_regex or DEFAULT_READY_REGEX)
            parse_secret_specs(args.secret_env or [], args.secret_config or [])
        except re.error as e:
            problem = f"--ready-regex {args.ready_regex!r}: {e}"
        except SetupError as e:
            problem = str(e)
    if problem:
        _err(problem)
        return EXIT_USAGE
    return Wrapper(args, cmd).run()


if __name__ == "__main__":
    sys.exit(main())
