"""The kernel's events (triage_parse.kernel_events) judged for one unit of ``llmfleet why``: each becomes a cause
candidate of the unit's own (its cgroup's OOM kill, a GPU fault or hung task or segfault of its process), a
node-wide candidate (a hardware Xid, an NFS outage, I/O errors: triage_unit decides whether they explain this
unit's failure), or a red herring with the reason. Stdlib only, Python >= 3.8.
"""

from __future__ import annotations

from typing import Any, Protocol

from .parse import Line, bdf_key, iso
from .rules import xid_info


class UnitView(Protocol):
    """What a judgement needs of the unit (triage_unit.UnitAnalysis)."""

    pids: set[int]
    cgroup: str
    gpus: dict[tuple[int, int, int], int]
    gpus_gone: set[tuple[int, int, int]]

    def who(self, pid: int | None, text: str) -> str: ...


def cand(kind: str, at: float | None, lines: list[Line], text: str, strong: bool, **details: Any) -> dict[str, Any]:
    """A cause candidate: kind (a verdict), first time, evidence lines, sentence, strong (a cause of its own,
    not a symptom of a failure elsewhere)."""
    return {"kind": kind, "at": at, "evidence": [ln.ref() for ln in lines], "text": text, "strong": strong,
            "details": details}  # fmt: skip


def in_cgroup(path: str | None, cg: str) -> bool:
    return bool(path) and (path == cg or str(path).startswith(cg.rstrip("/") + "/"))


def gib(kb: int) -> str:
    return f"{kb / 1048576:.1f} GiB" if kb >= 1048576 else f"{kb // 1024} MiB"


def _ruled(what: str, why: str, lines: list[Line] | list[dict[str, Any]]) -> dict[str, Any]:
    refs = [x.ref() if isinstance(x, Line) else x for x in lines]
    return {"what": what, "why": why, "evidence": refs}


