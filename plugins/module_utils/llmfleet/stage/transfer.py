"""Copying a revision's files into a node's partial dir: from shared storage or from a peer,
hashed as each chunk lands and verified against the manifest as each file lands, on a pool of
copy threads under a shared rate limit. A local file is copied by the kernel (copy_file_range) and
each chunk hashed from the destination's own pages; a peer's bytes are read, hashed and written.

Where the files go and what is kept is the store's (store.py); which sources to try, in which
order, is the caller's (staging.py, swarm.py).
Stdlib only (runs inside an Ansible module on the node and in the CLI).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import http.client
import json
import mmap
import os
import socket
import stat
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

from .. import fabric_key, safefs
from .errors import DiskFullError, LeaseLostError, LockedError, StageError
from .manifest import open_source_file, source_bounds
from .progress import Progress
from .store import Journal, open_subdirs

CHUNK = 16 * 1024 * 1024
DIRECT_BLOCK = 4096  # direct I/O writes whole blocks of this size (the page size; devices' blocks divide it)
# copy_file_range chunk of a local copy (measured: 64 MiB; docs/staging.md "Where one node's time goes").
FAST_CHUNK = 64 * 1024 * 1024
# A cut-through fetch waits on the sender while its copy pauses; the sender ends it after peer.STALL_S.
FOLLOW_TIMEOUT_S = 150.0
# Errors that no other source can help with: every copy thread stops, the first one is raised.
FATAL = (DiskFullError, LeaseLostError, LockedError)
# Durability of one file's data: fdatasync where there is one (the size is data; the mtime is not needed).
_datasync = getattr(os, "fdatasync", os.fsync)
SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        import ctypes  # a Python built without it (no libffi) still stages, without the head start

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, ImportError, OSError):  # not Linux, or a libc without it
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SFR = _sync_file_range()


def start_writeback(fd: int, offset: int, n: int) -> None:
    """Start writing [offset, offset+n) of fd to disk now, without waiting (sync_file_range WRITE):
    the file's fdatasync at its end then waits for its last chunk only, and dirty pages never pile up
    to the kernel's throttling limit in the middle of the copy. Durability still comes from that
    fdatasync; where the call is missing this does nothing."""
    if _SFR is not None:
        _SFR(fd, offset, n, SYNC_FILE_RANGE_WRITE)  # a failure here only loses the head start


class RateLimit:
    """Bytes per second shared by all copy threads of a node (0 = unlimited): protects shared
    storage and the fabric from one staging run."""

    def __init__(self, bytes_per_s: int) -> None:
        self.rate = bytes_per_s
        self.t0 = time.monotonic()
        self.sent = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            self.sent += n
            ahead = self.sent / self.rate - (time.monotonic() - self.t0)
        if ahead > 0:
            time.sleep(ahead)


UNLIMITED = RateLimit(0)


def copy_stream(
    src: BinaryIO,
    dst_path: str | int,
    want: dict[str, Any],
    progress: Progress | None,
    *,
    from_peer: bool | None,
    limit: RateLimit = UNLIMITED,
    check: Callable[[], None] | None = None,
    direct: bool = False,
) -> str:
    """Copy src to dst_path (or into an open fd, which is closed) hashing in the same pass; fdatasync; return
    the sha256 hex. check() runs before every chunk read (a lost reader lease stops the copy between two
    chunks). direct: a local file is copied with direct I/O where both filesystems allow it (direct_io_pays)."""
    h = hashlib.sha256()
    n_total = 0
    fd = dst_path if isinstance(dst_path, int) else os.open(dst_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        fast = None
        if direct:
            fast = _copy_direct(src, fd, h, want, progress, from_peer=from_peer, limit=limit, check=check)
        if fast is None:
            fast = _copy_in_kernel(src, fd, h, want, progress, from_peer=from_peer, limit=limit, check=check)
        n_total = fast if fast is not None else 0
        buf = bytearray(CHUNK if fast is None else 0)
        view = memoryview(buf)
        while fast is None:
            if check:
                check()
            n = src.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            written = 0
            while written < n:
                written += os.write(fd, view[written:n])
            start_writeback(fd, n_total, n)
            n_total += n
            if progress:
                progress.add(n, from_peer)
            limit.take(n)
            if n_total > want["size"]:
                break  # longer than the manifest says: stop reading, fail below
        _datasync(fd)  # durable before the caller renames and journals it
    finally:
        os.close(fd)
    if n_total != want["size"]:
        raise StageError(f"{want['path']}: got {n_total} bytes, manifest says {want['size']}")
    return h.hexdigest()


def direct_io_pays(need: int, meminfo: str = "/proc/meminfo", dirty_ratio: str = "/proc/sys/vm/dirty_ratio") -> bool:
    """Whether a run copying `need` bytes from local files should use direct I/O: when they exceed the
    kernel's dirty limit (dirty_ratio % of the available memory). Below it the page cache takes the
    writes and writes them back behind the copy, which is faster than direct I/O's one request at a time
    per thread (16 cores, 8 GiB in 125 GiB: 0.93x the best by hand through the page cache, 1.29x direct);
    above it every copying thread is throttled and pays reclaim in its own system time (2 cores, 8 GiB in
    24 GiB: 31-33 s through the page cache with 27-28 system CPU-s, 15-17 s direct with 1.6). Measured in
    docs/staging.md; False where the kernel's figures cannot be read."""
    try:
        with open(meminfo, encoding="ascii") as f:
            avail_kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        with open(dirty_ratio, encoding="ascii") as f:
            ratio = int(f.read().strip())
    except (OSError, ValueError, StopIteration, IndexError):
        return False
    return need > avail_kib * 1024 * ratio // 100


