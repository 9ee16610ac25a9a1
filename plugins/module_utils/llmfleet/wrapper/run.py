"""``llmfleet exec [options] -- CMD...``: the main process of an engine unit (Type=notify, KillMode=mixed).

Why it exists: engines crashed yet their units showed "exit 0" (``engine | tee log`` reports tee's status,
vLLM exits 0 when a worker dies, SGLang's crash path SIGKILLs itself). The wrapper runs CMD in its own
process group, passes its output through line by line, forwards stop signals, kills what is left of the
group when the engine ends, turns "exited 0 without being asked" into a failure, and writes a termination
record (JSON) that says what happened and which rank failed first. docs/wrapper.md has the contract.

This module composes the parts and holds the command line; each part is a module of its own, none imports
this one: logobserver (phases, READY, error lines, ranks), wrapper_pump (output pass-through),
wrapper_process (process group, signals, stop deadline), wrapper_record (verdict, reason, record files),
wrapper_cgroup (unit, OOM counter), wrapper_secrets (credentials, redaction), wrapper_notify (sd_notify),
wrapper_link (the deployment link: the wrappers of a multi-node deployment stop and restart together),
wrapper_health (serving health: the gate's question asked again after READY).
Their public names stay importable from here.

Stdlib only, Python >= 3.8: it is copied to nodes and imported as
``ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.wrapper.run``.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import threading
import time

from ..engine.gate import DEFAULT_EXPECT, DEFAULT_PROMPT
from ..engine.logobserver import (
    DEFAULT_READY_REGEX,
    ERROR_PATTERN,
    LINE_KEEP,
    PHASE_PATTERNS,
    PHASES,
    PROGRESS_PATTERN,
    LogObserver,
    dead_rank,
    is_error_line,
    log_level,
    rank_of,
)
from ..fabric_key import FabricKeyError, parse_key
from ..metrics import write_engine_metrics, write_health_metrics, write_link_metrics
from .cgroup import oom_counter_file, oom_evidence, oom_read, read_oom_counters, unit_of
from .group import GroupWatch, describe
from .health import HealthProbe, check_url
from .link import EXIT_PEER_FAILED, DeploymentLink, parse_addr
from .notify import Notifier
from .process import (
    FORWARDED_SIGNALS,
    LEFTOVER_WAIT_S,
    POLL_S,
    STOP_SIGNALS,
    EngineProcess,
    how_it_ended,
    pids_in_group,
    signal_name,
)
from .pump import MAX_LINE, READER_JOIN_S, OutputPump, err
from .record import (
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    EXIT_UNHEALTHY,
    EXIT_UNREQUESTED,
    EXIT_USAGE,
    RECORD_KEEP,
    RECORD_KEYS,
    SCHEMA,
    child_fields,
    decide,
    explain,
    known_fields,
    rotate,
    termination_record,
    write_json_atomic,
)
from .secretfiles import (
    MIN_SECRET_PART,
    REDACTED,
    Redactor,
    Secrets,
    SetupError,
    parse_secret_specs,
    read_credential,
    secret_forms,
)

__all__ = [  # what other modules and tests import from here (the names the wrapper module has always had)
    "DEFAULT_READY_REGEX", "ERROR_PATTERN", "EXIT_NOT_EXECUTABLE", "EXIT_NOT_FOUND", "EXIT_PEER_FAILED",
    "EXIT_UNHEALTHY", "EXIT_UNREQUESTED", "EXIT_USAGE",
    "EXTEND_EVERY_S", "FORWARDED_SIGNALS", "LEFTOVER_WAIT_S", "LINE_KEEP", "MAX_LINE", "MIN_SECRET_PART",
    "PHASES", "PHASE_PATTERNS", "POLL_S", "PROGRESS_PATTERN", "READER_JOIN_S", "RECORD_KEEP", "RECORD_KEYS",
    "REDACTED", "SCHEMA", "STOP_SIGNALS", "LogObserver", "Notifier", "Redactor", "SetupError", "Wrapper",
    "build_parser", "dead_rank", "decide", "is_error_line", "log_level", "main", "oom_counter_file",
    "parse_secret_specs", "pids_in_group", "rank_of", "read_credential", "read_oom_counters", "rotate", "secret_forms",
    "signal_name", "unit_of", "write_json_atomic",
]  # fmt: skip

EXTEND_EVERY_S = 5.0
WATCH_START_S = 0.25  # the group watcher's tick before READY: a worker that vanished during start-up is seen within
# this (one scan of /proc: 3.3 ms of CPU with 191 processes; pidfd, which could wait on it, needs Python 3.9)
WATCH_S = 1.0  # ...and from READY on, when it only reads the group's /dev/shm mappings
WATCH_SHM_S = 5.0  # ...and the group's /dev/shm mappings are read this often (cheap, but maps can be long)
LINK_GRACE_S = 2.0  # how long an engine that exited 0 by itself waits for the link to say the deployment stops
# A stop because something already failed (a peer, a rank): no clean shutdown can complete (vLLM's headless node was
# still in its SIGTERM shutdown 5 s later), and every node down sooner is the deployment back sooner. SIGKILL leaves
# nothing behind that the next start trips on (docs/wrapper.md#stop-deadlines).
LINK_STOP_TIMEOUT_S = 1.5


class Wrapper:
    """One run of ``llmfleet exec``: the parts wired together, the live status and the termination record."""

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
        self.secrets = Secrets()
        self.redact = self.secrets.redact  # every secret value loaded: never in the output, the record or the status
        # pump.out_lock: writes to stdout/stderr/log; lock: tail, phases, status file. Kept apart so that a stuck
        # stdout (journald) blocks only the readers, never the stop deadline in the main thread.
        self.lock = threading.Lock()
        self.pump = OutputPump(self.redact, self._on_text)
        self.engine = EngineProcess(args.stop_timeout, self._on_stop, before_kill=self._before_kill)
        self.tail: collections.deque = collections.deque(maxlen=max(0, args.tail_lines))
        self.last_extend = 0.0
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.link: DeploymentLink | None = None
        self.link_stop: dict | None = None  # the link's stop event, when the link (not systemd) stopped the engine
        self.link_key = b""
        self.barrier: dict | None = None  # the deployment link's barrier while this node waits there
        self.health: HealthProbe | None = None
        self.health_key: str | None = None
        self.unhealthy: dict | None = None  # the probe's snapshot when it stopped the engine
        self.rank_died: dict | None = None  # a rank dead (the engine's own line, or its worker vanished): stopped
        self.group = GroupWatch()  # the group's workers and /dev/shm segments (wrapper_group)
        self.watching = threading.Event()  # set when the engine has ended: the group watcher stops
        self.watch_now = threading.Event()  # wakes the group watcher before its tick

    # ---- setup

    def _prepare_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)  # the wrapper owns the notify protocol: an engine's READY=1 would lie
        self.secrets.load(self.args.secret_env or [], self.args.secret_config or [], env, self.argv)
        if self.args.link_key:  # the deployment's fabric key: the link's proof, never the engine's
            value = read_credential(self.args.link_key)
            self.redact.add(value)
            try:
                self.link_key = parse_key(value, f"credential {self.args.link_key!r}")
            except FabricKeyError as e:
                raise SetupError(str(e)) from None
        if self.args.health_url and self.args.health_key:  # the probe's API key: a header, never argv or output
            self.health_key = read_credential(self.args.health_key)
            self.redact.add(self.health_key)
        return env

    def _setup(self) -> dict[str, str]:
        env = self._prepare_env()
        if self.args.log_file:
            self.pump.open_log(self.args.log_file)
        if self.args.record:
            try:
                rotate(self.args.record)
            except OSError as e:
                err(f"cannot rotate {self.args.record}: {e.strerror}")
        return env

    # ---- what the output says (the pump's reader threads)

    def _on_text(self, text: str) -> None:
        if self.group.note_line(text):
            self.watch_now.set()  # a worker's first line: see it alive now (it may die before the next tick)
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
        if self.rank_died is None and not self.engine.stop_requested:
            rank = dead_rank(text)
            if rank is not None:
                # Starting, vLLM's engine core would wait for it until systemd's start timeout; serving, vLLM exits
                # by itself 8-9 s later. Either way nothing is left to shut down cleanly: the link's stop deadline.
                when = "while serving" if self.obs.ready else "during start-up"
                self._rank_died(rank, self.redact.text(text[:LINE_KEEP]), when)
        if ev["ready"]:
            self.notifier.send("READY=1", f"STATUS=ready: engine phase {self.obs.phase_name()}")
            self._write_status()
            self._start_health()

    def _rank_died(self, rank: object, line: str, when: str) -> None:
        """A rank is dead (caller holds self.lock): nothing is left to shut down cleanly, the link's stop deadline."""
        self.rank_died = {"rank": rank, "line": line, "at": time.time(), "when": when}
        err(f"rank {rank} died {when}; stopping the engine and telling the deployment now")
        self.engine.shorten_deadline(self.args.link_stop_timeout)
        self.engine.request_stop()

    # ---- the engine's process group (wrapper_group)

    def _watch_group(self) -> None:
        """A thread, while the engine runs: before READY its workers every WATCH_START_S (one that vanishes is a dead
        rank, which no line of vLLM's names that early), and the /dev/shm segments the group maps every
        WATCH_SHM_S, so that what a SIGKILL leaves there is removed at the end."""
        last_shm = 0.0
        while True:
            self.watch_now.wait(WATCH_S if self.obs.ready or self.engine.stop_requested else WATCH_START_S)
            self.watch_now.clear()
            if self.watching.is_set():
                return
            now = time.monotonic()
            workers = not self.obs.ready and not self.engine.stop_requested
            shm = now - last_shm >= WATCH_SHM_S
            if not (workers or shm):
                continue
            last_shm = now if shm else last_shm
            gone = self.group.scan(self.engine.pid, time.time(), workers=workers, shm=shm)
            if gone is None:
                continue
            with self.lock:
                if self.rank_died is not None or self.engine.stop_requested or self.obs.ready:
                    continue
                who = describe(gone)
                line = (f"worker process {gone.get('title') or '(untitled)'} (pid {gone['pid']}) vanished, seen in "
                        "/proc (no engine line names a rank dead before its executor watches its workers)")  # fmt: skip
                rank = gone.get("rank")
                if rank is None and gone.get("title") and "_" in gone["title"]:
                    rank = gone["title"].split("_", 1)[1]
                if self.obs.failed_rank is None:
                    self.obs.failed_rank = {"tp": gone.get("tp"), "pp": gone.get("pp"), "rank": gone.get("rank"),
                                            "line": f"{who}: {line}", "at": time.time()}  # fmt: skip
                self._rank_died("unknown" if rank is None else rank, line, "during start-up")

    def _before_kill(self) -> None:
        """Right before a SIGKILL of the group (the main thread): what it maps in /dev/shm, to remove afterwards."""
        if self.engine.pid is not None:
            self.group.scan(self.engine.pid, time.time(), workers=False, shm=True)

    def _end_group(self) -> None:
        """The group is dead: the watcher stops, and what it left in /dev/shm goes."""
        self.watching.set()
        self.watch_now.set()
        count, size = self.group.remove_shm()
        if count:
            err(f"removed {count} shared memory segment(s) ({size / 2**20:.0f} MiB) the engine left in "
                f"{self.group.shm_dir}")  # fmt: skip

    def _extend(self) -> None:
        """Push systemd's start timeout out while the engine makes progress (loading takes minutes)."""
        now = time.monotonic()
        if not self.obs.ready and now - self.last_extend >= EXTEND_EVERY_S:
            self.last_extend = now
            self.notifier.send(f"EXTEND_TIMEOUT_USEC={int(self.args.extend_timeout * 1e6)}")

    def _on_stop(self) -> None:
        """The first stop request (main thread, after the engine set its stop deadline)."""
        if self.health is not None:
            self.health.close()  # a probe in flight ends now: it never delays a stop
        self._before_kill()  # what the group maps now, all of it still alive (the 5 s scan may have missed the newest)
        failure = self._unhealthy_reason() if self.unhealthy else self._rank_died_reason() if self.rank_died else None
        if failure:
            self.notifier.send("STOPPING=1", f"STATUS=stopping: {failure[:200]}")
            if self.link is not None:  # a failure, not a request: every node stops, and systemd restarts them
                self.link.engine_ended(True, failure)
        else:
            self.notifier.send("STOPPING=1", f"STATUS=stopping ({signal_name(self.engine.stop_signal)})")
        if self.link is not None and self.link_stop is None and not failure:
            # asked here (systemd): the deployment stops with it
            self.link.local_stop(f"stop requested ({signal_name(self.engine.stop_signal)})")
        with self.lock:
            self._write_status()

    # ---- serving health (wrapper_health)

    def _start_health(self) -> None:
        """From READY on (caller holds self.lock)."""
        a = self.args
        if not a.health_url or self.health is not None or self.engine.stop_requested:
            return
        self.health = HealthProbe(
            a.health_url, a.health_model, a.health_prompt, a.health_expect, api_key=self.health_key,
            interval=a.health_interval, timeout=a.health_timeout, failures=a.health_failures,
            on_probe=self._on_probe, on_unhealthy=self._on_unhealthy,
            stopping=lambda: self.engine.stop_requested,
        )  # fmt: skip
        self.health.start()

    def _on_probe(self, snap: dict) -> None:
        """After each probe (the probe's thread): the live status and the health metrics."""
        last = snap["last"] or {}
        if not last.get("ok"):
            err(f"health: probe failed ({snap['failures_in_row']}/{snap['failures_allowed']}): "
                f"{self.redact.text(str(last.get('error')))}")  # fmt: skip
        with self.lock:
            self._write_status()
        if self.args.metrics_dir:
            try:
                write_health_metrics(self.args.metrics_dir, snap, unit=unit_of(self.cgroup_text),
                                     deployment=self.args.deployment or "", node=self.args.link_node)  # fmt: skip
            except Exception as e:  # metrics never change what the wrapper does
                err(f"warning: health metrics not written to {self.args.metrics_dir}: {e}")

    def _unhealthy_reason(self) -> str:
        snap = self.unhealthy or {}
        last = (snap.get("last") or {}).get("error")
        a = self.args
        return (f"hung while serving: {snap.get('failures_in_row')} health probes in a row failed "
                f"(every {a.health_interval:g} s, {a.health_timeout:g} s each); last: {last}")  # fmt: skip

    def _rank_died_reason(self) -> str:
        r = self.rank_died or {}
        return f"rank {r.get('rank')} died {r.get('when')}: {r.get('line', '')[:300]}"

    def _on_unhealthy(self, snap: dict) -> None:
        """N failures in a row (the probe's thread): stop the engine's group as on a stop request."""
        if self.engine.stop_requested:
            return  # a stop (systemd, the link) came first: that is this run's story
        self.unhealthy = snap
        err(f"health: {self.redact.text(self._unhealthy_reason())}; stopping the engine")
        self.engine.request_stop()

    # ---- status and record

    def _known(self) -> dict:
        known = known_fields(
            argv=self.argv, cgroup_text=self.cgroup_text, started_at=self.started_at, engine=self.engine, obs=self.obs
        )
        known["health"] = self.health.snapshot() if self.health is not None else None
        known["link"] = None
        if self.link is not None:
            known["link"] = {
                "role": "head" if self.link.is_head else "worker",
                "node": self.link.node,
                "stopped_by": self.link_stop,
                "barrier": self.barrier,
            }
        return known

    # ---- the deployment link

    def _open_link(self) -> str | None:
        """Join the deployment link (workers wait for the head's welcome first); the problem, or None."""
        a = self.args
        if not (a.link_listen or a.link_head):
            return None
        self.link = DeploymentLink(
            a.link_node,
            listen=parse_addr(a.link_listen) if a.link_listen else None,
            head=parse_addr(a.link_head) if a.link_head else None,
            timeout=a.link_timeout,
            key=self.link_key,
            on_stop=self._on_link_stop,
            log=err,
            peers=tuple(n for n in (a.link_peers or "").split(",") if n),
            on_wait=self._on_barrier,
        )
        if a.link_head:
            self.notifier.send(f"STATUS=waiting for the head's wrapper at {a.link_head} (up to {a.link_wait:g} s)")
        try:
            self.link.start(time.monotonic() + a.link_wait, cancelled=lambda: self.engine.stop_requested)
        except OSError as e:
            if self.barrier is not None:  # the record keeps who was missing; the gauge stops counting
                self._link_metrics({"complete": True})
            return str(e)
        if self.barrier is not None and self.engine.stop_requested:
            self._link_metrics({"complete": True})
        elif self.barrier is not None:  # welcomed (a worker; the head's barrier said so itself)
            self._on_barrier({"complete": True, "missing": []})
        return None

    def _on_barrier(self, snap: dict) -> None:
        """The barrier's wait (a link thread or the main thread, every few seconds and at each change): systemd's
        status and start timeout (the wait is not a failed start), the live status, the missing-node gauge."""
        done = bool(snap.get("complete"))
        with self.lock:
            self.barrier = None if done else dict(snap)
            self._write_status()
        if not done:
            self.notifier.send(f"STATUS=deployment link: {snap.get('what')}",
                               f"EXTEND_TIMEOUT_USEC={int(self.args.extend_timeout * 1e6)}")  # fmt: skip
        self._link_metrics(snap)

    def _link_metrics(self, snap: dict) -> None:
        if self.args.metrics_dir:
            try:
                write_link_metrics(self.args.metrics_dir, snap, unit=unit_of(self.cgroup_text),
                                   deployment=self.args.deployment or "", node=self.args.link_node)  # fmt: skip
            except Exception as e:  # metrics never change what the wrapper does
                err(f"warning: link metrics not written to {self.args.metrics_dir}: {e}")

    def _start_link(self) -> int | None:
        """Join the link before the engine starts; the exit code when the engine must not start."""
        try:
            problem = self._open_link()
        except OSError as e:  # the head cannot listen (address in use, not this node's)
            problem = f"cannot listen on {self.args.link_listen}: {e.strerror or e}"
        none = child_fields(None, None, False)
        if problem:
            self._finish(EXIT_PEER_FAILED, "link-failed", f"{problem}; the engine was not started", child=none,
                         oom=None, left=0)  # fmt: skip
            if self.link is not None:
                self.link.close()
            return EXIT_PEER_FAILED
        if self.link is not None and self.engine.stop_requested:  # stopped, or a peer failed, while waiting
            ev = self.link_stop
            code = EXIT_PEER_FAILED if ev and ev["kind"] == "failed" else 0
            verdict = "clean-stop" if ev is None else "peer-failed" if code else "deployment-stopped"
            self._finish(code, verdict, "stopped before the engine started", child=none, oom=None, left=0)
            if ev is None:  # asked here while the nodes met at the link: the deployment stops with it
                self.link.engine_ended(False, f"stop requested ({signal_name(self.engine.stop_signal)}) before the "
                                       "engine started")  # fmt: skip
            self.link.close()
            return code
        return None

    def _end_link(self, by_link: bool, code: int, verdict: str, reason: str) -> tuple[int, str, str]:
        """The link's part of the ending: the verdict when the link stopped the engine, else tell the others."""
        if by_link:
            ev = self.link_stop
            if ev["kind"] == "failed":
                # Whatever the engine did on SIGTERM, the cause is the peer: restart with the deployment.
                code, verdict = EXIT_PEER_FAILED, "peer-failed"
                reason = f"stopped with the deployment: {ev['node']} failed first ({ev['reason']}); {reason}"
            else:
                code, verdict = 0, "deployment-stopped"
                # Not explain()'s text: an engine that exited 0 on the head's shutdown was not "unrequested".
                reason = f"stopped with the deployment: {ev['node']} was stopped on request ({ev['reason']})"
            self.link.close()
        else:
            # Its first error line, redacted: the head logs it to its journal and keeps it in its record.
            first = (self.obs.first_error or {}).get("line")
            why = f"{verdict}, exit {code}" + (f": {self.redact.text(first)}" if first else "")
            self.link.engine_ended(code != 0, why)
        return code, verdict, reason

    def _on_link_stop(self, kind: str, event: dict) -> None:
        """A peer failed or was stopped (a link thread): stop this node's engine too."""
        if self.engine.stop_requested:
            return  # systemd asked first: that stop is this node's story
        self.link_stop = dict(event)
        what = "failed" if kind == "failed" else "was stopped on request"
        err(f"link: {event['node']} {what} ({event['reason']}); stopping this node's engine with the deployment")
        if kind == "failed":
            # Its peers are gone: no clean shutdown can complete (an engine may wait for them until its stop
            # deadline), and the deployment restarts sooner the sooner every node is down.
            self.engine.shorten_deadline(self.args.link_stop_timeout)
        self.engine.request_stop()

    def _write_status(self) -> None:
        """Live status (caller holds self.lock)."""
        if not self.args.status:
            return
        data = self._known()
        data["running"] = True
        data["tail"] = list(self.tail)
        try:
            write_json_atomic(self.args.status, self.redact.deep(data))
        except OSError as e:
            err(f"--status {self.args.status}: {e.strerror}")

    def _finish(self, code: int, verdict: str, reason: str, *, child: dict, oom: dict | None, left: int) -> None:
        self.ended_at = time.time()
        with self.lock:
            rec = termination_record(
                self._known(),
                ended_at=self.ended_at,
                code=code,
                verdict=verdict,
                reason=reason,
                child=child,
                oom=oom,
                left=left,
                tail=list(self.tail),
            )
            rec = self.redact.deep(rec)
        for path, data in ((self.args.record, rec), (self.args.status, dict(rec, running=False))):
            if path:
                try:
                    write_json_atomic(path, data)
                except OSError as e:
                    err(f"cannot write {path}: {e.strerror}")
        self._write_metrics(rec)
        self.notifier.send(f"STATUS=engine ended: {verdict}, exit {code}")
        err(f"{verdict}: exit {code}: {rec['reason']}")

    def _write_metrics(self, rec: dict) -> None:
        """--metrics-dir: the termination as a node_exporter text file, after the record. Best effort: a
        metrics problem is one warning line and never changes the exit code or the record."""
        if not self.args.metrics_dir:
            return
        try:
            write_engine_metrics(self.args.metrics_dir, rec, deployment=self.args.deployment or "",
                                 node=self.args.link_node)  # fmt: skip
        except Exception as e:  # any failure here must not cost the engine's exit code
            err(f"warning: metrics not written to {self.args.metrics_dir}: {e}")

    # ---- run

    def run(self) -> int:
        try:
            return self._run()
        finally:
            self.secrets.cleanup()
            self.pump.close_log()

    def _run(self) -> int:
        try:
            env = self._setup()
        except SetupError as e:
            err(f"{e}; the engine was not started")
            return EXIT_USAGE
        except OSError as e:
            err(f"{e.filename}: {e.strerror}; the engine was not started")
            return EXIT_USAGE
        oom_src, oom_before, oom_why = oom_read(self.cgroup_text, self.cgroup_root)
        self.engine.forward_signals()
        self.started_at = time.time()
        code = self._start_link()
        if code is not None:
            return code
        try:
            proc = self.engine.start(self.argv, env)
        except OSError as e:
            code = EXIT_NOT_FOUND if isinstance(e, FileNotFoundError) else EXIT_NOT_EXECUTABLE
            why = f"cannot execute {self.argv[0]!r}: {e.strerror}; check the command and the unit's PATH"
            self._finish(code, "exec-failed", why, child=child_fields(None, None, False), oom=None, left=0)
            return code
        with self.lock:
            self._write_status()
        self.notifier.send(f"STATUS=started {os.path.basename(self.argv[0])} (pid {proc.pid})")
        self.pump.start((proc.stdout, proc.stderr), (sys.stdout, sys.stderr))
        threading.Thread(target=self._watch_group, daemon=True).start()

        exit_code, sig, core = how_it_ended(self.engine.wait())
        if self.link is not None and exit_code == 0 and not self.engine.stop_requested:
            # SGLang's workers exit 0 on the head's shutdown message, which may beat the link's STOP requested.
            ev = self.link.wait_for_stop(LINK_GRACE_S)
            if ev is not None and self.link_stop is None:
                self.link_stop = dict(ev)
        by_link = self.link_stop is not None  # the link stopped it before it ended on its own
        left = self.engine.kill_leftovers()
        self._end_group()
        _, oom_after, why_after = oom_read(self.cgroup_text, self.cgroup_root)
        oom = oom_evidence(oom_src, oom_before, oom_after)
        oom_why = oom_why or why_after

        self.pump.drain()
        code, verdict = decide(
            stop_requested=self.engine.stop_requested,
            killed_after_timeout=self.engine.killed_after_timeout,
            exit_code=exit_code,
            sig=sig,
            core=core,
            oom=oom["delta"] if oom else 0,
        )
        child = child_fields(exit_code, sig, core)
        reason = explain(verdict, code, child, oom, oom_why, engine=self.engine, hint=self.obs.hint())
        if self.health is not None:
            self.health.close()
        if self.unhealthy is not None:  # the probe asked for the stop: whatever the engine did on SIGTERM
            code, verdict = EXIT_UNHEALTHY, "unhealthy-while-serving"
            reason = f"{self._unhealthy_reason()}; the engine was stopped ({reason})"
        elif self.rank_died is not None:  # the engine's own line says a rank died: a failure to restart
            code, verdict = EXIT_UNREQUESTED, "rank-died"
            reason = f"{self._rank_died_reason()}; the engine was stopped ({reason})"
        if self.link is not None:
            code, verdict, reason = self._end_link(by_link, code, verdict, reason)
        self._finish(code, verdict, reason, child=child, oom=oom, left=left)
        return code


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="llmfleet exec",
        usage="llmfleet exec [options] -- CMD [ARG...]",
        description="Run an engine as the main process of a systemd unit: pass its output through, forward "
        "SIGTERM/SIGINT/SIGHUP to its process group, send sd_notify READY/STATUS/EXTEND_TIMEOUT_USEC/STOPPING, "
        "and write a termination record. Details: docs/wrapper.md.",
        epilog=f"exit codes: 0 stopped on request; {EXIT_UNREQUESTED} the engine exited 0 without a stop request; "
        f"{EXIT_PEER_FAILED} stopped because another node of the deployment failed (or the link did); "
        f"{EXIT_UNHEALTHY} stopped because the serving health probe failed --health-failures times in a row; "
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
    ap.add_argument("--link-listen", metavar="HOST:PORT", help="the head of a multi-node deployment: listen for the "
                    "other nodes' wrappers here (the deployment link, docs/wrapper.md)")  # fmt: skip
    ap.add_argument("--link-head", metavar="HOST:PORT", help="a worker: join the head's wrapper there before starting "
                    "the engine; stop when any node fails or is stopped")  # fmt: skip
    ap.add_argument("--link-key", metavar="CRED", help="the deployment's fabric key, $CREDENTIALS_DIRECTORY/CRED "
                    "(LoadCredential=): nodes prove it on the link (needed by --link-listen/--link-head)")  # fmt: skip
    ap.add_argument("--link-peers", metavar="NODE,...", help="the head: the other nodes' --link-node names; no "
                    "engine starts until every one has joined (the barrier: after a failure the nodes meet at the "
                    "link first), up to --link-wait")  # fmt: skip
    ap.add_argument("--link-node", default=os.uname().nodename, metavar="NAME", help="this node's name on the link")
    ap.add_argument("--link-timeout", type=float, default=5.0, metavar="SEC", help="a peer with no heartbeat this "
                    "long has failed (default 5)")  # fmt: skip
    ap.add_argument("--link-stop-timeout", type=float, default=LINK_STOP_TIMEOUT_S, metavar="SEC", help="another "
                    "node failed or a rank died: SIGKILL the engine this long after the stop request (default "
                    f"{LINK_STOP_TIMEOUT_S:g}; at most --stop-timeout; a stop on request keeps "
                    "--stop-timeout)")  # fmt: skip
    ap.add_argument("--link-wait", type=float, default=600.0, metavar="SEC", help="a worker waits this long for the "
                    "head's welcome, the head for its --link-peers (default 600); then exit "
                    f"{EXIT_PEER_FAILED}, link-failed, naming who is missing")  # fmt: skip
    ap.add_argument("--metrics-dir", metavar="DIR", help="after the record, write the termination as a Prometheus "
                    "text file DIR/llmfleet_engine_<unit>.prom for node_exporter (docs/metrics.md)")  # fmt: skip
    ap.add_argument("--deployment", metavar="NAME", help="the deployment label of the metrics (default: from the "
                    "unit's name llmfleet-NAME.service)")  # fmt: skip
    ap.add_argument("--health-url", metavar="URL", help="from READY on, ask the engine's API there (its base, "
                    "e.g. http://127.0.0.1:30000) the readiness gate's question, every --health-interval")  # fmt: skip
    ap.add_argument("--health-model", default="", metavar="NAME", help="the model the health question goes to "
                    "(default: none sent, the engine's own)")  # fmt: skip
    ap.add_argument("--health-interval", type=float, default=30.0, metavar="SEC", help="seconds between health "
                    "probes (default 30)")  # fmt: skip
    ap.add_argument("--health-timeout", type=float, default=20.0, metavar="SEC", help="a probe without a complete, "
                    "correct answer this long has failed (the whole answer, default 20)")  # fmt: skip
    ap.add_argument("--health-failures", type=int, default=3, metavar="N", help="this many failed probes in a row "
                    f"stop the engine: exit {EXIT_UNHEALTHY}, unhealthy-while-serving (default 3)")  # fmt: skip
    ap.add_argument("--health-prompt", default=DEFAULT_PROMPT, metavar="TEXT", help="the question (default: the "
                    "readiness gate's)")  # fmt: skip
    ap.add_argument("--health-expect", default=DEFAULT_EXPECT, metavar="TEXT", help="its answer (default "
                    f"{DEFAULT_EXPECT})")  # fmt: skip
    ap.add_argument("--health-key", metavar="CRED", help="the API key for the probe, $CREDENTIALS_DIRECTORY/CRED "
                    "(LoadCredential=); sent as a header only")  # fmt: skip
    ap.add_argument("--secret-config", action="append", metavar="OPT:KEY=CRED", help="write 'KEY: <secret>' to a "
                    "private YAML file and pass --OPT FILE to the engine")  # fmt: skip
    return ap


