"""Readers of an incident bundle's files for ``llmfleet why`` (triage.py): ``journalctl -o short-iso`` lines,
``systemctl show`` key=value text, ``nvidia-smi -q`` bus ids, Python tracebacks in an engine's journal, and the
kernel's OOM / Xid / NFS / hung-task / I/O / segfault lines. Pure: text in, records out; no judgement (that is
triage_rules.py). Stdlib only, Python >= 3.8.
"""

from __future__ import annotations

import calendar
import re
import time
from dataclasses import dataclass
from typing import Any

from ...engine.logobserver import log_level, rank_of

TEXT_KEEP = 300  # characters of a line quoted as evidence


@dataclass
class Line:
    """One journal line. at: epoch seconds (UTC) or None; ident/pid: the syslog identifier and [pid]."""

    __slots__ = ("at", "file", "ident", "msg", "no", "pid")  # a bundle may hold millions of lines
    file: str
    no: int
    at: float | None
    ident: str
    pid: int | None
    msg: str

    def ref(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.no, "text": self.msg.strip()[:TEXT_KEEP]}


# `2026-12-01T03:14:07+0000 host ident[pid]: msg` (systemd < 250 prints +0000, newer +00:00; short-iso-precise
# adds microseconds).
_JOURNAL = re.compile(
    r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:[.,](\d+))?(Z|[+-]\d\d:?\d\d)\s+(\S+)\s+([^\s\[]+?)(?:\[(\d+)\])?:(?:\s(.*))?$"
)


_SECONDS: dict[str, float] = {}  # journal lines share their second: parsed once (strptime is the slow part)


def iso_epoch(stamp: str, frac: str | None, tz: str) -> float:
    """`2026-12-01T03:14:07` (+ fraction digits, + `Z`/`+0000`/`+00:00`) -> epoch seconds."""
    t = _SECONDS.get(stamp)
    if t is None:
        if len(_SECONDS) > 100000:
            _SECONDS.clear()
        t = _SECONDS[stamp] = float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S")))
    if frac:
        t += float("0." + frac)
    if tz != "Z":
        sign = 1 if tz[0] == "+" else -1
        t -= sign * (int(tz[1:3]) * 3600 + int(tz[-2:]) * 60)
    return t


def iso(t: float | None) -> str | None:
    """UTC, second precision (the journal's short-iso has no more)."""
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def parse_journal(text: str, file: str) -> tuple[list[Line], dict[str, Any]]:
    """Lines of `journalctl -o short-iso`. A line that does not start with a timestamp continues the entry above
    (journalctl indents a multi-line message by the prefix's width; that indent is removed). `-- ... --` marker
    lines are skipped; `-- Boot ... --` / `-- Reboot --` are counted. stats: lines, parsed, orphans (text before
    any timestamped line), boots."""
    out: list[Line] = []
    stats = {"lines": 0, "parsed": 0, "orphans": 0, "boots": []}
    prev: Line | None = None
    width = 0
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip("\r")
        if not line.strip():
            continue
        stats["lines"] += 1
        if line.startswith("-- ") and line.rstrip().endswith("--"):
            if "Boot" in line or "Reboot" in line:
                stats["boots"].append(no)
            continue
        m = _JOURNAL.match(line)
        if m:
            stamp, frac, tz, _host, ident, pid, msg = m.groups()
            prev = Line(file, no, iso_epoch(stamp, frac, tz), ident, int(pid) if pid else None, msg or "")
            width = len(line) - len(msg or "")
            stats["parsed"] += 1
            out.append(prev)
        elif prev is not None:
            cut = len(line) - len(line.lstrip(" "))
            out.append(Line(file, no, prev.at, prev.ident, prev.pid, line[min(cut, width) :]))
        else:
            stats["orphans"] += 1
    return out, stats