def _set_direct(fd: int, on: bool) -> bool:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
    except OSError:  # a filesystem without direct I/O (tmpfs, some network filesystems)
        return False
    return True


def _direct_source(src: BinaryIO, fd: int) -> int | None:
    """The fd of src, a regular local file, with direct I/O set on it and on fd; None (nothing set) where
    either filesystem refuses it."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        sfd = src.fileno()
        regular = stat.S_ISREG(os.fstat(sfd).st_mode)
    except (AttributeError, OSError, ValueError):
        return None
    if not regular or not _set_direct(sfd, True):
        return None
    if not _set_direct(fd, True):
        _set_direct(sfd, False)
        return None
    return sfd


def _copy_direct(
    src: BinaryIO,
    fd: int,
    h: Any,
    want: dict[str, Any],
    progress: Progress | None,
    *,
    from_peer: bool | None,
    limit: RateLimit,
    check: Callable[[], None] | None,
) -> int | None:
    """The copy of a regular local source file with direct I/O on both sides: the disk reads into one
    page-aligned buffer, that buffer is hashed and the same buffer written to the destination (what is
    hashed is what is written), so the bytes never pass through the page cache and the CPU copies
    nothing (a page-cache copy, as copy_file_range and cp do, cost 1.2 system CPU-s per 2 GiB on 2 cores:
    docs/staging.md; used when direct_io_pays). Bytes copied; None, with nothing written, where either
    filesystem refuses direct I/O: the caller copies through the page cache then."""
    sfd = _direct_source(src, fd)
    if sfd is None:
        return None
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as direct I/O needs
    view = memoryview(buf)
    n_total = 0
    try:
        while True:
            if check:
                check()
            try:
                n = os.preadv(sfd, [buf], n_total)
            except OSError as e:
                if n_total == 0 and e.errno == errno.EINVAL:  # the device's alignment is not the page's
                    return None
                raise
            h.update(view[:n])
            whole = -(-n // DIRECT_BLOCK) * DIRECT_BLOCK  # a direct write is whole blocks: the tail padded ...
            written = 0
            while written < whole:
                written += os.pwrite(fd, view[written:whole], n_total + written)
            n_total += n
            if whole != n:
                os.ftruncate(fd, n_total)  # ... and cut back to the file's size
            if n and progress:
                progress.add(n, from_peer)
            limit.take(n)
            if n_total > want["size"] or n < CHUNK:
                return n_total  # the end (a short read), or longer than the manifest says: the caller checks
    finally:
        _set_direct(sfd, False)
        _set_direct(fd, False)
        with contextlib.suppress(BufferError):  # a slice still held by an error's traceback: freed with it
            view.release()
            buf.close()


def _copy_in_kernel(
    src: BinaryIO,
    fd: int,
    h: Any,
    want: dict[str, Any],
    progress: Progress | None,
    *,
    from_peer: bool | None,
    limit: RateLimit,
    check: Callable[[], None] | None,
) -> int | None:
    """The copy of a regular source file: copy_file_range (the kernel copies, no trip through Python's
    buffers), then each chunk is hashed from the destination itself through a read-only mapping of the
    pages just written (still in the page cache): what is hashed is what landed. Bytes copied; None
    when the kernel cannot (another filesystem, an old kernel, a peer's socket): nothing was copied
    then and the caller reads and writes."""
    try:
        sfd = src.fileno()
        regular = stat.S_ISREG(os.fstat(sfd).st_mode) and hasattr(os, "copy_file_range")
    except (AttributeError, OSError, ValueError):
        return None
    if not regular:
        return None
    n_total = 0
    while True:
        if check:
            check()
        try:
            n = os.copy_file_range(sfd, fd, FAST_CHUNK)
        except OSError as e:
            if n_total == 0 and e.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF):
                return None
            raise
        if not n:
            return n_total
        start = n_total - n_total % mmap.ALLOCATIONGRANULARITY  # a short copy leaves an unaligned offset
        mm = mmap.mmap(fd, n_total + n - start, prot=mmap.PROT_READ, offset=start)
        try:
            with memoryview(mm) as v:
                h.update(v[n_total - start :])  # hashlib releases the GIL on large updates
        finally:
            mm.close()
        start_writeback(fd, n_total, n)
        n_total += n
        if progress:
            progress.add(n, from_peer)
        limit.take(n)
        if n_total > want["size"]:
            return n_total  # longer than the manifest says: stop, the caller fails it


class LocalSource:
    """Shared storage (a mounted directory). A file is opened only where the manifest step allows it
    (manifest.open_source_file): a regular file within the source or a directory in allow_links_into,
    re-checked after the open, so a link swapped in after the manifest was built is not followed out."""

    from_peer = False

    def __init__(self, directory: str, allow_links_into: tuple[str, ...] | list[str] = ()) -> None:
        self.directory = directory
        self.bounds = source_bounds(directory, allow_links_into)

    def open(self, rel: str) -> BinaryIO:
        return open(open_source_file(self.directory, rel, self.bounds), "rb", buffering=0)

    def __str__(self) -> str:
        return self.directory


class LocalCopy(LocalSource):
    """An intact file of this node's own published revision (a repair on a filesystem that refuses
    hard links): neither shared storage (no reader lease, not counted as source bytes) nor a peer."""

    from_peer = None


class PeerSource:
    """Another node's verified copy, over HTTP on the fabric network (never trusted: the
    receiver hashes and compares with the manifest). follow=True also takes a copy the peer is
    still writing, as it grows (cut-through: peer.py)."""

    from_peer = True

    def __init__(self, url: str, timeout: float = 30, *, follow: bool = False, key: bytes, me: str) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.follow = follow
        self.key, self.me = key, me  # every request proves the deployment's fabric key as node `me` (peer.py)

    def _get(self, target: str, timeout: float) -> Any:
        proof = fabric_key.sign_request(self.key, self.me, "GET", target)
        req = urllib.request.Request(self.url + target, headers={fabric_key.PEER_HEADER: proof})  # noqa: S310
        return urllib.request.urlopen(req, timeout=timeout)  # noqa: S310

    def open(self, rel: str) -> BinaryIO:
        q = "?follow=1" if self.follow else ""
        return self._get(f"/files/{urllib.request.quote(rel)}{q}", self.timeout)

    def following(self) -> PeerSource:
        return PeerSource(self.url, max(self.timeout, FOLLOW_TIMEOUT_S), follow=True, key=self.key, me=self.me)

    def status(self, seen: str = "", wait: float = 0.0) -> dict[str, Any]:
        """The peer's status; with seen, once it differs from that signature or after wait seconds. The peer
        learns who asks from the request's proof (it then knows that node has seen it done)."""
        q = urllib.parse.urlencode({k: v for k, v in (("seen", seen), ("wait", f"{wait:g}")) if v})
        with self._get(f"/status?{q}", 5 + wait) as r:
            return json.loads(r.read())

    def __str__(self) -> str:
        return f"{self.url} (cut-through)" if self.follow else self.url


