"""Stage a pinned model revision onto node-local NVMe: hashed in the same pass as the copy,
verified against the manifest as each file lands, fsynced, published atomically, resumable,
idempotent, with a fleet-wide cap on shared-storage readers (leases) and peer fan-out.

Layout under ``<root>/<model>/``::

    <rev>/                    published revision: complete, verified, read-only (0444/0555)
    current -> <rev>          switched atomically (symlink + rename)
    .partial-<rev>/           work in progress; .llmfleet-journal lists files verified so far
    .records/<rev>.json       manifest + size/mtime of every published file (idempotence check)

Stdlib only (runs inside an Ansible module on the node and in the CLI).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from . import safefs
from .checkpoint import HEX40, sha256_file, verify_structure

JOURNAL = ".llmfleet-journal"
CHUNK = 16 * 1024 * 1024
GiB = 1024**3


class StageError(RuntimeError):
    """Staging cannot go on; the message names the node, file and what to do."""


class DiskFullError(StageError):
    """ENOSPC while copying: no other source can help, so staging stops at once."""


@dataclass
class Progress:
    """Bytes done / total and rate, written to a JSON file while staging runs."""

    total: int = 0
    done: int = 0
    source_bytes: int = 0
    peer_bytes: int = 0
    phase: str = "starting"
    started: float = field(default_factory=time.time)
    path: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _last_write: float = 0.0

    def add(self, n: int, from_peer: bool) -> None:
        with self._lock:
            self.done += n
            if from_peer:
                self.peer_bytes += n
            else:
                self.source_bytes += n
        self.flush()

    def snapshot(self) -> dict[str, Any]:
        elapsed = max(time.time() - self.started, 1e-6)
        return {
            "phase": self.phase,
            "total_bytes": self.total,
            "done_bytes": self.done,
            "source_bytes_read": self.source_bytes,
            "peer_bytes_read": self.peer_bytes,
            "elapsed_s": round(elapsed, 3),
            "rate_bytes_per_s": int(self.done / elapsed),
            "updated": time.time(),
        }

    def flush(self, force: bool = False) -> None:
        if not self.path or (not force and time.time() - self._last_write < 1.0):
            return
        self._last_write = time.time()
        # Root writes this under /var/lib/llmfleet, which the engine user owns: never through a link
        # planted there (progress is best effort: a refused path only means no progress file).
        with contextlib.suppress(OSError):
            safefs.write_json(self.path, self.snapshot())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def model_dir(root: str, model: str) -> str:
    if not model or "/" in model or model.startswith("."):
        raise StageError(f"model name {model!r}: use a plain directory name (no '/', not hidden)")
    return os.path.join(root, model)


def check_revision(revision: str) -> None:
    if not HEX40.match(revision or ""):
        raise StageError(
            f"revision {revision!r} is not a 40-hex commit id: branch names like 'main' move; "
            "pin the commit (model_stage_revision)"
        )


# ---- journal (resume) ---------------------------------------------------------------------------


def read_journal(partial: str) -> dict[str, dict[str, Any]]:
    """Files verified in a partial dir, keyed by path (last entry wins; torn lines ignored)."""
    out: dict[str, dict[str, Any]] = {}
    with contextlib.suppress(FileNotFoundError):
        with open(os.path.join(partial, JOURNAL), encoding="utf-8") as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    e = json.loads(line)
                    out[e["path"]] = e
    return out


class Journal:
    def __init__(self, partial: str) -> None:
        self._f = open(os.path.join(partial, JOURNAL), "a", encoding="utf-8")
        self._lock = threading.Lock()

    def add(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self._f.write(json.dumps(entry) + "\n")
            self._f.flush()
            os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def _still_valid(path: str, entry: dict[str, Any], want: dict[str, Any]) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return (
        entry.get("sha256") == want["sha256"]
        and st.st_size == want["size"] == entry.get("size")
        and st.st_mtime_ns == entry.get("mtime_ns")
    )


# ---- copying --------------------------------------------------------------------------------------


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
    dst_path: str,
    want: dict[str, Any],
    progress: Progress | None,
    *,
    from_peer: bool,
    limit: RateLimit = UNLIMITED,
) -> str:
    """Copy src to dst_path hashing in the same pass; fsync; return the sha256 hex."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    n_total = 0
    fd = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while True:
            n = src.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            written = 0
            while written < n:
                written += os.write(fd, view[written:n])
            n_total += n
            if progress:
                progress.add(n, from_peer)
            limit.take(n)
            if n_total > want["size"]:
                break  # longer than the manifest says: stop reading, fail below
        os.fsync(fd)
    finally:
        os.close(fd)
    if n_total != want["size"]:
        raise StageError(f"{want['path']}: got {n_total} bytes, manifest says {want['size']}")
    return h.hexdigest()


