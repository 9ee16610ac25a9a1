"""How one run of a unit ended, for ``llmfleet why`` (triage_unit.py asks, per run): the journal lines of one start
of the unit (``Run``: systemd's lines about it, the wrapper's last line, dead workers, NCCL lines, tracebacks, its
termination record) and the *mechanism* (``Ending``): start or watchdog timeout, OOM stop, the deployment link, a
stop on request, exit 0 without one, exit code, signal, core dump. systemd's lines come first because they say who
sent a SIGTERM that the wrapper records as a stop request. Stdlib only, Python >= 3.8.
"""

from __future__ import annotations

import re
from typing import Any

from ...engine.logobserver import LogObserver
from .parse import Line, find_tracebacks
from .rules import DESTROY_PG, EXEC_MAIN_CODE, LINK_STOP, NCCL_LINE, SIGNALS, WORKER_DIED, WRAPPER_END, systemd_event

EVIDENCE_KEEP = 8
_END_LINES = ("main_exit", "result", "deactivated", "stopped", "failed_start")


def line_of(text: str, prefix: str) -> int | None:
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(prefix):
            return no
    return None


def rec_ref(rec: dict[str, Any], key: str, text: str) -> dict[str, Any]:
    return {"file": rec["_file"], "line": line_of(rec["_text"], f'"{key}"'), "text": text}


def num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class Run:
    """One start of the unit: its journal lines and what they say. record: its termination record or None."""

    def __init__(self, lines: list[Line], unit: str, last: bool) -> None:
        self.lines, self.last = lines, last
        self.start = next((ln.at for ln in lines if ln.at is not None), None)
        self.end: float | None = None
        self.sd: dict[str, list[tuple[Line, re.Match]]] = {}
        self.wrapper: tuple[Line, re.Match] | None = None
        self.link: tuple[Line, re.Match] | None = None  # the deployment link stopped this node
        self.deaths: list[tuple[Line, re.Match]] = []
        self.nccl: list[Line] = []
        self.destroy_pg: list[Line] = []
        self.engine: list[Line] = []
        self.record: dict[str, Any] | None = None
        for ln in lines:
            if ln.ident == "systemd":
                ev = systemd_event(ln.msg, unit)
                if ev:
                    self.sd.setdefault(ev[0], []).append((ln, ev[1]))
                    if ev[0] in _END_LINES and ln.at is not None:
                        self.end = max(self.end or ln.at, ln.at)
                continue
            self.engine.append(ln)
            m = WRAPPER_END.match(ln.msg)
            if m:  # it quotes the first error line: not matched again below
                self.wrapper = (ln, m)
                self.end = self.end or ln.at
                continue
            m = LINK_STOP.match(ln.msg)
            if m:
                self.link = self.link or (ln, m)
                continue
            m = WORKER_DIED.search(ln.msg)
            if m:
                self.deaths.append((ln, m))
            if NCCL_LINE.search(ln.msg):
                self.nccl.append(ln)
            if DESTROY_PG.search(ln.msg):
                self.destroy_pg.append(ln)
        self.obs = LogObserver()
        for ln in self.engine:
            self.obs.feed(ln.msg, ln.at or 0.0)
        self.tracebacks = find_tracebacks(self.engine)
        in_tb = {no for tb in self.tracebacks for no in tb["nos"]}
        self.nccl = [ln for ln in self.nccl if ln.no not in in_tb]  # a traceback's NCCL text is judged with it

    def first(self, kind: str) -> Line | None:
        return self.sd[kind][0][0] if kind in self.sd else None

    def use_record(self, rec: dict[str, Any] | None) -> None:
        self.record = rec
        if rec is None:
            return
        if self.end is None:
            self.end = num(rec.get("ended_at"))
        if self.start is None:
            self.start = num(rec.get("started_at"))

    def said(self) -> str | None:
        """The wrapper's verdict: from the record, else from its last journal line."""
        if self.record:
            return self.record.get("verdict")
        return self.wrapper[1].group(1) if self.wrapper else None


