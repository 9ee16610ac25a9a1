"""Fleet-wide reader leases on a shared filesystem: at most ``cap`` holders at once, across
nodes and across independent playbook runs (two operators staging at the same time).

Protocol
--------
Each slot ``i`` is a chain of immutable records ``slot-<i>.<n>`` (n = 0, 1, 2, ...). The newest
record says who holds the slot (or that it was released). Every change of a slot - acquire,
takeover, renewal, release - is the creation of the next record ``slot-<i>.<n+1>``, and a record
name is created at most once: the writer fills a private temp file, then ``link()``s it to the
record name, which fails with EEXIST when the name exists. Of any number of processes that want
record n+1, exactly one gets it. Hence:

- a holder renews (every ttl/4, from a heartbeat thread) by creating the next record itself, so
  a renewal and a takeover of the same record cannot both succeed;
- a contender may create the next record over a *holding* record only when it is stale: the
  contender saw that record stay the newest one for a full ``ttl`` by its own monotonic clock; or
  the expiry the holder wrote in it is more than ``max_skew`` (default: ttl) in the past by the
  contender's wall clock; or the holder is a dead pid on the contender's own host (same ``host``
  name: processes in different pid namespaces of one machine need different host names);
- a holder considers itself valid until ttl/2 after it *started* writing its newest record.
  ``check()`` raises ``LeaseLost`` (which slot, who took it, when) once the slot is known to be
  taken over; past the validity it first tries to renew and raises if it cannot. The heartbeat
  notices a takeover at its next renewal and ``check()`` then raises straight away.

What the cap guarantees
-----------------------
For every slot, at most one process is between a successful ``acquire()``/``check()`` and the end
of the work it started then - so at most ``cap`` readers fleet-wide - provided:

- each unit of work started after a successful ``check()`` ends within ttl/2 of it (call ``check()``
  between chunks; a process paused longer than that, e.g. by SIGSTOP or a hung NFS read, can
  overlap with the process that took its slot: no lease without fencing at the storage can stop
  a paused process from finishing a read it already started);
- monotonic clocks of all nodes run at the same rate (NTP slews them by at most 0.05 %);
- wall clocks differ by less than ``max_skew`` (only the fast takeover of long-expired holdings
  uses them; preflight fails a node whose offset exceeds 0.1 s);
- a directory listing lags the server by less than ``gc_after``/2 (default 150 s; NFS clients:
  ``acdirmax``, 60 s by default). Superseded records are deleted ``gc_after`` after their successor
  was created; a process that created a record from an older view (it stalled in between) checks
  for newer records and, finding them, does not count itself as the holder;
- every process sharing the directory runs this protocol. A live lease of the former one-file-
  per-slot format (``slot-<i>``) keeps its slot busy until it expires, but the former code does
  not see records of this one: do not run both versions against one directory.

What it relies on in the filesystem (NFSv3/v4 and local filesystems give all of it)
-----------------------------------------------------------------------------------
- ``link()`` to an existing name fails on the server, atomically. A retransmitted LINK whose
  first reply was lost answers EEXIST although it worked, so success is decided by the temp
  file's link count (2 = ours), as open(2) recommends for lock files on NFS. O_EXCL is used only
  for private temp names. The directory must support hard links.
- Records are never modified after they are linked, so a reader sees either no record or a
  complete one: attribute caching and close-to-open timing cannot show a half-written or an
  outdated record. All times that decide anything are written into the records by their writers
  or taken from the deciding process's own clock; file mtimes are used only to collect leftover
  temp files.
- A directory listing may lag on an NFS client (``acdirmax``, 60 s by default). That delays
  noticing a released slot or a renewal; it never lets two processes create the same record.
- No flock()/fcntl() locks (lockd is not reliable across nodes and clients), no rename over a
  shared name, nothing that needs the server's clock.

Files: one record per acquire, renewal and release, collected ``gc_after`` after it was superseded
(about a dozen per busy slot with the defaults), plus ``tmp-*`` names that live for one write.
Every acquire/release/takeover/loss is appended to ``readers.log`` (JSON lines) so operators and
tests can see the real read fan-out.

Other accounts may write the lease directory (shared storage every node, or every squashed user, can
write): the directory is opened once without following a link another user could plant
(safefs.open_dir: a symlinked ``leases`` is refused with an error naming it) and every file operation
then goes through that directory fd; every open is O_NOFOLLOW | O_NONBLOCK and only regular files
are read or appended to, so a planted link is never written through or deleted through, and a
planted FIFO (as ``readers.log`` or a record) is skipped at once: staging never hangs on this
directory.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from .. import safefs

_RECORD = re.compile(r"slot-(\d+)(?:\.(\d+))?$")
_LEGACY = -1  # pseudo record number of a former-format ``slot-<i>`` file
_MAX_RECORD = 64 * 1024


class LeaseTimeout(RuntimeError):
    """No slot became free before the deadline."""


class LeaseLost(Exception):
    """This holder no longer holds its slot: stop reading from shared storage.

    ``slot``: the slot index; ``by``: the record of the process that took it over (host, pid,
    label, ...) or None when unknown; ``at``: that record's wall-clock time or None."""

    def __init__(self, msg: str, slot: int | None = None, by: dict[str, Any] | None = None, at: float | None = None):
        super().__init__(msg)
        self.slot = slot
        self.by = by
        self.at = at


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # unknown: never treat as dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_O_LOG = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _read(path: str, dir_fd: int | None = None) -> dict[str, Any] | None:
    """A record's content, or None when absent or not a record. Other users may write the lease
    directory: never follow a planted link or block on a planted FIFO."""
    try:
        fd = os.open(path, _O_READ, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_RECORD:
            return None
        data = os.read(fd, _MAX_RECORD)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        info = json.loads(data)
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def _who(info: dict[str, Any] | None) -> str:
    if not info:
        return "an unknown holder"
    return f"{info.get('host', '?')}:{info.get('pid', '?')} ({info.get('label', '')})"


def _when(t: Any) -> str:
    if not isinstance(t, (int, float)):
        return "an unknown time"
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def _num(v: Any, default: float) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


class Lease:
    def __init__(
        self,
        lease_dir: str,
        cap: int,
        ttl: float = 120.0,
        host: str | None = None,
        label: str = "",
        *,
        max_skew: float | None = None,
        gc_after: float | None = None,
    ) -> None:
        if cap < 1:
            raise ValueError(f"reader cap {cap}: must be >= 1")
        if ttl <= 0:
            raise ValueError(f"lease ttl {ttl}: must be > 0 seconds")
        self.dir = lease_dir
        self.cap = cap
        self.ttl = ttl
        self.max_skew = ttl if max_skew is None else max_skew
        self.gc_after = 300.0 if gc_after is None else gc_after
        self.host = host or socket.gethostname()
        self.label = label
        self.token = uuid.uuid4().hex
        self.slot: int | None = None  # index of the held slot
        self.gen = -1  # number of this holder's newest record in that slot
        self.acquired_at = 0.0
        self._written = 0.0  # monotonic time at which writing the newest record started
        self._lost: LeaseLost | None = None
        self._seen: dict[int, tuple[int, float]] = {}  # slot -> (newest record, first seen, monotonic)
        self._known: dict[int, tuple[int, dict[str, Any] | None]] = {}  # slot -> (record, content)
        self._lock = threading.Lock()  # heartbeat vs check() vs release()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._dfd = -1  # the lease directory, opened once (_fd)

    def _fd(self) -> int:
        """The lease directory's fd: created if missing, never reached through a link another user could
        have planted (a symlinked ``leases`` is refused: safefs.UnsafePathError, an OSError)."""
        if self._dfd < 0:
            try:
                self._dfd = safefs.open_dir(os.path.abspath(self.dir), create_mode=0o755)
            except safefs.UnsafePathError as e:
                raise safefs.UnsafePathError(f"lease directory (model_stage_lease_dir): {e}") from None
        return self._dfd

    def close(self) -> None:
        """Close the lease directory's fd (reopened on the next use). Not done by release(): threads of
        a SharedLease may still list the directory through it."""
        if self._dfd >= 0:
            os.close(self._dfd)
            self._dfd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _names(self) -> list[str]:
        """The directory's entries, through a fresh open of it: os.listdir(fd) reads through a dup of the
        fd, which shares its offset, so two threads listing through the one fd would each miss entries."""
        fd = os.open(".", safefs.O_DIR, dir_fd=self._fd())
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def _name(self, slot: int, n: int) -> str:
        return f"slot-{slot}.{n}"

    # -- records -----------------------------------------------------------------------------------
    def _scan(self) -> dict[int, list[int]]:
        """Record numbers per slot, ascending (_LEGACY first where a former-format file exists)."""
        out: dict[int, list[int]] = {}
        for name in self._names():
            m = _RECORD.match(name)
            if m:
                out.setdefault(int(m[1]), []).append(_LEGACY if m[2] is None else int(m[2]))
        for v in out.values():
            v.sort()
        return out

    def _create(self, slot: int, n: int, state: str, **extra: Any) -> bool:
        """Create record n of the slot; False when another process created it first."""
        now = time.time()
        body = json.dumps(
            {"slot": slot, "n": n, "state": state, "host": self.host, "pid": os.getpid(), "token": self.token,
             "label": self.label, "acquired": self.acquired_at or now, "t": now, "expires": now + self.ttl, **extra}
        ).encode()  # fmt: skip
        dfd = self._fd()
        for _ in range(5):
            tmp = f"tmp-{self.token}-{uuid.uuid4().hex[:12]}"
            try:
                # O_EXCL|O_NOFOLLOW: never write through something planted at the name.
                fd = os.open(tmp, safefs.O_NEW_FILE, 0o644, dir_fd=dfd)
                break
            except FileExistsError:
                continue
        else:
            raise OSError(errno.EEXIST, f"{self.dir}: cannot create a private temp file for a lease record")
        try:
            # No fsync: close() flushes to an NFS server, and a record whose content a crash lost
            # reads as an unknown holder, which goes stale after a ttl without renewal.
            try:
                os.write(fd, body)
            finally:
                os.close(fd)
            try:
                os.link(tmp, self._name(slot, n), src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                return True
            except OSError as e:
                # NFS: a retransmitted LINK whose reply was lost fails although the first one worked.
                with contextlib.suppress(OSError):
                    if os.stat(tmp, dir_fd=dfd, follow_symlinks=False).st_nlink == 2:
                        return True
                if e.errno == errno.EEXIST:
                    return False
                if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise OSError(
                        e.errno,
                        f"{self.dir}: the lease directory does not support hard links ({e.strerror}); "
                        f"put reader leases on NFS or another POSIX filesystem",
                    ) from e
                raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)

    def _stale(self, slot: int, n: int, info: dict[str, Any] | None) -> str | None:
        """Why record n (the newest of its slot) may be superseded by a contender, or None."""
        if info is not None and info.get("state") == "released":
            return "released"
        if info is not None:
            if info.get("host") == self.host and not _pid_alive(int(_num(info.get("pid"), 0))):
                return "dead"
            if _num(info.get("expires"), float("inf")) + self.max_skew < time.time():
                return "expired"
        # Skew-free: the holder would have created a newer record within ttl/4 if it were alive.
        now = time.monotonic()
        seen = self._seen.get(slot)
        if seen is None or seen[0] != n:
            self._seen[slot] = (n, now)
            return None
        return "unrenewed" if now - seen[1] >= self.ttl else None

    def _resurrected(self, slot: int, n: int, view: float) -> bool:
        """After creating record n from a view of the directory taken at ``view`` (monotonic): True
        when the view was so old that record n may have existed and been collected meanwhile, and
        newer records show it did. A fresh view cannot be that old (see the module docstring)."""
        if time.monotonic() - view <= self.gc_after / 2:
            return False
        return max(self._scan().get(slot, [n])) > n

    def _record(self, slot: int, n: int) -> dict[str, Any] | None:
        """Content of record n; records never change, so the last one read is remembered."""
        known = self._known.get(slot)
        if known and known[0] == n:
            return known[1]
        info = _read(self._name(slot, n), self._fd())
        if info is not None:
            self._known[slot] = (n, info)
        return info

    def try_acquire(self) -> bool:
        if self.slot is not None:
            raise RuntimeError(f"{self.dir}: this lease already holds slot {self.slot}")
        self._fd()  # created if missing; a symlinked lease directory is refused
        view = time.monotonic()
        records = self._scan()
        for i in range(self.cap):
            ns = records.get(i, [])
            if ns and ns[0] == _LEGACY:
                legacy = _read(f"slot-{i}", self._fd())
                if legacy and _num(legacy.get("expires"), 0) > time.time():
                    continue  # a live lease of the former format
                ns = ns[1:]
            n, info, why = -1, None, "free"
            if ns:
                n = ns[-1]
                info = self._record(i, n)
                if info is None and safefs.lstat_at(self._fd(), self._name(i, n)) is None:
                    continue  # collected since the listing: the listing is old, look again later
                why = self._stale(i, n, info)
                if why is None:
                    continue
            self.acquired_at = time.time()
            written = time.monotonic()
            taken = {"took_over": {"n": n, "why": why, "from": _who(info)}} if why not in ("free", "released") else {}
            if not self._create(i, n + 1, "held", **taken) or self._resurrected(i, n + 1, view):
                self.acquired_at = 0.0
                continue  # another process got this record first
            self.slot, self.gen, self._written, self._lost = i, n + 1, written, None
            self._seen.clear()
            self._known.clear()
            if taken:
                self._log("expired", slot=i, why=why, previous=_who(info))
            self._log("acquire", slot=i)
            self._gc(i)
            return True
        return False

    def acquire(self, timeout: float, poll: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while not self.try_acquire():
            if time.monotonic() > deadline:
                held = ", ".join(_who(h) for h in self.holders() if h) or "no readable holder (garbage records?)"
                raise LeaseTimeout(
                    f"no shared-storage reader slot free in {timeout:.0f}s (cap {self.cap} in {self.dir}); "
                    f"held by {held}"
                )
            time.sleep(poll)
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="lease-heartbeat", daemon=True)
        self._beat.start()

    # -- holding -----------------------------------------------------------------------------------
    @property
    def lost(self) -> LeaseLost | None:
        """Why this holder lost its slot (set by the heartbeat, check() or release()), else None."""
        return self._lost

    def _valid_until(self) -> float:
        return self._written + self.ttl / 2

    def _wall(self, mono: float) -> float:
        return time.time() - (time.monotonic() - mono)

    def _lose(self, why: str, by: dict[str, Any] | None = None) -> None:
        at = by.get("t") if by else None
        self._lost = LeaseLost(
            f"shared-storage reader slot {self.slot} in {self.dir}: {why}; this holder "
            f"{self.host}:{os.getpid()} ({self.label}) last renewed at {_when(self._wall(self._written))}: "
            f"stop reading from shared storage",
            slot=self.slot,
            by=by,
            at=at if isinstance(at, (int, float)) else None,
        )
        self._log("lost", slot=self.slot, reason=why, valid_until=self._wall(self._valid_until()))

    def _renew(self) -> None:
        """Create the next record of the held slot (caller holds self._lock)."""
        if self.slot is None or self._lost:
            return
        written = time.monotonic()
        if self._create(self.slot, self.gen + 1, "held"):
            if self._resurrected(self.slot, self.gen + 1, self._written):
                self._lose(f"not renewed for {written - self._written:.0f}s and taken over meanwhile")
                return
            self.gen += 1
            self._written = written
            self._gc(self.slot)
            return
        taker = _read(self._name(self.slot, self.gen + 1), self._fd())
        self._lose(f"taken over by {_who(taker)} at {_when(taker.get('t') if taker else None)}", taker)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            with self._lock:
                if self.slot is None or self._lost:
                    return
                try:
                    self._renew()
                except OSError as e:
                    # Retried at the next beat; check() stops the readers once the validity lapses.
                    self._log("renew_failed", slot=self.slot, error=str(e))

    def check(self) -> None:
        """Raise LeaseLost unless this holder still holds its slot. Cheap while the last renewal is
        recent (no I/O); call it between chunks while reading."""
        if self._lost:
            raise self._lost
        if self.slot is None:
            raise LeaseLost(f"{self.dir}: this process ({self.label}) holds no reader slot (not acquired or released)")
        if time.monotonic() < self._valid_until():
            return
        with self._lock:
            if not self._lost and self.slot is not None and time.monotonic() >= self._valid_until():
                try:
                    self._renew()
                except OSError as e:
                    self._lose(f"could not renew ({e}); another reader may have taken it over")
            if self._lost:
                raise self._lost

    def release(self) -> None:
        self._stop.set()
        if self._beat and self._beat is not threading.current_thread():
            self._beat.join(timeout=5)
        with self._lock:
            if self.slot is None:
                return
            slot = self.slot
            if not self._lost:
                # Log before freeing the slot: the next holder's "acquire" must come after our "release".
                self._log("release", slot=slot, valid_until=self._wall(self._valid_until()))
                try:
                    # A record resurrected after a long stall is not the newest one: harmless.
                    freed = self._create(slot, self.gen + 1, "released")
                except OSError as e:
                    freed = True  # not freed, but not lost either: the slot goes stale after ttl
                    self._log("release_failed", slot=slot, error=str(e))
                if freed:
                    self._gc(slot)
                else:
                    taker = _read(self._name(slot, self.gen + 1), self._fd())
                    self._lose(f"taken over by {_who(taker)} at {_when(taker.get('t') if taker else None)}", taker)
            self.slot, self.gen, self.acquired_at = None, -1, 0.0

    def holders(self) -> list[dict[str, Any] | None]:
        """Per slot, the newest record when it is a holding (possibly stale), else None."""
        try:
            records = self._scan()
        except OSError:
            records = {}
        out: list[dict[str, Any] | None] = []
        for i in range(self.cap):
            ns = records.get(i, [])
            info = _read(self._name(i, ns[-1]), self._fd()) if ns and ns[-1] != _LEGACY else None
            if info is None and ns and ns[0] == _LEGACY:
                info = _read(f"slot-{i}", self._fd())
                info = info if info and _num(info.get("expires"), 0) > time.time() else None
            out.append(info if info and info.get("state") != "released" else None)
        return out

    def _gc(self, slot: int) -> None:
        """Delete records superseded more than gc_after ago (never the newest) and old temp files."""
        with contextlib.suppress(OSError):
            cutoff = time.time() - self.gc_after
            ns = [n for n in self._scan().get(slot, []) if n != _LEGACY]
            dfd = self._fd()
            for old, newer in zip(ns, ns[1:]):  # noqa: RUF007 (itertools.pairwise needs 3.10; nodes may run 3.8)
                info = _read(self._name(slot, newer), dfd)
                if info is None or _num(info.get("t"), cutoff) >= cutoff:
                    break  # records are created in order: the rest are younger
                os.unlink(self._name(slot, old), dir_fd=dfd)  # the name itself: a link, never its target
            for name in self._names():
                if name.startswith("tmp-"):
                    with contextlib.suppress(OSError):
                        if os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime < cutoff:
                            os.unlink(name, dir_fd=dfd)

    def _log(self, event: str, **kw: Any) -> None:
        rec = {"t": time.time(), "event": event, "host": self.host, "pid": os.getpid(), "label": self.label,
               "token": self.token, **kw}  # fmt: skip
        with contextlib.suppress(OSError):
            # O_NOFOLLOW: a readers.log planted as a link to a system file must not get root's lines;
            # O_NONBLOCK and regular files only: one planted as a FIFO is skipped, never waited on.
            fd = os.open("readers.log", _O_LOG, 0o644, dir_fd=self._fd())
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
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
                    end = time.time()
                    if self.lease.lost:  # it ended when its validity lapsed, not when we noticed
                        end = max(self._t0, min(end, self.lease._wall(self.lease._valid_until())))
                    self.intervals.append((self._t0, end))

    def check(self) -> None:
        """Raise LeaseLost unless this process still holds its slot (see Lease.check)."""
        self.lease.check()


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """Largest number of intervals open at one instant (releases sort before acquires at a tie)."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def intervals_from_log(path: str) -> list[tuple[float, float]]:
    """(acquire, end) pairs per holder from a readers.log. A holding ends at its release or loss,
    or earlier when its validity had lapsed by then (``valid_until``)."""
    open_: dict[tuple, float] = {}
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                r = json.loads(line)
                key = (r["token"],) if "token" in r else (r["host"], r["pid"], r["slot"])
                if r["event"] == "acquire":
                    open_[key] = r["t"]
                elif r["event"] in ("release", "lost") and key in open_:
                    start = open_.pop(key)
                    out.append((start, max(start, min(r["t"], r.get("valid_until", r["t"])))))
    return out