class LocalSource:
    """Shared storage (a mounted directory)."""

    from_peer = False

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def open(self, rel: str) -> BinaryIO:
        return open(os.path.join(self.directory, rel), "rb", buffering=0)

    def __str__(self) -> str:
        return self.directory


class PeerSource:
    """Another node's verified copy, over HTTP on the fabric network (never trusted: the
    receiver hashes and compares with the manifest)."""

    from_peer = True

    def __init__(self, url: str, timeout: float = 30) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def open(self, rel: str) -> BinaryIO:
        return urllib.request.urlopen(f"{self.url}/files/{urllib.request.quote(rel)}", timeout=self.timeout)  # noqa: S310

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/status", timeout=5) as r:  # noqa: S310
            return json.loads(r.read())

    def __str__(self) -> str:
        return self.url


def fetch_file(
    source: Any,
    rel: str,
    partial: str,
    want: dict[str, Any],
    journal: Journal,
    *,
    progress: Progress | None = None,
    limit: RateLimit = UNLIMITED,
) -> None:
    """Copy one file into the partial dir, verify it against the manifest, journal it."""
    final = os.path.join(partial, rel)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = final + ".llmfleet-part"
    try:
        with source.open(rel) as src:
            got = copy_stream(src, tmp, want, progress, from_peer=source.from_peer, limit=limit)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # on ENOSPC this frees the space the failed copy took
        if e.errno == errno.ENOSPC:
            raise DiskFullError(
                f"{socket.gethostname()}: disk full while copying {rel} into {partial}: the previous revision and "
                "`current` are untouched; free space (or lower model_stage_keep) and rerun: verified files are kept"
            ) from None
        raise StageError(f"{rel}: cannot copy from {source}: {e}") from None
    except StageError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if got != want["sha256"]:
        os.unlink(tmp)
        raise StageError(
            f"{rel}: sha256 {got[:12]}… from {source} does not match the manifest ({want['sha256'][:12]}…): "
            "the source copy is damaged or the manifest is from another revision"
        )
    os.replace(tmp, final)
    journal.add({"path": rel, "size": want["size"], "sha256": got, "mtime_ns": os.stat(final).st_mtime_ns})


# ---- records, publish, current ----------------------------------------------------------------


def record_path(mdir: str, revision: str) -> str:
    return os.path.join(mdir, ".records", f"{revision}.json")


def read_record(mdir: str, revision: str) -> dict[str, Any] | None:
    try:
        with open(record_path(mdir, revision), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def published_ok(mdir: str, revision: str, manifest: dict[str, Any], deep: bool) -> list[str]:
    """Files of a published revision that no longer match (empty list = intact)."""
    rec = read_record(mdir, revision)
    rdir = os.path.join(mdir, revision)
    if rec is None or not os.path.isdir(rdir):
        return ["(no publish record)"]
    bad = []
    recorded = {e["path"]: e for e in rec.get("files", [])}
    for want in manifest["files"]:
        rel = want["path"]
        path = os.path.join(rdir, rel)
        e = recorded.get(rel)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            bad.append(rel)
            continue
        # A sizes-only plan manifest (check mode before any manifest exists) has no sha256 to compare.
        same_hash = not want["sha256"] or (e is not None and e.get("sha256") == want["sha256"])
        same = e is not None and same_hash and e.get("mtime_ns") == st.st_mtime_ns
        if not same or st.st_size != want["size"]:
            bad.append(rel)
        elif deep and sha256_file(path) != want["sha256"]:
            bad.append(rel)
    return bad


def _set_tree_mode(top: str, writable: bool) -> None:
    for d, _dirs, files in os.walk(top):
        for name in files:
            p = os.path.join(d, name)
            os.chmod(p, 0o644 if writable else 0o444)
        os.chmod(d, 0o755 if writable else 0o555)


def publish(mdir: str, partial: str, revision: str, manifest: dict[str, Any]) -> None:
    """Check the structure, freeze, record, rename the partial dir to the revision name."""
    report = verify_structure(partial)
    if not report.ok:
        raise StageError(
            "revision "
            + revision
            + " is not publishable: "
            + "; ".join(str(p) for p in report.problems)
            + " (the source revision itself is incomplete or corrupt: fix it on shared storage)"
        )
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(partial, JOURNAL))
    _set_tree_mode(partial, writable=False)
    files = [
        {
            **{k: e[k] for k in ("path", "size", "sha256")},
            "mtime_ns": os.stat(os.path.join(partial, e["path"])).st_mtime_ns,
        }
        for e in manifest["files"]
    ]
    os.makedirs(os.path.join(mdir, ".records"), exist_ok=True)
    tmp = record_path(mdir, revision) + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"revision": revision, "published_at": time.time(), "manifest": manifest, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, record_path(mdir, revision))
    _fsync_dir(partial)
    os.rename(partial, os.path.join(mdir, revision))  # the atomic publish
    _fsync_dir(mdir)