class Ending:
    """The mechanism of a run's end. unit: what is known of the unit (triage_unit.UnitAnalysis): its
    `systemctl show` (show, show_text, show_file) and whether llmfleet launched it (launched)."""

    def __init__(self, unit: Any) -> None:
        self.show_all: dict[str, str] = unit.show
        self.show_text, self.show_file, self.launched = unit.show_text, unit.show_file, unit.launched

    def _mech(self, run: Run, kind: str, at: float | None, text: str, ev: list[Line], *, stop: bool = False) -> dict:
        refs = [ln.ref() for ln in ev]
        for k in ("main_exit", "result"):
            ln = run.first(k)
            if ln is not None and ln.ref() not in refs:
                refs.append(ln.ref())
        show = self.show_all if run.last else {}
        if run.record:
            r = run.record
            refs.append(rec_ref(r, "verdict", f"termination record: verdict {r.get('verdict')}, exit "
                                f"{r.get('exit_code')}, phase {r.get('phase')}"))  # fmt: skip
        elif show.get("Result") and self.show_file:
            refs.append({"file": self.show_file, "line": line_of(self.show_text, "Result="),
                         "text": f"Result={show['Result']} ExecMainStatus={show.get('ExecMainStatus')}"})  # fmt: skip
        return {"kind": kind, "at": at, "text": text, "evidence": refs[:EVIDENCE_KEEP], "stop_requested": stop}

    def _timeout(self, key: str) -> str:
        v = self.show_all.get(key)
        return f" ({key}={v})" if v else ""

    def _exit(self, run: Run, show: dict[str, str]) -> tuple[str | None, int | None]:
        if "main_exit" in run.sd:
            m = run.sd["main_exit"][-1][1]
            return m.group(1), int(m.group(2))
        if run.record is None and show.get("ExecMainCode") in EXEC_MAIN_CODE and show.get("ActiveState") != "active":
            status = show.get("ExecMainStatus", "")
            return EXEC_MAIN_CODE[show["ExecMainCode"]], int(status) if status.isdigit() else None
        return None, None

    def of(self, run: Run) -> dict[str, Any]:  # noqa: PLR0911 (one outcome per rule, in order)
        """How the run ended, from systemd's lines first (they say who sent SIGTERM), then the record, then show."""
        show, verdict = self.show_all if run.last else {}, run.said()
        result = show.get("Result")
        timeout = run.first("start_timeout")
        if timeout is not None:
            quiet = [ln for ln in run.engine if ln.msg.strip() and ln.at is not None and timeout.at is not None
                     and ln.at < timeout.at]  # fmt: skip
            return self._mech(run, "start-timeout", timeout.at, "systemd's start timeout expired before the engine was "
                              f"ready{self._timeout('TimeoutStartUSec')}", [*quiet[-1:], timeout])  # fmt: skip
        dog = run.first("watchdog")
        if dog is not None:
            return self._mech(run, "watchdog", dog.at, "systemd's watchdog expired (no WATCHDOG=1 in time)", [dog])
        oom = run.first("oom")
        if oom is not None or result == "oom-kill" or (run.record or {}).get("verdict") == "oom-kill":
            return self._mech(run, "oom-kill", oom.at if oom else run.end, "systemd saw a process of the unit "
                              "OOM-killed and stopped the unit (OOMPolicy=stop)", [oom] if oom else [])  # fmt: skip
        if verdict in ("unhealthy-while-serving", "rank-died"):  # the wrapper stopped it: hung, or a rank died starting
            rec = run.record or {}
            kind, said = ("worker-died", "a rank died during start-up") if verdict == "rank-died" else (
                verdict, "hung while serving")  # fmt: skip
            return self._mech(run, kind, num(rec.get("stop_requested_at")) or run.end,
                              rec.get("reason") or (run.wrapper[1].group(3) if run.wrapper else said),
                              [run.wrapper[0]] if run.wrapper else [])  # fmt: skip
        linked = self._link_mechanism(run, verdict)
        if linked is not None:
            return linked
        stop = run.first("stopping")
        if stop is not None or (run.record or {}).get("stop_requested"):
            at = stop.at if stop else num((run.record or {}).get("stop_requested_at"))
            killed = run.first("stop_timeout")
            if killed is not None or verdict == "stop-timeout":
                return self._mech(run, "stop-timeout", at, "stopped on request, but the engine ignored SIGTERM and was "
                                  f"killed after the stop timeout{self._timeout('TimeoutStopUSec')}",
                                  [x for x in (stop, killed) if x], stop=True)  # fmt: skip
            return self._mech(
                run,
                "stopped-by-operator",
                at,
                "stopped on request (systemctl stop/restart, `llmfleet "
                "stop`, or the readiness gate stopping every node)",
                [stop] if stop else [],
                stop=True,
            )
        failed_exec = run.first("exec_failed")
        if failed_exec is not None or verdict == "exec-failed":
            return self._mech(run, "exec-failed", run.end, "the engine's command could not be started",
                              [failed_exec] if failed_exec else [])  # fmt: skip
        return self._exit_mechanism(run, show, verdict)

    def _link_mechanism(self, run: Run, verdict: str | None) -> dict[str, Any] | None:
        """The deployment link (wrapper_link.py) stopped this node: another node failed, or was stopped."""
        if verdict not in ("peer-failed", "deployment-stopped", "link-failed") and run.link is None:
            return None
        rec = run.record or {}
        link = rec.get("link") if isinstance(rec.get("link"), dict) else {}
        if verdict == "link-failed":
            mech = self._mech(run, "link-failed", run.end, "the wrapper could not join the deployment link: "
                              f"{rec.get('reason') or ''}", [run.wrapper[0]] if run.wrapper else [])  # fmt: skip
            barrier = link.get("barrier") if isinstance(link.get("barrier"), dict) else {}  # type: ignore[union-attr]
            mech["missing"] = [n for n in barrier.get("missing") or [] if isinstance(n, str)]  # waited for in vain
            mech["link_role"] = link.get("role")  # type: ignore[union-attr]
            return mech
        by = link.get("stopped_by") if isinstance(link.get("stopped_by"), dict) else {}  # type: ignore[union-attr]
        m = run.link[1] if run.link else None
        peer = by.get("node") or (m.group(1) if m else "another node")  # type: ignore[union-attr]
        failed = verdict == "peer-failed" or (verdict is None and m is not None and m.group(2) == "failed")
        why = by.get("reason") or (m.group(3) if m else "")  # type: ignore[union-attr]
        at = run.link[0].at if run.link else num(rec.get("stop_requested_at"))
        what = "failed" if failed else "was stopped on request"
        mech = self._mech(run, "peer-failed" if failed else "deployment-stopped", at, "stopped with the deployment: "
                          f"{peer} {what} ({why})", [run.link[0]] if run.link else [], stop=not failed)  # fmt: skip
        mech["peer"] = peer
        # A witness for `why`: this node (or the head, relaying) lost contact with that one (wrapper/link.py's words).
        mech["peer_lost"] = str(why).startswith("lost contact with")
        mech["link_role"] = link.get("role")  # type: ignore[union-attr]
        return mech

    def _exit_mechanism(self, run: Run, show: dict[str, str], verdict: str | None) -> dict[str, Any]:  # noqa: PLR0911
        code, status = self._exit(run, show)
        result = show.get("Result")
        if verdict == "unrequested-exit-0" or (code == "exited" and (status == 0 or (status == 70 and self.launched))):
            how = ("the wrapper turned it into exit 70 so the unit failed" if self.launched else
                   "systemd recorded success (Result=success), so Restart=on-failure did not fire")  # fmt: skip
            return self._mech(run, "unrequested-exit-0", run.end, f"the engine exited 0 without a stop request: {how}",
                              [run.wrapper[0]] if run.wrapper else [])  # fmt: skip
        child = (run.record or {}).get("child") if isinstance((run.record or {}).get("child"), dict) else {}
        if verdict == "core-dump" or code == "dumped" or result == "core-dump":
            sig = child.get("signal") or status or 0  # type: ignore[union-attr]
            return self._mech(run, "core-dump", run.end, f"the engine was killed by {SIGNALS.get(sig, sig)} and "
                              "dumped core (coredumpctl list)", [])  # fmt: skip
        if verdict == "signal" or code == "killed" or result == "signal":
            sig = child.get("signal") or status or 0  # type: ignore[union-attr]
            return self._mech(
                run, "signal", run.end, f"the engine was killed by {SIGNALS.get(sig, f'signal {sig}')}", []
            )
        if verdict == "exit-code" or code == "exited" or result == "exit-code":
            n = (run.record or {}).get("exit_code", status)
            return self._mech(run, "exit-code", run.end, f"the engine exited with code {n}", [])
        if run.first("start_limit") is not None or result == "start-limit-hit":
            return self._mech(run, "start-limit", run.end, "systemd refused to start it again (StartLimitBurst)", [])
        cut = run.first("starting") is None and run.first("started") is None and not run.record
        if cut and self.launched and run.first("deactivated") is not None and run.first("result") is None:
            # Only the end of a run whose start lies before the bundle's --since: the wrapper turns every unrequested
            # exit into a failure (70, 69, 75...), so a unit that deactivated successfully was stopped on request.
            why = "the unit deactivated successfully (systemd); its start and stop request lie before the bundle"
            return self._mech(run, "ended-cleanly", run.end, why, [run.first("deactivated")], stop=True)
        if (
            run.end is not None
            or show.get("ActiveState") in ("inactive", "failed")
            or show.get("SubState") == ("auto-restart")
        ):
            return self._mech(
                run, "unknown", run.end, "the unit ended; neither systemd's lines nor a record say how", []
            )
        state = (
            f" (ActiveState={show['ActiveState']}, SubState={show.get('SubState')})" if show.get("ActiveState") else ""
        )
        return {"kind": "running", "at": None, "text": f"the unit is running{state}", "evidence": [],
                "stop_requested": False}  # fmt: skip

    # -- what may have caused it -----------------------------------------------------------------------------------