def fetch_file(
    source: Any,
    rel: str,
    partial: str,
    want: dict[str, Any],
    journal: Journal,
    *,
    progress: Progress | None = None,
    limit: RateLimit = UNLIMITED,
    check: Callable[[], None] | None = None,
    learn: bool = False,
    direct: bool = False,
) -> None:
    """Copy one file into the partial dir, verify it against the manifest, journal it. Every write goes
    through the partial dir's fd (journal.dir_fd): directories and files created with O_NOFOLLOW, the
    verified file renamed within its directory's fd.

    learn=True builds the manifest from this copy (a first run without one, StageRequest.build_from):
    want has no sha256 yet; the sha256 of what landed becomes want's, provided the source file kept its
    identity, size, mtime and ctime from before its first byte was read to after its last (else
    StageError: the file changed under the copy). The journal then also records that identity, so a
    rerun trusts the entry only while the source file still has it."""
    *subs, name = rel.split("/")
    try:
        dfd = open_subdirs(journal.dir_fd, subs, shown=partial, create=True)
    except safefs.UnsafePathError as e:
        raise StageError(f"{socket.gethostname()}: {e}") from None
    try:
        _fetch_at(
            source, rel, partial, want, journal, dfd=dfd, name=name, progress=progress, limit=limit, check=check,
            learn=learn, direct=direct,
        )  # fmt: skip
    finally:
        if dfd != journal.dir_fd:
            os.close(dfd)