def current_target(mdir: str) -> str | None:
    try:
        return os.readlink(os.path.join(mdir, "current"))
    except OSError:
        return None


def switch_current(mdir: str, revision: str) -> bool:
    """Point <mdir>/current at revision atomically; True when it changed."""
    if current_target(mdir) == revision:
        return False
    tmp = os.path.join(mdir, f".current-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(revision, tmp)
    os.replace(tmp, os.path.join(mdir, "current"))
    _fsync_dir(mdir)
    return True


# ---- garbage collection -------------------------------------------------------------------------


def paths_in_use(prefix: str, proc: str = "/proc") -> set[str]:
    """Paths under prefix that a running process has open, mapped, as cwd or in its argv."""
    used: set[str] = set()
    prefix = os.path.realpath(prefix) + os.sep
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        base = os.path.join(proc, pid)
        cands: list[str] = []
        with contextlib.suppress(OSError):
            cands.append(os.readlink(os.path.join(base, "cwd")))
        with contextlib.suppress(OSError):
            for fd in os.listdir(os.path.join(base, "fd")):
                with contextlib.suppress(OSError):
                    cands.append(os.readlink(os.path.join(base, "fd", fd)))
        with contextlib.suppress(OSError):
            with open(os.path.join(base, "maps"), encoding="utf-8", errors="replace") as f:
                cands += [ln.split(None, 5)[5].strip() for ln in f if len(ln.split(None, 5)) == 6]
        with contextlib.suppress(OSError):
            with open(os.path.join(base, "cmdline"), "rb") as f:
                cands += [a.decode(errors="replace") for a in f.read().split(b"\0") if a.startswith(b"/")]
        for c in cands:
            rc = os.path.realpath(c) if os.path.exists(c) else c
            if (rc + os.sep).startswith(prefix) or rc.startswith(prefix):
                used.add(rc)
    return used


def gc(mdir: str, keep: int, protect: set[str] = frozenset(), proc: str = "/proc") -> dict[str, list[str]]:
    """Delete published revisions beyond the newest `keep`, never `current`'s or one in use."""
    revs = []
    for name in os.listdir(mdir) if os.path.isdir(mdir) else []:
        if HEX40.match(name) and os.path.isdir(os.path.join(mdir, name)):
            rec = read_record(mdir, name)
            revs.append(((rec or {}).get("published_at", os.stat(os.path.join(mdir, name)).st_mtime), name))
    revs.sort(reverse=True)
    cur = current_target(mdir)
    removed, kept_in_use = [], []
    for i, (_t, name) in enumerate(revs):
        if i < keep or name == cur or name in protect:
            continue
        rdir = os.path.join(mdir, name)
        if paths_in_use(rdir, proc):
            kept_in_use.append(name)
            continue
        _set_tree_mode(rdir, writable=True)
        shutil.rmtree(rdir)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(record_path(mdir, name))
        removed.append(name)
    return {"removed": removed, "kept_in_use": kept_in_use}


# ---- the whole thing on one node ------------------------------------------------------------------


@dataclass
class StageRequest:
    root: str
    model: str
    revision: str
    manifest: dict[str, Any]
    threads: int = 4
    margin_bytes: int = 0
    keep: int = 2
    deep_verify: bool = False
    activate: bool = True
    check_mode: bool = False
    progress_path: str | None = None
    rate_limit_bytes_per_s: int = 0


def plan(req: StageRequest) -> dict[str, Any]:
    """What staging would do: files and bytes still to copy (no side effects)."""
    check_revision(req.revision)
    mdir = model_dir(req.root, req.model)
    rdir = os.path.join(mdir, req.revision)
    partial = os.path.join(mdir, f".partial-{req.revision}")
    total = sum(e["size"] for e in req.manifest["files"])
    if os.path.isdir(rdir):
        bad = set(published_ok(mdir, req.revision, req.manifest, req.deep_verify))
        todo = [e for e in req.manifest["files"] if e["path"] in bad or "(no publish record)" in bad]
        return {"state": "published" if not bad else "damaged", "todo": todo, "total_bytes": total}
    journal = read_journal(partial)
    todo = [
        e
        for e in req.manifest["files"]
        if not (e["path"] in journal and _still_valid(os.path.join(partial, e["path"]), journal[e["path"]], e))
    ]
    return {"state": "partial" if os.path.isdir(partial) else "absent", "todo": todo, "total_bytes": total}


def _reopen_published(mdir: str, revision: str, bad: list[str]) -> str:
    """A published revision failed its check: move it back to a partial dir, keep the good files."""
    rdir = os.path.join(mdir, revision)
    partial = os.path.join(mdir, f".partial-{revision}")
    rec = read_record(mdir, revision) or {"files": []}
    _set_tree_mode(rdir, writable=True)
    if current_target(mdir) == revision:
        os.unlink(os.path.join(mdir, "current"))  # never point at a revision under repair
    os.rename(rdir, partial)
    j = Journal(partial)
    for e in rec["files"]:
        if e["path"] not in bad:
            j.add(e)
    j.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(record_path(mdir, revision))
    return partial


def disk_check(path: str, need: int, margin: int) -> None:
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < need + margin:
        raise StageError(
            f"{socket.gethostname()}: {path} has {free / GiB:.2f} GiB free, staging needs {need / GiB:.2f} GiB "
            f"(remaining files) + {margin / GiB:.2f} GiB margin: free space (older revisions: lower "
            "model_stage_keep) or stage to a bigger disk (model_stage_root)"
        )


def stage(
    req: StageRequest, sources: Callable[[str], list[Any]], on_source_phase: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """Stage one revision on this node.

    ``sources(rel)`` returns the ordered sources to try for a file (peers first, shared storage
    last). ``on_source_phase()`` is a context manager entered around every read from shared
    storage (the caller holds a fleet-wide reader lease there). Returns a result dict.
    """
    check_revision(req.revision)
    mdir = model_dir(req.root, req.model)
    p = plan(req)
    result: dict[str, Any] = {
        "changed": False,
        "revision": req.revision,
        "path": os.path.join(mdir, req.revision),
        "total_bytes": p["total_bytes"],
        "bytes_to_copy": sum(e["size"] for e in p["todo"]),
        "files_to_copy": len(p["todo"]),
        "bytes_copied": 0,
        "source_bytes_read": 0,
        "peer_bytes_read": 0,
        "state_before": p["state"],
    }
    if req.check_mode:
        result["changed"] = bool(p["todo"]) or (req.activate and current_target(mdir) != req.revision)
        return result
    os.makedirs(mdir, exist_ok=True)
    if p["state"] == "published" and not p["todo"]:
        if req.activate:
            result["changed"] = switch_current(mdir, req.revision)
        result["gc"] = gc(mdir, req.keep)
        return result
    if p["state"] == "damaged":
        partial = _reopen_published(mdir, req.revision, [e["path"] for e in p["todo"]])
    else:
        partial = os.path.join(mdir, f".partial-{req.revision}")
        os.makedirs(partial, exist_ok=True)
    disk_check(mdir, result["bytes_to_copy"], req.margin_bytes)
    progress = Progress(total=result["bytes_to_copy"], path=req.progress_path, phase="copying")
    progress.flush(force=True)
    journal = Journal(partial)
    try:
        _copy_all(
            p["todo"],
            partial,
            journal,
            progress,
            req.threads,
            sources=sources,
            on_source_phase=on_source_phase,
            limit=RateLimit(req.rate_limit_bytes_per_s),
        )
    finally:
        journal.close()
        progress.phase = "verifying"
        progress.flush(force=True)
    publish(mdir, partial, req.revision, req.manifest)
    result.update(
        changed=True,
        bytes_copied=progress.done,
        source_bytes_read=progress.source_bytes,
        peer_bytes_read=progress.peer_bytes,
    )
    if req.activate:
        switch_current(mdir, req.revision)
    result["gc"] = gc(mdir, req.keep)
    progress.phase = "published"
    progress.flush(force=True)
    return result


def _copy_all(todo, partial, journal, progress, threads, *, sources, on_source_phase, limit) -> None:
    errors: list[str] = []

    def one(want: dict[str, Any]) -> None:
        last = None
        for src in sources(want["path"]):
            try:
                if not src.from_peer and on_source_phase:
                    with on_source_phase():
                        fetch_file(src, want["path"], partial, want, journal, progress=progress, limit=limit)
                else:
                    fetch_file(src, want["path"], partial, want, journal, progress=progress, limit=limit)
                return
            except DiskFullError:
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
            except StageError as e:
                errors.append(str(e))
    if errors:
        raise StageError("; ".join(errors[:5]) + (f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""))


def resolve_source(source: str, revision: str) -> str:
    """The directory holding the revision's files: a plain checkpoint dir, a hub-cache repo dir
    (``models--org--name`` → ``snapshots/<revision>``), or a snapshot dir whose name must match."""
    check_revision(revision)
    src = os.path.normpath(source)
    base = os.path.basename(src)
    if base.startswith("models--"):
        snap = os.path.join(src, "snapshots", revision)
        if not os.path.isdir(snap):
            have = (
                sorted(os.listdir(os.path.join(src, "snapshots")))
                if os.path.isdir(os.path.join(src, "snapshots"))
                else []
            )
            raise StageError(
                f"{src} has no snapshot {revision} (snapshots: {', '.join(have) or 'none'}): download that revision"
            )
        return snap
    if os.path.basename(os.path.dirname(src)) == "snapshots" and HEX40.match(base) and base != revision:
        raise StageError(f"{src} is snapshot {base}, not the requested revision {revision}")
    if not os.path.isdir(src):
        raise StageError(f"source {src} is not a directory on this node (is the shared storage mounted?)")
    return src


def assign_files(files: list[dict[str, Any]], seeds: list[str]) -> dict[str, str]:
    """Split the revision's files over the seed nodes by bytes (largest first to the least
    loaded), so shared storage serves each byte once and the seeds share the reading."""
    if not seeds:
        return {}
    load = {s: 0 for s in seeds}
    out = {}
    for e in sorted(files, key=lambda e: (-e["size"], e["path"])):
        s = min(seeds, key=lambda s: (load[s], seeds.index(s)))
        out[e["path"]] = s
        load[s] += e["size"]
    return out


SHIPPED_MANIFEST = ".llmfleet-manifest.json"


def manifest_cache_path(cache_dir: str, model: str, revision: str) -> str:
    return os.path.join(cache_dir, "manifests", model, f"{revision}.json")


def sizes_match(src: str, manifest: dict[str, Any]) -> list[str]:
    """Files whose size on the source differs from the manifest (a revision must be immutable)."""
    bad = []
    for e in manifest["files"]:
        try:
            if os.path.getsize(os.path.join(src, e["path"])) != e["size"]:
                bad.append(e["path"])
        except OSError:
            bad.append(e["path"])
    return bad


def obtain_manifest(
    src: str,
    model: str,
    revision: str,
    cache_dir: str,
    *,
    build: Callable[[], dict[str, Any]],
    check_mode: bool = False,
) -> dict[str, Any]:
    """The revision's manifest: from the cache next to the source, shipped with the source, or
    built (``build()`` reads every file once; the caller holds a reader lease). Cached atomically."""
    from .checkpoint import load_manifest

    cache = manifest_cache_path(cache_dir, model, revision)
    found = [
        (o, p) for o, p in (("cache", cache), ("shipped", os.path.join(src, SHIPPED_MANIFEST))) if os.path.isfile(p)
    ]
    if found:
        origin, path = found[0]
        try:
            manifest = load_manifest(path)
        except (OSError, ValueError) as e:
            raise StageError(f"{path}: {e}; delete it so the manifest is rebuilt") from None
    elif check_mode:
        return {"origin": "would build", "path": cache, "manifest": None}
    else:
        origin, manifest = "built", build()
    if manifest.get("revision") not in (None, revision):
        raise StageError(f"manifest {cache} is for revision {manifest.get('revision')}, not {revision}")
    manifest["revision"] = revision
    changed_files = sizes_match(src, manifest)
    if changed_files:
        raise StageError(
            f"source {src} no longer matches the manifest of {revision} ({', '.join(changed_files[:5])}): a pinned "
            "revision must not change on shared storage; restore it or delete the cached manifest "
            f"{cache} if the change is intended"
        )
    if origin != "cache" and not check_mode:
        # Shared storage that every node (or, squashed, every user) may write: never through a planted link.
        try:
            safefs.write_json(cache, manifest, create_dirs=True)
        except safefs.UnsafePathError as e:
            raise StageError(f"cannot cache the manifest: {e}") from None
    return {"origin": origin, "path": cache, "manifest": manifest}


def stat_manifest(src: str) -> dict[str, Any]:
    """Sizes only (no hashing): what check mode uses to predict bytes before a manifest exists."""
    from .checkpoint import list_files

    files = [{"path": p, "size": os.path.getsize(os.path.join(src, p)), "sha256": ""} for p in list_files(src)]
    return {"files": files, "total_bytes": sum(e["size"] for e in files), "revision": None}