class KernelJudge:
    """Sorts one node's kernel events for one run of one unit. lo/hi: the run's window (None: unbounded)."""

    def __init__(self, unit: UnitView, lo: float | None, hi: float | None) -> None:
        self.u, self.lo, self.hi = unit, lo, hi
        self.own: list[dict[str, Any]] = []
        self.node_wide: list[dict[str, Any]] = []
        self.ruled: list[dict[str, Any]] = []

    def judge(self, events: list[dict[str, Any]]) -> KernelJudge:
        handlers = {"oom": self._oom, "xid": self._xid, "nfs": self._storage, "io": self._storage,
                    "hung": self._hung, "segfault": self._segfault}  # fmt: skip
        for ev in events:
            handlers[ev["kind"]](ev)
        return self

    def _when(self, at: float | None) -> str:
        """'' inside the run's window, else why not."""
        if at is None:
            return ""
        if self.lo is not None and at < self.lo:
            return " before this run started"
        if self.hi is not None and at > self.hi:
            return " after the unit had ended"
        return ""

    def _mine(self, ev: dict[str, Any]) -> bool:
        return ev.get("pid") in self.u.pids

    def _oom(self, ev: dict[str, Any]) -> None:
        tcg = ev.get("task_memcg")
        mine = in_cgroup(tcg, self.u.cgroup) if tcg else self._mine(ev)  # the cgroup decides where the kernel says it
        when = self._when(ev["at"])
        what = f"OOM kill of {ev.get('task')} (pid {ev.get('pid')}) in {tcg or 'an unnamed cgroup'}"
        if mine and not when:
            details = {k: ev.get(k) for k in ("task", "pid", "task_memcg", "oom_memcg", "constraint", "limit_kb",
                                              "anon_rss_kb") if ev.get(k) is not None}  # fmt: skip
            self.own.append(cand("oom-kill", ev["at"], ev["lines"], self._oom_text(ev), True, **details))
        elif mine:
            self.ruled.append(_ruled(what, f"this unit's, but{when}", ev["lines"]))
        else:
            other = tcg or f"pid {ev.get('pid')}, not one of this unit's processes"
            self.ruled.append(_ruled(what, f"not the cause: another cgroup's OOM kill ({other} is not this unit's "
                                     f"{self.u.cgroup}){when}", ev["lines"]))  # fmt: skip

    def _oom_text(self, ev: dict[str, Any]) -> str:
        who = self.u.who(ev.get("pid"), f"{ev.get('task')} (pid {ev.get('pid')})")
        if ev.get("global_oom") or (ev.get("memcg_oom") is False and not ev.get("oom_memcg")):
            why = "the whole host ran out of memory (global OOM) and the kernel picked this unit's process"
        elif ev.get("oom_memcg") and in_cgroup(ev.get("oom_memcg"), self.u.cgroup):
            lim = f" ({gib(ev['limit_kb'])})" if ev.get("limit_kb") else ""
            why = f"the unit's cgroup hit its memory limit{lim}: check MemoryMax= and the engine's host-memory use"
        else:
            why = f"the memory limit of {ev.get('oom_memcg')} was hit"
        return f"the kernel's OOM killer killed {who} of this unit ({ev.get('task_memcg') or 'by pid'}): {why}"

    def gpu_name(self, pci: str) -> str:
        key = bdf_key(pci)
        idx = self.u.gpus.get(key) if key else None
        if idx is None:
            return f"PCI {pci}" + ("" if self.u.gpus else " (no nvidia-smi.txt in the bundle to name the GPU index)")
        gone = " (nvidia-smi could not reach it)" if key in self.u.gpus_gone else ""
        return f"GPU {idx} (PCI {pci}){gone}"

    def _xid(self, ev: dict[str, Any]) -> None:
        summary, cls, action = xid_info(ev["xid"])
        gpu = self.gpu_name(ev["pci"])
        key = bdf_key(ev["pci"])
        c = cand("gpu-xid", ev["at"], ev["lines"], f"GPU Xid {ev['xid']} on {gpu}: {summary}; {action}", True,
                 xid=ev["xid"], pci=ev["pci"], gpu=self.u.gpus.get(key) if key else None, xid_class=cls,
                 pid=ev.get("pid"))  # fmt: skip
        when = self._when(ev["at"])
        if cls in ("consequence", "informational"):
            self.ruled.append(_ruled(f"Xid {ev['xid']} on {gpu}", f"{cls}: {summary}; {action}", ev["lines"]))
        elif when:
            self.ruled.append(_ruled(f"Xid {ev['xid']} on {gpu}", f"not the cause:{when}", ev["lines"]))
        elif self._mine(ev):
            self.own.append(c)
        elif cls == "application" and ev.get("pid") is not None:  # a fault of another process's code
            who = f"pid {ev['pid']}" + (f", {ev['name']}" if ev.get("name") else "")
            self.ruled.append(_ruled(f"Xid {ev['xid']} on {gpu}", f"not the cause: a GPU fault of another process "
                                     f"({who}), not one of this unit's", ev["lines"]))  # fmt: skip
        else:
            self.node_wide.append(c)

    def _storage(self, ev: dict[str, Any]) -> None:
        at, back = ev["at"], ev.get("back_at")
        if ev["kind"] == "nfs":
            text = f"NFS server {ev['server']} not responding from {iso(at)}" + (
                f", back at {iso(back)}" if back else ", not back by the end of the log"
            )
            c = cand("storage", at, ev["lines"], text, True, server=ev["server"], recovered_at=iso(back))
            if ev.get("back_line"):
                c["evidence"].append(ev["back_line"].ref())
        else:
            text = f"I/O error on {ev['dev']}: {ev['lines'][0].msg.strip()[:160]}"
            c = cand("io-error", at, ev["lines"], text, True, device=ev["dev"])
        c["recovered"] = back
        overlaps = (self.hi is None or at is None or at <= self.hi) and (self.lo is None or back is None
                                                                         or back >= self.lo)  # fmt: skip
        if overlaps:
            self.node_wide.append(c)
        elif back is not None and self.lo is not None and back < self.lo:
            self.ruled.append(
                _ruled(text, f"not the cause: over at {iso(back)}, before this run started", c["evidence"])
            )
        else:
            self.ruled.append(_ruled(text, f"not the cause:{self._when(at)}", c["evidence"]))

    def _hung(self, ev: dict[str, Any]) -> None:
        nfs = any(fn.startswith(("nfs", "rpc_", "__rpc")) for fn in ev["funcs"]) or bool(
            {"nfs", "nfsv4", "sunrpc"} & set(ev["modules"])
        )
        text = (f"{ev['task']}:{ev['pid']} blocked in the kernel for more than {ev['seconds']} s"
                f"{' waiting on NFS' if nfs else ''} ({', '.join(ev['funcs'][:6])})")  # fmt: skip
        mine, when = self._mine(ev), self._when(ev["at"])
        if mine and not when:
            self.own.append(cand("hung-task", ev["at"], ev["lines"], self.u.who(ev["pid"], text), True, pid=ev["pid"],
                                 nfs=nfs, funcs=ev["funcs"][:10]))  # fmt: skip
            return
        why = (f"this unit's, but{when}" if mine else "not this unit's process" +
               ("; stuck on NFS too: the outage is node-wide" if nfs else "") + when)  # fmt: skip
        self.ruled.append(_ruled(f"hung task {ev['task']}:{ev['pid']}", why, ev["lines"]))

    def _segfault(self, ev: dict[str, Any]) -> None:
        where = f" in {ev['lib']}" if ev.get("lib") else ""
        text = self.u.who(ev["pid"], f"{ev['task']} (pid {ev['pid']}) segfaulted{where}")
        mine, when = self._mine(ev), self._when(ev["at"])
        if mine and not when:
            self.own.append(cand("segfault", ev["at"], ev["lines"], text, True, pid=ev["pid"], lib=ev.get("lib")))
        elif not mine:
            self.ruled.append(_ruled(text, "not this unit's process", ev["lines"]))