def parse_show(text: str) -> dict[str, str]:
    """`systemctl show UNIT`: KEY=VALUE per line (the first '=' splits)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, eq, value = line.partition("=")
        if eq and key and " " not in key:
            out[key.strip()] = value.rstrip("\r")
    return out


def slice_path(slice_name: str) -> str:
    """systemd's cgroup path of a slice: `system-vllm\\x2dreplica.slice` ->
    `/system.slice/system-vllm\\x2dreplica.slice` (each '-' is a level; an escaped dash is `\\x2d` and is not one)."""
    if not slice_name or slice_name == "-.slice":
        return ""
    parts = slice_name[: -len(".slice")].split("-") if slice_name.endswith(".slice") else [slice_name]
    return "".join("/" + "-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


# ---- nvidia-smi -------------------------------------------------------------------------------------------------

_BDF = re.compile(r"([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.[0-7])?")
_SMI_HEADER = re.compile(r"^GPU\s*([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s*$")
_SMI_BUSID = re.compile(r"^\s*Bus Id\s*:\s*(\S+)")
_SMI_UNREACHABLE = re.compile(r"Unable to determine the device handle for GPU\s*(\S+?):? ")
_SMI_CSV = re.compile(r"^\s*(\d+),\s*([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])")


def bdf_key(text: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of `0000:18:00`, `00000000:18:00.0`, `PCI:0000:18:00`; None if none."""
    m = _BDF.search(text)
    return (int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16)) if m else None


def gpu_indices(text: str) -> tuple[dict[tuple[int, int, int], int], set[tuple[int, int, int]]]:
    """GPU index by PCI address from `nvidia-smi -q` (or `--query-gpu=index,pci.bus_id --format=csv`), and the
    addresses nvidia-smi could not reach. Without explicit indexes the index is the position in PCI bus order,
    which is how nvidia-smi numbers GPUs (a GPU it could not reach still takes its place)."""
    explicit: dict[tuple[int, int, int], int] = {}
    seen: set[tuple[int, int, int]] = set()
    unreachable: set[tuple[int, int, int]] = set()
    for line in text.splitlines():
        for rx, target in ((_SMI_HEADER, seen), (_SMI_BUSID, seen), (_SMI_UNREACHABLE, unreachable)):
            m = rx.search(line)
            key = bdf_key(m.group(1)) if m else None
            if key:
                target.add(key)
                seen.add(key)
        m = _SMI_CSV.match(line)
        key = bdf_key(m.group(2)) if m else None
        if m and key:
            explicit[key] = int(m.group(1))
    if explicit:
        return explicit, unreachable
    return {k: i for i, k in enumerate(sorted(seen))}, unreachable


# ---- engine output: prefixes and tracebacks ---------------------------------------------------------------------

# vLLM `(EngineCore pid=12133) ERROR 11-30 20:48:01 [core.py:1512] ` (level part absent on raw stderr lines),
# torch's `[rank0]: `, SGLang's `[2026-12-01 03:10:44 TP3] `.
_VLLM_PREFIX = re.compile(
    r"^\((?P<tag>[^)]*\bpid=(?P<pid>\d+)[^)]*)\)\s"
    r"(?:(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d\s+\[[^\]]*\]\s?)?"
)
_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:\s?")
_SGL_PREFIX = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?: [^\]]*)?\]\s")
_TB_START = re.compile(r"Traceback \(most recent call last\):\s*$")
_TB_FRAME = re.compile(r'^\s*File "(.+?)", line (\d+), in (.+?)\s*$')
_TB_CHAIN = re.compile(r"^(During handling of the above exception|The above exception was the direct cause)")
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")
_EXC_NAME = re.compile(r"Error|Exception|Exit|Interrupt|Warning|Fault|Failure|^[A-Z][a-z]")
EXTRA_KEEP = 4  # message lines after the exception line (NCCL's `Last error:` ...)


def engine_text(msg: str) -> tuple[str, str, str | None]:
    """(stream key, text without the engine's prefix, the prefix's log level). The key keeps the lines of one
    process together: a vLLM tag, a torch rank, or "raw" (SGLang and tracebacks printed to stderr carry no tag on
    their continuation lines)."""
    m = _VLLM_PREFIX.match(msg)
    if m:
        return m.group("tag"), msg[m.end() :], m.group("level")
    m = _RANK_PREFIX.match(msg)
    if m:
        return f"rank{m.group(1)}", msg[m.end() :], None
    m = _SGL_PREFIX.match(msg)
    if m:
        return "raw", msg[m.end() :], None
    return "raw", msg, None