def _link_problem(args: argparse.Namespace) -> str | None:
    if args.link_listen and args.link_head:
        return "--link-listen (the head) and --link-head (a worker) exclude each other"
    if (args.link_listen or args.link_head) and not args.link_key:
        return (
            "--link-listen/--link-head need --link-key CRED: the deployment's fabric key as a credential "
            "(LoadCredential=CRED:/etc/llmfleet/credentials/<deployment>.fabric-key), so strangers cannot join"
        )
    if args.link_key and not re.fullmatch(r"[A-Za-z0-9_.@-]+", args.link_key):
        return f"--link-key {args.link_key!r}: a credential name (no '/')"
    if args.link_timeout <= 0 or args.link_wait <= 0 or args.link_stop_timeout <= 0:
        return "--link-timeout, --link-wait and --link-stop-timeout must be > 0"
    for flag, value in (("--link-listen", args.link_listen), ("--link-head", args.link_head)):
        try:
            if value:
                parse_addr(value)
        except ValueError as e:
            return f"{flag}: {e}"
    return None


def _peers_problem(args: argparse.Namespace) -> str | None:
    if args.link_peers is None:
        return None
    if not args.link_listen:
        return "--link-peers names the nodes the head waits for: only with --link-listen"
    names = args.link_peers.split(",")
    if not all(re.fullmatch(r"[A-Za-z0-9_.@:-]+", n) for n in names) or args.link_node in names:
        return (f"--link-peers {args.link_peers!r}: the other nodes' --link-node names, comma-separated (letters, "
                "digits and _.@:- only; not this node's own)")  # fmt: skip
    return None


def _health_problem(args: argparse.Namespace) -> str | None:
    if not args.health_url:
        return None
    if args.health_interval <= 0 or args.health_timeout <= 0 or args.health_failures < 1:
        return "--health-interval and --health-timeout must be > 0, --health-failures >= 1"
    if args.health_key and not re.fullmatch(r"[A-Za-z0-9_.@-]+", args.health_key):
        return f"--health-key {args.health_key!r}: a credential name (no '/')"
    return check_url(args.health_url)


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
        problem = _link_problem(args) or _peers_problem(args) or _health_problem(args)
    if not problem:
        try:
            re.compile(args.ready_regex or DEFAULT_READY_REGEX)
            parse_secret_specs(args.secret_env or [], args.secret_config or [])
        except re.error as e:
            problem = f"--ready-regex {args.ready_regex!r}: {e}"
        except SetupError as e:
            problem = str(e)
    if problem:
        err(problem)
        return EXIT_USAGE
    return Wrapper(args, cmd).run()


if __name__ == "__main__":
    sys.exit(main())