def _fetch_at(
    source: Any,
    rel: str,
    partial: str,
    want: dict[str, Any],
    journal: Journal,
    *,
    dfd: int,
    name: str,
    progress: Progress | None,
    limit: RateLimit,
    check: Callable[[], None] | None,
    learn: bool = False,
    direct: bool = False,
) -> None:
    tmp = name + ".llmfleet-part"
    try:
        got, before, after = _copy_into(
            source, rel, dfd, tmp, want, progress=progress, limit=limit, check=check, direct=direct
        )
    except (OSError, http.client.HTTPException) as e:
        # HTTPException: a peer that closed before the whole file (it died, or the copy it was
        # passing on cut-through failed) is one more source that failed, not the end of the run.
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)  # on ENOSPC this frees the space the failed copy took
        if getattr(e, "errno", None) == errno.ENOSPC:
            raise DiskFullError(
                f"{socket.gethostname()}: disk full while copying {rel} into {partial}: nothing published changed "
                "(published revisions and `current` are as before) and the failed file was removed; free space "
                f"on {os.path.dirname(partial)} and rerun: the files verified so far are kept"
            ) from None
        raise StageError(f"{rel}: cannot copy from {source}: {e}") from None
    except StageError:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    entry = {"path": rel, "size": want["size"], "sha256": got}
    if learn and not want["sha256"]:
        if before is None or before != after:
            os.unlink(tmp, dir_fd=dfd)
            raise StageError(
                f"{rel}: the source file {source}/{rel} changed while it was copied (inode, size, mtime or ctime "
                "differ from before the copy): a revision must not change on shared storage; rerun once nothing "
                "writes to it"
                if before is not None
                else f"{rel}: {source} is not a local file, so no manifest can be built from its copy"
            )
        want["sha256"] = got  # this copy is the manifest's entry from now on (each thread owns its entries)
        entry["source"] = list(after)
    elif got != want["sha256"]:
        os.unlink(tmp, dir_fd=dfd)
        raise StageError(
            f"{rel}: sha256 {got[:12]}… from {source} does not match the manifest ({want['sha256'][:12]}…): "
            "the source copy is damaged or the manifest is from another revision"
        )
    os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    entry["mtime_ns"] = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime_ns
    journal.add(entry)