def _exception_line(text: str) -> tuple[str, str] | None:
    if not text or text[0].isspace() or log_level(text) is not None:
        return None
    m = _EXC_LINE.match(text)
    if not m or m.group(1) == "File":
        return None
    name = m.group(1).rsplit(".", 1)[-1]
    if name.isupper() or not _EXC_NAME.search(name):
        return None
    return m.group(1), (m.group(2) or "").strip()


def short_path(path: str) -> str:
    """`<venv>/lib/python3.11/site-packages/vllm/v1/engine/core.py` -> `vllm/v1/engine/core.py`."""
    for cut in ("site-packages/", "dist-packages/"):
        if cut in path:
            return path.split(cut, 1)[1]
    return path


def find_tracebacks(lines: list[Line]) -> list[dict[str, Any]]:
    """Python tracebacks in engine output, each {"type", "message", "extra", "frames" [{file, line, func}],
    "start" Line, "end" Line, "nos" (its line numbers), "key", "rank"}, in the order they ended. Lines of several
    processes may interleave; each stream key has its own traceback under way. A traceback cut short (no exception
    line) is dropped."""
    open_tb: dict[str, dict[str, Any]] = {}
    done: list[dict[str, Any]] = []
    for ln in lines:
        key, text, level = engine_text(ln.msg)
        tb = open_tb.get(key)
        if _TB_START.search(text):
            open_tb[key] = {"frames": [], "start": ln, "key": key, "rank": rank_of(ln.msg), "state": "frames",
                            "level": level, "nos": [ln.no]}  # fmt: skip
            continue
        if tb is None:
            continue
        if tb["state"] == "extra":
            # The message goes on in lines of the same process at the same level (NCCL's `Last error:` ...).
            more = text.strip() and len(tb["extra"]) < EXTRA_KEEP and level == tb["level"]
            if more and not any(rx.search(text) for rx in (_TB_FRAME, _TB_START, _TB_CHAIN)) and not log_level(text):
                tb["extra"].append(text.strip())
                tb["end"] = ln
                tb["nos"].append(ln.no)
            else:
                del open_tb[key]
            continue
        fm = _TB_FRAME.match(text)
        if fm:
            tb["frames"].append({"file": short_path(fm.group(1)), "line": int(fm.group(2)), "func": fm.group(3)})
            tb["nos"].append(ln.no)
            continue
        exc = _exception_line(text)
        if exc:
            tb.update(type=exc[0], message=exc[1], extra=[], end=ln, state="extra")
            tb["nos"].append(ln.no)
            done.append(tb)
            continue
        if text.startswith((" ", "\t")) or not text.strip() or set(text.strip()) <= set("^~ "):
            tb["nos"].append(ln.no)  # a source line or its ^^^^ marks
        else:
            del open_tb[key]  # something else interrupted it: not a traceback we can read
    for tb in done:
        tb.pop("state", None)
    return done


# ---- kernel log -------------------------------------------------------------------------------------------------

