"""One unit of ``llmfleet why``: its journal cut into runs (a restart starts a new one), how each run ended (the
*mechanism*, run.py), what caused it (the *cause*: the engine's tracebacks, a dead worker, NCCL, and the
kernel's events as kernel.py sorts them), and the red herrings with why they are not the cause. The first
failed run is the unit's verdict. Stdlib only, Python >= 3.8.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from ...engine.logobserver import rank_of
from .kernel import KernelJudge, cand
from .parse import Line, iso, parse_journal, parse_show, slice_path
from .rules import (
    DEVICE_EXC,
    IO_EXC,
    LABELS,
    NOT_FAILED,
    PIDS,
    SIGNALS,
    WRAPPER_END,
    exception_consequence,
    exception_hint,
    systemd_event,
)
from .run import EVIDENCE_KEEP, Ending, Run, line_of, num, rec_ref

NEAR_S = 300  # a node-wide GPU/storage event this long before a unit's first failure sign may be its cause
GRACE_S = 5  # slack between the kernel's lines and the unit's (written by different processes)
STRONG = ("engine-crash", "oom-kill", "gpu-xid", "storage", "hung-task", "io-error", "segfault", "exec-failed",
          "core-dump")  # fmt: skip
# Candidates seen at the same second: what makes the others happen first.
PRIORITY = ("gpu-xid", "oom-kill", "storage", "io-error", "hung-task", "segfault", "engine-crash")
# Without a cause of its own, a unit's best sign: a worker it saw die, then NCCL, then an exception that only
# reports a failure elsewhere (EngineDeadError).
WEAK_PRIORITY = ("worker-died", "nccl-error", "engine-crash")
PHASE_HINTS = {  # the phase reached when the start timed out -> what the engine was doing
    "started": "it printed no phase: look at the first lines of its output",
    "dist_init": "waiting for the other nodes' ranks to join (every node's unit started? same master address and "
    "port? the fabric between them?)",
    "dist_ready": "building NCCL communicators across the nodes",
    "loading": "reading the weights: a slow or stalled disk or network filesystem (kernel.txt: NFS, I/O errors)",
    "loaded": "profiling memory and building the KV cache",
    "warmup": "capturing CUDA graphs or compiling: --enforce-eager tells which; py-spy dump the workers",
    "warm": "after warm-up, before the API came up",
}
_PROGRESS = re.compile(r"\d+%\||% Completed")
_TAG = re.compile(r"\(([\w-]+)(?: rank=\d+)? pid=(\d+)\)")


def read_text(path: str, warnings: list[str]) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as e:
        warnings.append(f"{path}: cannot read it ({e.strerror or e}); left out")
        return None


_NUMBER, _TEXT, _FLAG = (int, float), (str,), (bool,)
# The record fields a verdict is read from (wrapper_record.termination_record writes them), and their JSON types
# (null allowed): a record that has them wrong is malformed, never read as "no failure".
RECORD_TYPES: dict[str, tuple[type, ...]] = {
    "started_at": _NUMBER, "ended_at": _NUMBER, "stop_requested_at": _NUMBER, "ready_at": _NUMBER,
    "exit_code": (int,), "failed_rank": (dict,), "verdict": _TEXT, "reason": _TEXT, "phase": _TEXT, "unit": _TEXT,
    "stop_requested": _FLAG, "killed_after_timeout": _FLAG, "ready": _FLAG, "child": (dict,), "link": (dict,),
    "oom_kill": (dict,), "tail": (list,),
}  # fmt: skip


def record_problem(rec: Any) -> str | None:
    """Why a parsed termination record cannot be read (None when it can)."""
    if not isinstance(rec, dict):
        return "not a termination record (a JSON object)"
    for key, types in RECORD_TYPES.items():
        v = rec.get(key)
        wrong = v is not None and (not isinstance(v, types) or (isinstance(v, bool) and bool not in types))
        if wrong:
            return f"{key} is {v!r} ({type(v).__name__}), not {' or '.join(t.__name__ for t in types)}"
    missing = [k for k in ("verdict", "ended_at") if rec.get(k) in (None, "")]
    if missing:  # the wrapper writes both in every record: without them it says nothing of how the run ended
        return f"not a whole termination record: no {' or '.join(missing)}"
    return None


def load_records(
    paths: list[tuple[int, str]], rel: str, warnings: list[str], bad: list[str] | None = None
) -> list[dict[str, Any]]:
    """Termination records, newest first (FILE, FILE.1, ...); "_file"/"_text" kept for evidence lines. A record
    that cannot be read or is malformed is left out, with a warning, and named in `bad`."""
    bad = [] if bad is None else bad
    out = []
    for n, path in sorted(paths):
        text = read_text(path, warnings)
        if text is None:
            bad.append(f"{path}: cannot read it")
            continue
        try:
            rec = json.loads(text)
        except ValueError as e:
            warnings.append(f"{path}: not valid JSON ({e}); left out")
            bad.append(f"{path}: not valid JSON")
            continue
        why = record_problem(rec)
        if why:
            warnings.append(f"{path}: {why}; left out")
            bad.append(f"{path}: {why}")
            continue
        rec.update(_file=os.path.join(rel, os.path.basename(path)), _text=text, _n=n)
        out.append(rec)
    return out


def _frames_text(frames: list[dict[str, Any]]) -> str:
    return " <- ".join(f"{f['file']}:{f['line']} in {f['func']}" for f in reversed(frames[-3:]))


def _rank_text(rank: dict[str, Any] | None) -> str:
    rank = rank or {}
    tag = " ".join(f"{k.upper()}{rank[k]}" for k in ("tp", "pp") if rank.get(k) is not None)
    return tag or (f"rank {rank['rank']}" if rank.get("rank") is not None else "")


def order(c: dict[str, Any]) -> tuple[float, int]:
    return (
        c["at"] if c["at"] is not None else float("inf"),
        PRIORITY.index(c["kind"]) if c["kind"] in PRIORITY else 99,
    )


def _weak_order(c: dict[str, Any]) -> tuple[int, float, int]:
    first_line = min((e["line"] or 0 for e in c["evidence"]), default=0)  # same second: the earlier line
    return (WEAK_PRIORITY.index(c["kind"]) if c["kind"] in WEAK_PRIORITY else 99,
            c["at"] if c["at"] is not None else float("inf"), first_line)  # fmt: skip


class UnitAnalysis:
    """The verdict of one unit on one node. ctx: the node's kernel "events", "gpus" and "gpus_gone"."""

    def __init__(self, node: str, unit: str, files: dict[str, Any], ctx: dict[str, Any]) -> None:
        self.node, self.unit, self.events = node, unit, ctx["events"]
        self.gpus, self.gpus_gone = ctx["gpus"], ctx["gpus_gone"]
        self.warnings: list[str] = []
        self.unreadable: list[str] = []  # what could not be read: never judged "no failure" from what is left
        self.show_text = self._read(files["show"]) if files["show"] else ""
        self.show = parse_show(self.show_text)
        self.show_file = os.path.join(node, os.path.basename(files["show"])) if files["show"] else None
        self.records = load_records(files["records"], node, self.warnings, self.unreadable)
        self.lines: list[Line] = []
        if files["journal"]:
            text = self._read(files["journal"])
            self.lines, stats = parse_journal(text, os.path.join(node, os.path.basename(files["journal"])))
            if stats["lines"] and not stats["parsed"]:
                self.warnings.append(
                    f"{files['journal']}: no line starts with a journalctl short-iso timestamp "
                    "(2026-12-01T03:14:07+0000 host ident[pid]: ...); collect it with `journalctl -u UNIT -o short-iso`"
                )
        elif self.records and isinstance(self.records[0].get("tail"), list):
            rec = self.records[0]
            no = line_of(rec["_text"], '"tail"') or 0
            self.lines = [Line(rec["_file"], no, None, unit, None, t) for t in rec["tail"] if isinstance(t, str)]
            self.warnings.append(f"{node}: no journal-{unit}.txt; read the termination record's tail instead")
        self.cgroup = self._cgroup()
        self.pids = self._pids()
        self.pid_tags: dict[int, str] = {}  # vLLM's name of a process: its last `(Worker_PP1_TP3 pid=N)` tag
        for ln in self.lines:
            for name, pid in _TAG.findall(ln.msg):
                if "_" in name or int(pid) not in self.pid_tags:
                    self.pid_tags[int(pid)] = name
        exec_start = self.show.get("ExecStart", "")
        self.launched = (
            bool(self.records)
            or ("llmfleet" in exec_start and " exec " in exec_start)
            or any(WRAPPER_END.match(ln.msg) for ln in self.lines)
        )

    def _read(self, path: str) -> str:
        text = read_text(path, self.warnings)
        if text is None:
            self.unreadable.append(f"{path}: cannot read it")
        return text or ""

    def _cgroup(self) -> str:
        """ControlGroup= (empty once the unit is inactive), else where systemd puts it (Slice=; a template's
        instances go to system-<template>.slice)."""
        if self.show.get("ControlGroup"):
            return self.show["ControlGroup"]
        template = self.unit.split("@", 1)[0].replace("-", "\\x2d")
        sl = self.show.get("Slice") or (f"system-{template}.slice" if "@" in self.unit else "system.slice")
        return f"{slice_path(sl)}/{self.unit}"

    def _pids(self) -> set[int]:
        pids: set[int] = set()
        for ln in self.lines:
            if ln.pid and ln.ident != "systemd":
                pids.add(ln.pid)
            for rx in PIDS:
                pids.update(int(p) for p in rx.findall(ln.msg))
        for key in ("MainPID", "ExecMainPID", "ControlPID"):
            value = self.show.get(key, "")
            if value.isdigit():
                pids.add(int(value))
        for rec in self.records:
            pids.update(rec[k] for k in ("wrapper_pid", "child_pid") if isinstance(rec.get(k), int))
        return pids - {0, 1}

    def who(self, pid: int | None, text: str) -> str:
        """text plus the engine's name of that process and its rank, where the journal names them."""
        tag = self.pid_tags.get(pid) if pid is not None else None
        if not tag:
            return text
        rank = _rank_text(rank_of(f"({tag} pid={pid})"))
        return f"{text} [{tag}{', ' + rank if rank else ''}]"

    # -- runs ------------------------------------------------------------------------------------------------------
    def _runs(self) -> list[Run]:
        chunks: list[list[Line]] = [[]]
        for ln in self.lines:
            ev = systemd_event(ln.msg, self.unit) if ln.ident == "systemd" else None
            if ev and ev[0] == "starting" and chunks[-1]:
                chunks.append([])
            chunks[-1].append(ln)
        runs = [Run(c, self.unit, i == len(chunks) - 1) for i, c in enumerate(chunks)]
        starts = [r.start for r in runs] + [None]
        timed = [r for r in self.records if num(r.get("started_at")) is not None]
        for i, run in enumerate(runs):  # a record belongs to the run it started in
            nxt = starts[i + 1]
            rec = next((r for r in timed if run.start is not None and run.start - GRACE_S <= r["started_at"]
                        and (nxt is None or r["started_at"] < nxt)), None)  # fmt: skip
            if rec is None and run.last and self.records and (run.start is None or not timed):
                rec = self.records[0]
            run.use_record(rec)
        return runs

    # -- what may have caused it -------------------------------------------------------------------------------------
    def _engine_candidates(self, run: Run) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(candidates, ruled out) from the unit's own output: tracebacks, dead workers, NCCL lines."""
        own: list[dict[str, Any]] = []
        ruled: list[dict[str, Any]] = []
        seen: set[tuple[str, str]] = set()
        for tb in run.tracebacks:
            if (tb["type"], tb["message"]) in seen:
                continue  # vLLM prints the engine core's traceback twice (logged, and raw on stderr)
            seen.add((tb["type"], tb["message"]))
            exc = {"type": tb["type"], "message": tb["message"][:300], "frames": tb["frames"][-3:],
                   "rank": tb.get("rank"), "extra": tb.get("extra", [])}  # fmt: skip
            who = _rank_text(tb.get("rank"))
            where = f" (in {_frames_text(tb['frames'])})" if tb["frames"] else ""
            text = f"the engine{f' ({who})' if who else ''} raised {tb['type']}: {tb['message'][:200]}{where}"
            cons, hint = exception_consequence(tb), exception_hint(tb)
            if cons:
                own.append(cand(cons[0], tb["start"].at, [tb["start"], tb["end"]], text, False, exception=exc,
                                consequence=cons[1]))  # fmt: skip
            else:
                own.append(cand("engine-crash", tb["start"].at, [tb["start"], tb["end"]],
                                text + (f"; {hint}" if hint else ""), True, exception=exc, hint=hint))  # fmt: skip
        for ln, m in run.deaths:
            r = (rank_of(ln.msg) or {}).get("rank")
            r = r if r is not None else (m.group(3) or m.group(6))
            code = m.group(2) or m.group(4)
            sig = ""
            if code and code.lstrip("-").isdigit() and int(code) < 0:
                sig = f" = {SIGNALS.get(-int(code), 'signal ' + code.lstrip('-'))}"
            who = f"rank {r}" if r is not None else "an engine worker"
            own.append(cand("worker-died", ln.at, [ln], f"{who} died unexpectedly (exit code {code}{sig})", False,
                            rank=r, exit_code=code))  # fmt: skip
        ready_at = run.obs.ready_at if run.obs.ready else num((run.record or {}).get("ready_at"))
        for ln in run.nccl:
            if ready_at is not None and ln.at is not None and ln.at < ready_at:
                ruled.append({"what": f"NCCL at start-up: {ln.msg.strip()[:120]}", "why": "logged before the engine "
                              "was ready, which it then became", "evidence": [ln.ref()]})  # fmt: skip
            else:
                own.append(cand("nccl-error", ln.at, [ln], f"NCCL reported: {ln.msg.strip()[:200]}", False))
        return own, ruled

    def _oom_signs(self, run: Run, own: list[dict[str, Any]]) -> None:
        """systemd's OOM line and the record's OOM counter: evidence of the unit's OOM kill, or the candidate
        itself when kernel.txt has no line of it."""
        oom_line = run.first("oom")
        rec = run.record
        refs = []
        if oom_line is not None:
            refs.append(oom_line.ref())
        counter = rec.get("oom_kill") if rec else None
        if rec and isinstance(counter, dict) and (counter.get("delta") or 0) > 0:
            refs.append(rec_ref(rec, "oom_kill", f"termination record: the cgroup's oom_kill counter rose by "
                                f"{counter['delta']}"))  # fmt: skip
        if not refs:
            return
        hit = next((c for c in own if c["kind"] == "oom-kill"), None)
        if hit:
            hit["evidence"] += [r for r in refs if r not in hit["evidence"]]
            return
        at = oom_line.at if oom_line is not None else num(rec.get("ended_at") if rec else None)
        c = cand("oom-kill", at, [], "a process of this unit was OOM-killed (systemd or the wrapper's counter says "
                 "so; kernel.txt has no line of it)", True)  # fmt: skip
        c["evidence"] = refs
        own.append(c)

    def _promote(self, node_wide: list, strong: list, ruled: list, *, first_own: float | None, root: dict | None,
                 hang_like: bool) -> None:  # fmt: skip
        """A node-wide event explains this unit when it came at most NEAR_S before the unit's first failure sign
        and fits it: a GPU fault a CUDA error (or no traceback at all), a storage outage an I/O error or a hang."""
        exc = (root or {}).get("details", {}).get("exception") or {}
        root_text = f"{exc.get('type')}: {exc.get('message')}" if root else ""
        for c in node_wide:
            ok, why = True, ""
            if c["kind"] == "gpu-xid":
                if first_own is not None and c["at"] is not None and c["at"] < first_own - NEAR_S:
                    ok, why = False, "long before this unit's first failure sign"
                elif first_own is not None and c["at"] is not None and c["at"] > first_own + GRACE_S:
                    ok, why = False, "after this unit had already failed"
                elif root is not None and not DEVICE_EXC.search(root_text):
                    ok, why = False, f"the engine failed with {root_text[:120]}, which is not a GPU error"
            else:
                back = c.get("recovered")
                if back is not None and first_own is not None and back < first_own - GRACE_S:
                    ok = False
                    why = (
                        f"over at {iso(back)}, {(first_own - back) / 60:.0f} min before this unit's first failure sign"
                    )
                elif root is not None and not IO_EXC.search(root_text) and not hang_like:
                    ok, why = False, f"the engine failed with {root_text[:120]}, not an I/O error or a hang"
            if ok:
                strong.append(c)
            else:
                ruled.append({"what": c["text"], "why": f"not the cause: {why}", "evidence": c["evidence"]})

    def _rest(self, chosen: dict[str, Any] | None, others: list[dict[str, Any]], mech: dict) -> list[dict[str, Any]]:
        """Why each candidate that is not the cause is not."""
        out = []
        for c in others:
            if mech["kind"] == "peer-failed" and chosen is None:
                why = f"this node was stopped because {mech.get('peer')} failed: its own errors follow from that"
            elif c["kind"] == "nccl-error" and chosen and chosen["kind"] != "nccl-error":
                why = "after the cause: what ranks say when a peer or the engine already failed"
            elif c["details"].get("consequence"):
                why = c["details"]["consequence"]
            elif c["kind"] == "worker-died" and chosen and chosen["kind"] in STRONG:
                why = f"the worker's death as the engine saw it; the cause is the {LABELS[chosen['kind']]}"
            elif chosen and c["at"] is not None and chosen["at"] is not None and c["at"] >= chosen["at"]:
                why = f"after the cause ({LABELS[chosen['kind']]} at {iso(chosen['at'])})"
            else:
                why = "a lesser sign than the cause"
            out.append({"what": c["text"], "why": why, "evidence": c["evidence"]})
        return out

    def _herrings(self, run: Run, mech: dict[str, Any], chosen: dict[str, Any] | None) -> list[dict[str, Any]]:
        """What misleads at first sight: exit 0, the wrapper's stop verdicts, SIGKILL, torch's shutdown warning."""
        out = []
        if mech["kind"] == "unrequested-exit-0" and chosen is not None:
            out.append({"what": "exit status 70" if self.launched else "exit 0 / Result=success",
                        "why": "no stop was requested: an engine exiting 0 on its own has given up (vLLM exits 0 when "
                        "its engine core or a worker dies)" + ("; 70 is the wrapper's code for that" if self.launched
                                                               else ""), "evidence": mech["evidence"]})  # fmt: skip
        said = run.said()
        if said in ("clean-stop", "stop-timeout") and mech["kind"] in ("start-timeout", "watchdog", "oom-kill"):
            where = (rec_ref(run.record, "verdict", f"verdict {said}") if run.record else
                     run.wrapper[0].ref() if run.wrapper else None)  # fmt: skip
            why = f"systemd's own SIGTERM ({LABELS[mech['kind']]}) looked like a stop request to the wrapper"
            out.append({"what": f"the wrapper's verdict: {said}", "why": f"{why}: nobody stopped it",
                        "evidence": [where] if where else []})  # fmt: skip
        oom_seen = chosen is not None and chosen["kind"] == "oom-kill"
        if mech["kind"] == "signal" and "SIGKILL" in mech["text"] and not oom_seen:
            out.append({"what": "killed by SIGKILL", "why": "not an OOM kill: kernel.txt has no OOM kill of this unit; "
                        "SGLang kills its own process tree with SIGKILL when a rank fails",
                        "evidence": mech["evidence"][:1]})  # fmt: skip
        after = "harmless at a stop" if mech["kind"] in NOT_FAILED else "it follows the failure"
        for ln in run.destroy_pg:
            out.append({"what": "destroy_process_group() was not called", "why": "torch's warning whenever a process "
                        f"exits without tearing its process group down: {after}", "evidence": [ln.ref()]})  # fmt: skip
        return out

    def judge(self, run: Run) -> dict[str, Any]:
        mech = Ending(self).of(run)
        own, ruled = self._engine_candidates(run)
        end = run.end if run.end is not None else mech["at"]
        kernel = KernelJudge(self, None if run.start is None else run.start - GRACE_S,
                             None if end is None else end + GRACE_S).judge(self.events)  # fmt: skip
        own += kernel.own
        ruled += kernel.ruled
        self._oom_signs(run, own)
        strong = [c for c in own if c["strong"]]
        weak = [c for c in own if not c["strong"]]
        first_own = min((c["at"] for c in own if c["at"] is not None), default=mech["at"])
        root = next((c for c in sorted(strong, key=order) if c["kind"] == "engine-crash"), None)
        own_hung = [c for c in strong if c["kind"] == "hung-task"]
        hang_like = bool(own_hung) or mech["kind"] in ("start-timeout", "watchdog", "stop-timeout")
        self._promote(kernel.node_wide, strong, ruled, first_own=first_own, root=root, hang_like=hang_like)
        if mech["kind"] in NOT_FAILED:
            when = "the engine kept running" if mech["kind"] == "running" else "the unit was stopped on request"
            ruled += [{"what": c["text"], "why": f"not a failure of the unit: {when}", "evidence": c["evidence"]}
                      for c in strong + weak]  # fmt: skip
            return self._verdict(run, mech, None, ruled + self._herrings(run, mech, None))
        if mech["kind"] == "unhealthy-while-serving":  # the wrapper stopped a hung engine: what it says then follows
            after = [c for c in strong + weak if c["details"].get("consequence")
                     or (c["at"] is not None and mech["at"] is not None and c["at"] >= mech["at"] - 1.0)]  # fmt: skip
            ruled += [{"what": c["text"], "why": "not the cause: what the engine said when the wrapper stopped it, "
                       "hung while serving", "evidence": c["evidence"]} for c in after]  # fmt: skip
            strong = [c for c in strong if all(c is not a for a in after)]
            weak = [c for c in weak if all(c is not a for a in after)]
        chosen = min(strong, key=order) if strong else (min(weak, key=_weak_order) if weak else None)
        if chosen is not None and not chosen["strong"] and mech["kind"] == "peer-failed":
            chosen = None  # the link names the node that failed: what this one logged meanwhile follows from it
        storage = [c for c in strong if c["kind"] == "storage"]
        if chosen and chosen["kind"] == "hung-task" and storage:
            chosen = min(storage, key=order)  # a process hung on storage: the outage is the cause
        picked = chosen
        absorbed = own_hung if chosen and chosen["kind"] == "storage" else []
        if chosen and absorbed:  # the hung tasks are the outage's evidence, not rivals
            chosen = dict(chosen, evidence=chosen["evidence"] + [e for c in absorbed for e in c["evidence"]],
                          text=chosen["text"] + "".join(f"; {c['text']}" for c in absorbed))  # fmt: skip
        others = [c for c in strong + weak if c is not picked and all(c is not a for a in absorbed)]
        ruled += self._rest(chosen, others, mech) + self._herrings(run, mech, chosen)
        return self._verdict(run, mech, chosen, ruled)

    def _mechanism_text(self, run: Run, kind: str, mech: dict[str, Any], phase: str) -> str:
        text = mech["text"]
        if kind in ("start-timeout", "watchdog"):
            last = next((ln for ln in reversed(run.engine) if ln.msg.strip() and not WRAPPER_END.match(ln.msg)
                         and (mech["at"] is None or ln.at is None or ln.at < mech["at"])), None)  # fmt: skip
            prog = next((ln.msg.strip() for ln in reversed(run.engine) if _PROGRESS.search(ln.msg)), None)
            text += f"; the engine had reached phase '{phase}': {PHASE_HINTS.get(phase, '')}"
            if prog:
                text += f"; last progress line: {prog[:120]}"
            if last is not None and last.at is not None and mech["at"] is not None:
                text += f"; its output had been silent for {mech['at'] - last.at:.0f} s"
            return text + ". Raise engine_start_timeout only if the start is legitimately that slow"
        if kind == "worker-died":
            return text + "; nothing in kernel.txt explains it (no OOM kill, Xid or segfault of its pid)"
        if kind not in NOT_FAILED and kind != "unknown" and run.obs.first_error:
            return text + f"; first error line: {run.obs.first_error['line'][:200]}"
        return text

    def _verdict(self, run: Run, mech: dict[str, Any], chosen: dict[str, Any] | None,
                 ruled: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
        kind = chosen["kind"] if chosen else mech["kind"]
        rec = run.record or {}
        phase = rec.get("phase") or run.obs.phase_name()
        details: dict[str, Any] = dict(chosen["details"]) if chosen else {}
        details.update(mechanism=mech["kind"], phase=phase, ready=bool(rec.get("ready")) if rec else run.obs.ready)
        if mech.get("peer"):
            details["peer"] = mech["peer"]
        details.update({k: mech[k] for k in ("peer_lost", "link_role", "missing") if mech.get(k)})
        failed_rank = rec.get("failed_rank") if isinstance(rec.get("failed_rank"), dict) else run.obs.failed_rank
        if failed_rank:
            details["failed_rank"] = {k: failed_rank.get(k) for k in ("tp", "pp", "rank")}
        if chosen:
            text = chosen["text"]
            if chosen["details"].get("consequence"):
                text += f" ({chosen['details']['consequence']}; the root error is not in this journal)"
            elif kind == "worker-died":
                text += "; nothing in kernel.txt explains it (no OOM kill, Xid or segfault of its pid)"
            if mech["kind"] not in ("unknown", kind):
                text += f". Then: {mech['text']}"
        else:
            text = self._mechanism_text(run, kind, mech, phase)
        evidence = (chosen["evidence"] if chosen else []) + [
            e for e in mech["evidence"] if not chosen or e not in chosen["evidence"]
        ]
        at = chosen["at"] if chosen and chosen["at"] is not None else mech["at"]
        label = LABELS.get(kind, kind)
        if kind == "gpu-xid":
            label = f"GPU Xid {details.get('xid')}"
        elif kind == "engine-crash" and details.get("exception"):
            label = f"engine crash ({details['exception']['type'].rsplit('.', 1)[-1]})"
        return {
            "verdict": kind, "label": label, "failed": kind not in NOT_FAILED, "at": at, "at_iso": iso(at),
            "cause": text, "strong": chosen["strong"] if chosen else kind in STRONG,
            "evidence": evidence[:EVIDENCE_KEEP], "details": details, "ruled_out": ruled,
            "started_at_iso": iso(run.start), "ended_at_iso": iso(run.end),
        }  # fmt: skip

    def analyse(self) -> dict[str, Any]:
        judged = [self.judge(r) for r in self._runs()]
        failed = [j for j in judged if j["failed"]]
        main = failed[0] if failed else judged[-1]
        peer = main["details"].get("peer")  # the deployment link named the node that failed or was stopped
        role = "consequence" if peer else "cause" if main["failed"] else None
        show = self.show
        if show.get("LoadState") == "not-found":
            self.warnings.append(f"{self.node}: systemd does not know {self.unit} (LoadState=not-found)")
        if not self.launched:
            self.warnings.append(
                f"{self.node} {self.unit}: not launched by `llmfleet exec` and no termination record: "
                "verdict from the journal, kernel log and systemctl show only"
            )
        elif not self.records and main["verdict"] != "running":
            self.warnings.append(
                f"{self.node} {self.unit}: no termination record (the wrapper was killed, or the "
                "bundle has none): verdict from the journal, kernel log and systemctl show only"
            )
        if main["verdict"] == "running" and not self.lines and not self.records and not show.get("ActiveState"):
            self.unreadable.append(f"{self.node} {self.unit}: no journal line, termination record or ActiveState in "
                                   "the bundle: nothing to judge it from")  # fmt: skip
        return {
            "node": self.node, "unit": self.unit, "launched_by_llmfleet": self.launched, "record": bool(self.records),
            **main,
            "state": {k: show.get(v) for k, v in (("active", "ActiveState"), ("sub", "SubState"), ("result", "Result"),
                                                  ("exec_main_status", "ExecMainStatus"), ("restarts", "NRestarts"))},
            "cgroup": self.cgroup, "role": role, "consequence_of": {"node": peer} if peer else None,
            "runs": [{"started_at": j["started_at_iso"], "ended_at": j["ended_at_iso"], "verdict": j["verdict"]}
                     for j in judged],
            "warnings": self.warnings, "unreadable": self.unreadable,
        }  # fmt: skip
