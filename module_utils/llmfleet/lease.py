"""Fleet-wide reader leases on a shared filesystem: at most ``cap`` holders at once, across
nodes and across independent playbook runs (two operators staging at the same time).

One file per slot (``slot-<i>``), created with O_EXCL, holding host, pid, token and expiry.
A holder renews its expiry from a heartbeat thread; a lease whose expiry has passed (holder
killed, node rebooted) or whose holder is a dead pid on this host is stolen by rename (only
one stealer wins). Every acquire/release is appended to ``readers.log`` (JSON lines) so
operators and tests can see the real read fan-out.

Expiry uses wall clocks: nodes must be time-synced (preflight checks it); keep ttl well above
the worst clock offset.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any


class LeaseTimeout(RuntimeError):
    """No slot became free before the deadline."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class Lease:
    def __init__(self, lease_dir: str, cap: int, ttl: float = 120.0, host: str | None = None, label: str = "") -> None:
        if cap < 1:
            raise ValueError(f"reader cap {cap}: must be >= 1")
        self.dir = lease_dir
        self.cap = cap
        self.ttl = ttl
        self.host = host or socket.gethostname()
        self.label = label
        self.token = uuid.uuid4().hex
        self.slot: str | None = None
        self.acquired_at = 0.0
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # -- slot files --------------------------------------------------------------------------------
    def _content(self) -> bytes:
        now = time.time()
        return json.dumps(
            {"host": self.host, "pid": os.getpid(), "token": self.token, "label": self.label,
             "acquired": self.acquired_at or now, "expires": now + self.ttl}
        ).encode()  # fmt: skip

    def _stale(self, info: dict[str, Any] | None, path: str) -> bool:
        if info is None:
            # Unreadable: being written right now, or garbage. Garbage older than ttl is stale.
            with contextlib.suppress(OSError):
                return time.time() - os.stat(path).st_mtime > self.ttl
            return False
        if info.get("expires", 0) < time.time():
            return True
        return info.get("host") == self.host and not _pid_alive(int(info.get("pid", 0)))

    def try_acquire(self) -> bool:
        os.makedirs(self.dir, exist_ok=True)
        for i in range(self.cap):
            path = os.path.join(self.dir, f"slot-{i}")
            for _attempt in range(2):
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    if not self._stale(_read(path), path):
                        break
                    grave = f"{path}.stale-{self.token}"
                    try:
                        os.rename(path, grave)  # only one stealer's rename succeeds
                    except FileNotFoundError:
                        continue
                    os.unlink(grave)
                    self._log("expired", slot=i)
                    continue
                self.acquired_at = time.time()
                try:
                    os.write(fd, self._content())
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self.slot = path
                self._log("acquire", slot=i)
                return True
        return False

    def acquire(self, timeout: float, poll: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while not self.try_acquire():
            if time.monotonic() > deadline:
                held = ", ".join("{host}:{pid} ({label})".format(**h) for h in self.holders() if h)
                raise LeaseTimeout(
                    f"no shared-storage reader slot free in {timeout:.0f}s (cap {self.cap} in {self.dir}); "
                    f"held by {held}"
                )
            time.sleep(poll)
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="lease-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            if not self.slot:
                return
            info = _read(self.slot)
            if not info or info.get("token") != self.token:
                return  # stolen (we were presumed dead): nothing to renew
            tmp = f"{self.slot}.renew-{self.token}"
            # Root writes here and other users of the shared storage may too: never through a link
            # planted at the (readable) token's name. A leftover entry is removed, not followed.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except OSError:
                continue  # someone raced us to the name: skip this beat, the next one retries
            try:
                os.write(fd, self._content())
            finally:
                os.close(fd)
            os.replace(tmp, self.slot)

    def release(self) -> None:
        self._stop.set()
        if self._beat:
            self._beat.join(timeout=5)
        if self.slot:
            # Log before freeing the slot: the next holder's "acquire" must come after our "release".
            self._log("release", slot=int(self.slot.rsplit("-", 1)[1]))
            info = _read(self.slot)
            if info and info.get("token") == self.token:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.slot)
            self.slot = None

    def holders(self) -> list[dict[str, Any] | None]:
        return [_read(os.path.join(self.dir, f"slot-{i}")) for i in range(self.cap)]

    def _log(self, event: str, **kw: Any) -> None:
        rec = {"t": time.time(), "event": event, "host": self.host, "pid": os.getpid(), "label": self.label,
               "token": self.token, **kw}  # fmt: skip
        with contextlib.suppress(OSError):
            # O_NOFOLLOW: a readers.log planted as a link to a system file must not get root's lines.
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
            fd = os.open(os.path.join(self.dir, "readers.log"), flags, 0o644)
            try:
                os.write(fd, (json.dumps(rec) + "\n").encode())
            finally:
                os.close(fd)


class SharedLease:
    """One lease per process, shared by its reader threads (a node counts once toward the cap).
    Taken when the first thread starts reading, released when the last one stops."""

    def __init__(self, lease: Lease, timeout: float) -> None:
        self.lease = lease
        self.timeout = timeout
        self._n = 0
        self._lock = threading.Lock()
        self.intervals: list[tuple[float, float]] = []

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._n == 0:
                self.lease.acquire(self.timeout)
                self._t0 = time.time()
            self._n += 1
        try:
            yield
        finally:
            with self._lock:
                self._n -= 1
                if self._n == 0:
                    self.lease.release()
                    self.intervals.append((self._t0, time.time()))


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """Largest number of intervals open at one instant (releases sort before acquires at a tie)."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def intervals_from_log(path: str) -> list[tuple[float, float]]:
    """(acquire, release) pairs per holder from a readers.log."""
    open_: dict[tuple, float] = {}
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            with contextlib.suppress(ValueError, KeyError):
                r = json.loads(line)
                key = (r["token"],) if "token" in r else (r["host"], r["pid"], r["slot"])
                if r["event"] == "acquire":
                    open_[key] = r["t"]
                elif r["event"] == "release" and key in open_:
                    out.append((open_.pop(key), r["t"]))
    return out