_OOM_INVOKED = re.compile(r"^(.+?) invoked oom-killer:")
_OOM_KILL = re.compile(r"^oom-kill:(.*)$")
_OOM_FIELD = re.compile(r"(?:^|,)(constraint|oom_memcg|task_memcg|task|pid|uid)=([^,]*)")
_OOM_KILLED = re.compile(
    r"^(Memory cgroup out of memory|Out of memory(?: \([\w ]+\))?): Killed process (\d+) \((.*?)\)"
    r"(?:.*?anon-rss:(\d+)kB)?"
)
_OOM_OLD_TASK = re.compile(r"^Task in (\S+) killed as a result of limit of (\S+)")
_OOM_USAGE = re.compile(r"^memory: usage (\d+)kB, limit (\d+)kB")
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.\d)?\): (\d+),\s*(.*)$")
_XID_PID = re.compile(r"pid='?<?([\w]+)>?'?")
_XID_NAME = re.compile(r"name=([^,]+)")
_NFS = re.compile(r"^nfs: server (\S+) (not responding|OK)\b")
_HUNG = re.compile(r"^INFO: task (.+):(\d+) blocked for more than (\d+) seconds\.")
_TRACE_FN = re.compile(r"^\s*([\w.]+)\+0x[0-9a-f]+/0x[0-9a-f]+(?:\s+\[(\w+)\])?")  # `? fn+0x..` frames are guesses
_IO = (
    re.compile(r"(?:blk_update_request: )?(?:critical \w+ )?I/O error, dev (\w+), sector (\d+)"),
    re.compile(r"^Buffer I/O error on dev (\S+), logical block (\d+)"),
    re.compile(r"^nvme (nvme\d+): I/O (?:tag )?\d+ .*QID \d+ timeout"),
    re.compile(r"^nvme (nvme\d+): controller is down"),
    re.compile(r"^EXT4-fs error \(device (\S+)\)"),
    re.compile(r"^XFS \((\S+)\): .*(?:I/O error|Corruption)"),
)
_SEGV = re.compile(r"^(\S+)\[(\d+)\]: segfault at ")
_SEGV_LIB = re.compile(r" in ([^\s\[]+)\[")
_TRAPS = re.compile(r"^traps: (\S+)\[(\d+)\] (general protection|trap)")
HUNG_TRACE_LINES = 40  # call-trace lines read after a hung-task line


IO_BURST_S = 60  # I/O errors of one device this close together are one event