def source_identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What a rewrite of a source file changes: its inode (replaced), size, mtime and ctime (written to,
    even with the mtime set back: only the kernel sets ctime)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _identity(src: Any) -> tuple[int, int, int, int, int] | None:
    try:
        return source_identity(os.fstat(src.fileno()))
    except (AttributeError, OSError, ValueError):  # a peer's response: no file to take it from
        return None


def _copy_into(
    source: Any,
    rel: str,
    dfd: int,
    tmp: str,
    want: dict[str, Any],
    *,
    progress: Progress | None,
    limit: RateLimit,
    check: Callable[[], None] | None,
    direct: bool = False,
) -> tuple[str, tuple[int, ...] | None, tuple[int, ...] | None]:
    """The sha256 of the copy, and the source file's identity (source_identity) before and after it."""
    with source.open(rel) as src:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)  # a leftover of a killed run: a new file, never one linked elsewhere
        # Read-write: the copy is hashed from its own pages (_copy_in_kernel).
        fd = os.open(tmp, safefs.O_NEW_FILE & ~os.O_WRONLY | os.O_RDWR, 0o644, dir_fd=dfd)
        before = _identity(src)
        got = copy_stream(src, fd, want, progress, from_peer=source.from_peer, limit=limit, check=check, direct=direct)
        return got, before, _identity(src)


def copy_all(
    todo: list[dict[str, Any]],
    partial: str,
    journal: Journal,
    progress: Progress,
    threads: int,
    *,
    sources: Callable[[str], Iterable[Any]],
    on_source_phase: Callable[[], Any] | None,
    limit: RateLimit,
    check: Callable[[], None] | None = None,
    learn: bool = False,
    direct: bool | None = None,
) -> None:
    """Fetch every file of todo (learn: building the manifest from the copies, as fetch_file), trying
    sources(rel) in order (a StageError moves on to the next
    source); on_source_phase() is entered around every read from shared storage, and check() runs
    before each file and chunk read there. A full disk or a lost lease (FATAL) is not retried
    elsewhere: every thread stops and that error is raised. Otherwise raises one StageError joining
    the errors of the files that failed."""
    errors: list[str] = []
    fatal: list[StageError] = []
    stop = threading.Event()
    if direct is None:
        direct = direct_io_pays(sum(e["size"] for e in todo))

    def fetch(src: Any, want: dict[str, Any]) -> None:
        if src.from_peer is False and on_source_phase:
            with on_source_phase():
                if check:
                    check()
                fetch_file(
                    src, want["path"], partial, want, journal, progress=progress, limit=limit, check=check,
                    learn=learn, direct=direct,
                )  # fmt: skip
        else:
            fetch_file(
                src, want["path"], partial, want, journal, progress=progress, limit=limit, learn=learn, direct=direct
            )

    def one(want: dict[str, Any]) -> None:
        if stop.is_set():
            return  # a fatal error elsewhere: start nothing new
        last = None
        for src in sources(want["path"]):
            try:
                fetch(src, want)
                return
            except FATAL:
                stop.set()
                raise
            except StageError as e:
                last = e
        raise last or StageError(f"{want['path']}: no source to copy from")

    # Largest first: the long copies start early and the tail is short.
    with ThreadPoolExecutor(max_workers=max(1, threads)) as ex:
        futs = [ex.submit(one, w) for w in sorted(todo, key=lambda e: -e["size"])]
        for f in futs:
            try:
                f.result()
            except FATAL as e:
                fatal.append(e)
            except StageError as e:
                errors.append(str(e))
    if fatal:
        raise fatal[0]
    if errors:
        raise StageError("; ".join(errors[:5]) + (f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""))
