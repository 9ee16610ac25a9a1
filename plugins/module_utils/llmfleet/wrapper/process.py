"""The engine's process group under ``llmfleet exec``: start it in its own session, forward stop signals, SIGKILL
it past the stop deadline, reap the child, and kill what is left of the group.

Stdlib only, Python >= 3.8 (copied to nodes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
LEFTOVER_WAIT_S = 2.0
POLL_S = 0.05


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


def how_it_ended(status: int) -> tuple[int | None, int | None, bool]:
    """(exit code, signal, core dumped) of a waitpid status."""
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    return exit_code, sig, bool(sig is not None and os.WCOREDUMP(status))


class EngineProcess:
    """The engine's process group and the stop requests made to it.

    on_stop runs once in the main thread when a stop request is first seen (after the deadline is set); before_kill
    right before the wrapper SIGKILLs the group (the deadline, the leftovers), while its processes can still be read."""

    def __init__(
        self, stop_timeout: float, on_stop: Callable[[], None], before_kill: Callable[[], None] | None = None
    ) -> None:
        self.stop_timeout = stop_timeout
        self.on_stop = on_stop
        self.before_kill = before_kill or (lambda: None)
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.pending_signals: list[int] = []
        self.stop_requested = False
        self.stop_signal: int | None = None
        self.stop_requested_at: float | None = None
        self.killed_after_timeout = False
        self.stop_deadline: float | None = None
        self.short_deadline = False  # the stop is the link's (a peer failed, a rank died): --link-stop-timeout

    def shorten_deadline(self, seconds: float) -> None:
        """Before the stop request: a stop because something already failed gets at most ``seconds``."""
        if seconds < self.stop_timeout:
            self.stop_timeout, self.short_deadline = seconds, True

    def forward_signals(self) -> None:
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, self._on_signal)

    # The handler runs in the main thread between bytecodes: no locks, no I/O but kill.
    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.pid is None:
            self.pending_signals.append(signum)
        else:
            _killpg(self.pid, signum)
        if signum in STOP_SIGNALS and not self.stop_requested:
            self.stop_signal = signum
            self.stop_requested_at = time.time()
            self.stop_requested = True

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """A stop the wrapper itself asks for (the deployment link, from its thread): as if systemd had sent it.
        before_kill first, while the group is untouched: a process that ends on the signal unmaps what it made (a
        vLLM message queue created since the last scan) without removing it, and a scan after the signal misses it."""
        if not self.stop_requested and self.pid is not None:
            self.before_kill()
        self._on_signal(signum, None)

    def start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Popen in a new session with both streams piped (OSError when argv[0] cannot be executed); a signal
        that arrived before is forwarded now."""
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env=env, bufsize=0
        )
        self.proc, self.pid = proc, proc.pid
        pending, self.pending_signals = self.pending_signals, []
        for sig in pending:
            _killpg(proc.pid, sig)
        return proc

    def wait(self) -> int:
        """Poll the child (a blocking waitpid could not also watch the stop deadline) and act on stop requests."""
        pid = self.pid
        while True:
            got, status = os.waitpid(pid, os.WNOHANG)
            self._stop_bookkeeping()  # also when the child died of the forwarded signal at once
            if got == pid:
                self.proc.returncode = -1  # reaped with os.waitpid: keep Popen from reaping or warning
                return status
            if self.stop_deadline is not None and not self.killed_after_timeout:
                if time.monotonic() >= self.stop_deadline:
                    self.killed_after_timeout = True
                    self.before_kill()
                    _killpg(pid, signal.SIGKILL)
            time.sleep(POLL_S)

    def _stop_bookkeeping(self) -> None:
        if self.stop_requested and self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.stop_timeout
            self.on_stop()

    def kill_leftovers(self) -> int:
        """Orphaned ranks must never keep running (and holding GPUs): SIGKILL what is left of the group."""
        pgid = self.pid
        left = pids_in_group(pgid)
        if left:
            self.before_kill()
        _killpg(pgid, signal.SIGKILL)
        end = time.monotonic() + LEFTOVER_WAIT_S
        while left and pids_in_group(pgid) and time.monotonic() < end:
            time.sleep(0.02)
        return len(left)