class _KernelReader:
    """Turns `journalctl -k` lines into events; each handler says whether the line was its kind."""

    def __init__(self, lines: list[Line]) -> None:
        self.lines = lines
        self.events: list[dict[str, Any]] = []
        self.oom: dict[str, Any] | None = None  # an OOM report under way (invoked ... Killed process)
        self.nfs_down: dict[str, dict[str, Any]] = {}  # server -> its outage under way
        self.io_last: dict[str, dict[str, Any]] = {}  # device -> its last I/O error event

    def read(self) -> list[dict[str, Any]]:
        handlers = (self._oom_invoked, self._oom_usage, self._oom_fields, self._oom_killed, self._xid, self._nfs,
                    self._hung, self._io, self._segfault)  # fmt: skip
        for i, ln in enumerate(self.lines):
            msg = ln.msg.strip()
            any(h(i, ln, msg) for h in handlers)
        if self.oom is not None and ("task_memcg" in self.oom or "pid" in self.oom):  # no `Killed process` line
            self.events.append(self.oom)
        self.events.sort(key=lambda e: (e["at"] is None, e["at"] or 0))
        return self.events

    def _oom_event(self, ln: Line) -> dict[str, Any]:
        if self.oom is None:
            self.oom = {"kind": "oom", "at": ln.at, "lines": []}
        return self.oom

    def _oom_invoked(self, _i: int, ln: Line, msg: str) -> bool:
        m = _OOM_INVOKED.match(msg)
        if m:
            self.oom = {"kind": "oom", "at": ln.at, "lines": [ln], "invoker": m.group(1)}
        return bool(m)

    def _oom_usage(self, _i: int, _ln: Line, msg: str) -> bool:
        m = _OOM_USAGE.match(msg)
        if m and self.oom is not None:
            self.oom["usage_kb"], self.oom["limit_kb"] = int(m.group(1)), int(m.group(2))
        return bool(m)

    def _oom_fields(self, _i: int, ln: Line, msg: str) -> bool:
        old, new = _OOM_OLD_TASK.match(msg), _OOM_KILL.match(msg)
        if old:  # kernels before 4.19: `Task in CG killed as a result of limit of CG`
            self._oom_event(ln).update(task_memcg=old.group(1), oom_memcg=old.group(2))
        elif new:
            fields = dict(_OOM_FIELD.findall(new.group(1)))
            ev = self._oom_event(ln)
            ev.update({k: v for k, v in fields.items() if k != "pid"}, global_oom="global_oom" in new.group(1))
            if fields.get("pid", "").isdigit():
                ev["pid"] = int(fields["pid"])
        else:
            return False
        self._oom_event(ln)["lines"].append(ln)
        return True

    def _oom_killed(self, _i: int, ln: Line, msg: str) -> bool:
        m = _OOM_KILLED.match(msg)
        if not m:
            return False
        ev = self._oom_event(ln)
        ev.update(pid=int(m.group(2)), task=m.group(3), memcg_oom=m.group(1).startswith("Memory"))
        if m.group(4):
            ev["anon_rss_kb"] = int(m.group(4))
        ev["lines"].append(ln)
        ev["at"] = ln.at if ln.at is not None else ev["at"]
        self.events.append(ev)
        self.oom = None
        return True

    def _xid(self, _i: int, ln: Line, msg: str) -> bool:
        m = _XID.search(msg)
        if m:
            rest = m.group(3)
            pid, name = _XID_PID.search(rest), _XID_NAME.search(rest)
            self.events.append({
                "kind": "xid", "at": ln.at, "lines": [ln], "pci": m.group(1), "xid": int(m.group(2)),
                "pid": int(pid.group(1)) if pid and pid.group(1).isdigit() else None,
                "name": name.group(1).strip() if name else None, "text": rest,
            })  # fmt: skip
        return bool(m)

    def _nfs(self, _i: int, ln: Line, msg: str) -> bool:
        m = _NFS.match(msg)
        if not m:
            return False
        server = m.group(1)
        if m.group(2) == "OK":
            outage = self.nfs_down.pop(server, None)
            if outage is not None:
                outage["back_at"], outage["back_line"] = ln.at, ln
        elif server in self.nfs_down:
            self.nfs_down[server]["repeats"] += 1
        else:
            self.nfs_down[server] = {"kind": "nfs", "at": ln.at, "lines": [ln], "server": server, "back_at": None,
                                     "back_line": None, "repeats": 0}  # fmt: skip
            self.events.append(self.nfs_down[server])
        return True

    def _hung(self, i: int, ln: Line, msg: str) -> bool:
        m = _HUNG.match(msg)
        if not m:
            return False
        funcs, mods = [], set()
        for nxt in self.lines[i + 1 : i + 1 + HUNG_TRACE_LINES]:
            if _HUNG.match(nxt.msg.strip()):
                break
            t = _TRACE_FN.match(nxt.msg)
            if t:
                funcs.append(t.group(1))
                mods.update([t.group(2)] if t.group(2) else [])
        self.events.append({"kind": "hung", "at": ln.at, "lines": [ln], "task": m.group(1), "pid": int(m.group(2)),
                            "seconds": int(m.group(3)), "funcs": funcs, "modules": sorted(mods)})  # fmt: skip
        return True

    def _io(self, _i: int, ln: Line, msg: str) -> bool:
        m = next((m for m in (rx.search(msg) for rx in _IO) if m), None)
        if not m:
            return False
        dev = m.group(1)
        last = self.io_last.get(dev)
        if last and ln.at is not None and last["last_at"] is not None and ln.at - last["last_at"] <= IO_BURST_S:
            last["count"] += 1
            last["last_at"] = ln.at
        else:
            self.io_last[dev] = {"kind": "io", "at": ln.at, "lines": [ln], "dev": dev, "count": 1, "last_at": ln.at}
            self.events.append(self.io_last[dev])
        return True

    def _segfault(self, _i: int, ln: Line, msg: str) -> bool:
        m = _SEGV.match(msg) or _TRAPS.match(msg)
        if m:
            lib = _SEGV_LIB.search(msg)
            self.events.append({"kind": "segfault", "at": ln.at, "lines": [ln], "task": m.group(1),
                                "pid": int(m.group(2)), "lib": lib.group(1) if lib else None})  # fmt: skip
        return bool(m)


def kernel_events(lines: list[Line]) -> list[dict[str, Any]]:
    """Events of `journalctl -k`, in time order: {"kind": oom|xid|nfs|hung|io|segfault, "at", "lines" [Line], ...}.
    An NFS event is one outage of a server, from its first `not responding` to its `OK` ("back_at", None while it
    lasts); an I/O event is a burst of errors on one device ("count")."""
    return _KernelReader(lines).read()
