"""The on-disk revision store of one model on a node: published revisions, the partial dir and
its journal (resume), publish records (idempotence), the `current` link, free space and GC.

Layout under ``<root>/<model>/``::

    <rev>/                    published revision: complete, verified, read-only (0444/0555)
    current -> <rev>          switched atomically (symlink + rename)
    .partial-<rev>/           work in progress; .llmfleet-journal lists files verified so far
    .records/<rev>.json       manifest + size/mtime of every published file (idempotence check)

Nothing here copies (transfer.py) or decides the order of a run (stage.py).
Stdlib only (runs inside an Ansible module on the node and in the CLI).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import threading
import time
from typing import Any

from .checkpoint import verify_structure
from .manifest import HEX40, sha256_file
from .stage_errors import StageError

JOURNAL = ".llmfleet-journal"
GiB = 1024**3


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


def partial_dir(mdir: str, revision: str) -> str:
    return os.path.join(mdir, f".partial-{revision}")


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


def revision_state(mdir: str, revision: str, manifest: dict[str, Any], deep: bool) -> tuple[str, list[dict[str, Any]]]:
    """What the store holds of a revision, and the manifest entries still to copy: ("published",
    []), ("damaged", files that no longer match), ("partial" or "absent", files not yet verified)."""
    rdir = os.path.join(mdir, revision)
    partial = partial_dir(mdir, revision)
    if os.path.isdir(rdir):
        bad = set(published_ok(mdir, revision, manifest, deep))
        todo = [e for e in manifest["files"] if e["path"] in bad or "(no publish record)" in bad]
        return ("published" if not bad else "damaged"), todo
    journal = read_journal(partial)
    todo = [
        e
        for e in manifest["files"]
        if not (e["path"] in journal and _still_valid(os.path.join(partial, e["path"]), journal[e["path"]], e))
    ]
    return ("partial" if os.path.isdir(partial) else "absent"), todo


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


def reopen_published(mdir: str, revision: str, bad: list[str]) -> str:
    """A published revision failed its check: move it back to a partial dir, keep the good files."""
    rdir = os.path.join(mdir, revision)
    partial = partial_dir(mdir, revision)
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


# ---- free space ---------------------------------------------------------------------------------


def disk_check(path: str, need: int, margin: int) -> None:
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < need + margin:
        raise StageError(
            f"{socket.gethostname()}: {path} has {free / GiB:.2f} GiB free, staging needs {need / GiB:.2f} GiB "
            f"(remaining files) + {margin / GiB:.2f} GiB margin: free space (older revisions: lower "
            "model_stage_keep) or stage to a bigger disk (model_stage_root)"
        )


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
