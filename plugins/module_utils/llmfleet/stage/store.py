"""The on-disk revision store of one model on a node: published revisions, the partial dir and
its journal (resume), publish records (idempotence), the `current` link, repair, free space, the
per-model lock and GC.

Layout under ``<root>/<model>/``::

    <rev>/                    published revision: complete, verified, read-only (0444/0555)
    current -> <rev>          switched atomically (symlink + rename)
    .partial-<rev>/           work in progress (a new copy or a repair); .llmfleet-journal lists
                              the files verified so far
    .records/<rev>.json       manifest + size/mtime of every published file (idempotence check)
    .stage.lock               only while a staging run holds the model (flock; who, since when)

Trust: root writes here, so the model root and the model dir must be root's alone (owned by root, or
by the account running the CLI, and not writable by group or others; a sticky model root, e.g. a 1777
scratch disk, is fine, as nobody else can then rename the model dir). open_model_dir checks that before
anything is written and refuses otherwise, naming the fix. Every write then goes through directory fds
opened from that checked model dir (O_NOFOLLOW, openat, renameat, fchmod), so neither a link planted
before the check nor a path component renamed after it can redirect a write, a chmod or a deletion.

Nothing here copies from a source (transfer.py) or decides the order of a run (stage.py).
Stdlib only (runs inside an Ansible module on the node and in the CLI).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

from .. import safefs
from ..facts import HEX40, HEX40_IN_TEXT
from .checkpoint import verify_structure
from .errors import DiskFullError, LockedError, StageError
from .manifest import sha256_file

JOURNAL = ".llmfleet-journal"
LOCK = ".stage.lock"
PARTIAL = ".partial-"
OLD = ".repair-old-"  # a damaged revision swapped out by a repair, removed right after
NO_RECORD = "(no publish record)"
# Where the engine role installs its units; a unit names the revision directory it serves.
UNIT_GLOB = "/etc/systemd/system/llmfleet-*.service"
GiB = 1024**3
FILE_RO, DIR_RO, DIR_RW = 0o444, 0o555, 0o755  # a published revision is read-only for everyone


O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never a link, never blocks on a FIFO


def _owner_ok(st: os.stat_result) -> bool:
    return st.st_uid in (0, os.geteuid())


def _untrusted(what: str, path: str, st: os.stat_result, fix: str) -> StageError:
    return StageError(
        f"{socket.gethostname()}: {what} {path} is owned by {safefs._who(st)} with mode "
        f"{stat.S_IMODE(st.st_mode):04o}: another account can plant links there that root would write through "
        f"(the staged model, chmods, deletions). Nothing was written. {fix}"
    )


def open_model_dir(mdir: str, *, create: bool = True) -> int | None:
    """fd of the model directory, checked before anything is written: the model root (created 0755 if
    missing, when ``create``) is reached without following a link another user could plant
    (safefs.open_dir), is owned by root (or the account running this) and is not writable by group or
    others unless sticky; the model dir itself is not a link, is owned by root (or that account) and
    writable by nobody else. Else StageError naming the fix. None when it does not exist and not
    ``create``. The caller closes the fd."""
    root, model = os.path.split(os.path.abspath(mdir))
    try:
        rfd = safefs.open_dir(root, create_mode=0o755 if create else None)
    except FileNotFoundError:
        return None
    except safefs.UnsafePathError as e:
        raise StageError(f"{socket.gethostname()}: model root {root}: {e}") from None
    try:
        st = os.fstat(rfd)
        if not _owner_ok(st) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            raise _untrusted(
                "the model root (llmfleet_model_root)",
                root,
                st,
                f"Fix: `chown root:root {root} && chmod 0755 {root}` (or make it sticky, chmod 1777, if other "
                "accounts must write there), or set llmfleet_model_root to a directory only root can write.",
            )
        try:
            fd, _ = safefs.subdir(rfd, model, shown=mdir, mode=DIR_RW, create=create)
        except FileNotFoundError:
            return None
        except safefs.UnsafePathError as e:
            raise StageError(f"{socket.gethostname()}: model dir {mdir}: {e}") from None
        st = os.fstat(fd)
        if not _owner_ok(st) or st.st_mode & 0o022:
            os.close(fd)
            raise _untrusted(
                "the model dir",
                mdir,
                st,
                f"Its contents cannot be trusted (a planted .partial-<rev> or journal): move {mdir} aside and "
                "rerun (staging creates it root-owned, 0755), or, if only root ever wrote there, "
                f"`chown root:root {mdir} && chmod 0755 {mdir}`.",
            )
        return fd
    finally:
        os.close(rfd)


def ensure_model_dir(mdir: str) -> None:
    """Create (or check) the model dir as open_model_dir does; StageError when it is not safe."""
    fd = open_model_dir(mdir)
    if fd is not None:
        os.close(fd)


@contextlib.contextmanager
def model_fd(mdir: str, *, create: bool = False) -> Iterator[int]:
    """open_model_dir as a context; FileNotFoundError when it is missing and not ``create``."""
    fd = open_model_dir(mdir, create=create)
    if fd is None:
        raise FileNotFoundError(errno.ENOENT, "No such model directory", mdir)
    try:
        yield fd
    finally:
        os.close(fd)


def open_subdirs(base_fd: int, names: list[str], *, shown: str, create: bool, mode: int = DIR_RW) -> int:
    """fd of base_fd/<names...>, each level opened O_NOFOLLOW (a link there is refused); base_fd itself
    when names is empty. The caller closes a returned fd other than base_fd."""
    fd = base_fd
    try:
        for name in names:
            shown = f"{shown}/{name}"
            nfd, _ = safefs.subdir(fd, name, shown=shown, mode=mode, create=create)
            if fd != base_fd:
                os.close(fd)
            fd = nfd
    except BaseException:
        if fd != base_fd:
            os.close(fd)
        raise
    return fd


def _open_store_dir(path: str, *, create: bool = False) -> int:
    """fd of <mdir>/<name> (a partial dir or a revision), reached from the checked model dir."""
    mdir, name = os.path.split(os.path.abspath(path))
    with model_fd(mdir, create=create) as mfd:
        fd, _ = safefs.subdir(mfd, name, shown=path, mode=DIR_RW, create=create)
        return fd


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def model_dir(root: str, model: str) -> str:
    if not model or "/" in model or model.startswith("."):
        raise StageError(f"model name {model!r}: use a plain directory name (no '/', not hidden)")
    return os.path.join(root, model)


def partial_dir(mdir: str, revision: str) -> str:
    return os.path.join(mdir, f"{PARTIAL}{revision}")


# ---- journal (resume) ---------------------------------------------------------------------------


def read_journal(partial: str) -> dict[str, dict[str, Any]]:
    """Files verified in a partial dir, keyed by path (last entry wins; torn lines ignored)."""
    out: dict[str, dict[str, Any]] = {}
    with contextlib.suppress(FileNotFoundError, NotADirectoryError, OSError):
        with open(os.open(os.path.join(partial, JOURNAL), O_FILE), encoding="utf-8") as f:
            for line in f:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    e = json.loads(line)
                    out[e["path"]] = e
    return out


class Journal:
    """The partial dir's journal, appended through the partial dir's fd (``dir_fd``, which the copy
    writes through too); the fd is opened from the checked model dir unless given (and then owned)."""

    def __init__(self, partial: str, dir_fd: int | None = None) -> None:
        self.partial = partial
        self.dir_fd = _open_store_dir(partial) if dir_fd is None else dir_fd
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            self._f = open(os.open(JOURNAL, flags, 0o644, dir_fd=self.dir_fd), "a", encoding="utf-8")
        except BaseException:
            os.close(self.dir_fd)
            raise
        self._lock = threading.Lock()

    def add(self, entry: dict[str, Any]) -> None:
        with self._lock:
            try:
                self._f.write(json.dumps(entry) + "\n")
                self._f.flush()
                os.fsync(self._f.fileno())
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                raise DiskFullError(
                    f"{socket.gethostname()}: disk full while journaling {entry['path']} in {self.partial}: "
                    "nothing published changed (published revisions and `current` are as before); free space "
                    "and rerun: the files verified before this one are kept"
                ) from None

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a torn last line is ignored when read back
            self._f.close()
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1


def _still_valid(path: str, entry: dict[str, Any], want: dict[str, Any]) -> bool:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
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
        with open(os.open(record_path(mdir, revision), O_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def published_ok(mdir: str, revision: str, manifest: dict[str, Any], deep: bool) -> list[str]:
    """Files of a published revision that no longer match (empty list = intact)."""
    rec = read_record(mdir, revision)
    rdir = os.path.join(mdir, revision)
    if rec is None or not os.path.isdir(rdir):
        return [NO_RECORD]
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
    """What the store holds of a revision, and the manifest entries still to fetch: ("published",
    []), ("damaged", files that no longer match and are not yet repaired in the partial dir),
    ("partial" or "absent", files not yet verified)."""
    rdir = os.path.join(mdir, revision)
    partial = partial_dir(mdir, revision)
    journal = read_journal(partial)

    def verified(e: dict[str, Any]) -> bool:
        return e["path"] in journal and _still_valid(os.path.join(partial, e["path"]), journal[e["path"]], e)

    if os.path.isdir(rdir):
        bad = set(published_ok(mdir, revision, manifest, deep))
        if not bad:
            return "published", []
        todo = [e for e in manifest["files"] if (e["path"] in bad or NO_RECORD in bad) and not verified(e)]
        return "damaged", todo
    todo = [e for e in manifest["files"] if not verified(e)]
    return ("partial" if os.path.isdir(partial) else "absent"), todo


def open_repair(
    mdir: str, revision: str, manifest: dict[str, Any], refetch: list[dict[str, Any]]
) -> tuple[str, list[dict[str, Any]]]:
    """Start (or resume) the repair of a published revision in a NEW partial dir: every intact file
    is hard-linked from the published revision and journaled; the files in `refetch` are left for
    the caller to fetch. The published revision and `current` are not touched: they stay as they
    are until the repaired copy is verified and swapped in (publish). Returns the partial dir and
    the intact files that could not be hard-linked (the caller copies those from the published
    revision)."""
    rdir = os.path.join(mdir, revision)
    partial = make_partial(mdir, revision)
    journal = read_journal(partial)
    skip = {e["path"] for e in refetch}
    unlinkable = []
    j = Journal(partial)
    rfd = _open_store_dir(rdir)
    try:
        for e in manifest["files"]:
            rel = e["path"]
            dst = os.path.join(partial, rel)
            if rel in skip or (rel in journal and _still_valid(dst, journal[rel], e)):
                continue
            *subs, name = rel.split("/")
            try:
                sfd = open_subdirs(rfd, subs, shown=rdir, create=False)
            except FileNotFoundError:
                unlinkable.append(e)
                continue
            dfd = open_subdirs(j.dir_fd, subs, shown=partial, create=True)
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dfd)
                try:
                    os.link(name, name, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
                except OSError:  # a filesystem without hard links: the caller copies it
                    unlinkable.append(e)
                    continue
                mtime_ns = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime_ns
            finally:
                for fd in {sfd, dfd} - {rfd, j.dir_fd}:
                    os.close(fd)
            j.add({"path": rel, "size": e["size"], "sha256": e["sha256"], "mtime_ns": mtime_ns})
    finally:
        os.close(rfd)
        j.close()
    return partial, unlinkable


def make_partial(mdir: str, revision: str) -> str:
    """Create (or keep) the revision's partial dir, through the checked model dir's fd."""
    partial = partial_dir(mdir, revision)
    os.close(_open_store_dir(partial, create=True))
    return partial


def _freeze(top_fd: int, shown: str) -> None:
    """Files 0444 and directories 0555 below the open dir top_fd; top itself stays writable (the journal
    is removed from it after the rename, so a failure before that keeps the resume). fchmod on fds
    opened O_NOFOLLOW: a link in the tree is refused, never its target chmodded."""
    with os.scandir(top_fd) as it:
        names = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    for name, is_dir in names:
        if is_dir:
            fd, _ = safefs.subdir(top_fd, name, shown=f"{shown}/{name}", create=False)
            try:
                _freeze(fd, f"{shown}/{name}")
                os.fchmod(fd, DIR_RO)
            finally:
                os.close(fd)
            continue
        try:
            fd = os.open(name, O_FILE, dir_fd=top_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                msg = f"{shown}/{name} is a link: a staged revision holds files only; nothing was published"
                raise StageError(msg) from None
            raise
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.fchmod(fd, FILE_RO)
        finally:
            os.close(fd)


def _remove_tree(dir_fd: int, name: str) -> None:
    """Delete dir_fd/name with everything below it, never through a link. Only directories are made writable
    (unlinking needs that): a file may be a hard link shared with the published copy of a repaired revision and
    stays 0444."""
    safefs.rmtree_at(dir_fd, name, dir_mode=DIR_RW)


def _exchange(dir_fd: int, a: str, b: str) -> bool:
    """Swap two paths in one step: renameat2(RENAME_EXCHANGE) (Linux >= 3.15, glibc >= 2.28; ext4,
    xfs, btrfs, tmpfs). False where that is not available, so the caller falls back to two renames."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (ImportError, OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rename_exchange = 2
    if fn(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def _swap_in(mfd: int, revision: str) -> None:
    """Replace the published (damaged) revision by its verified repair (names in the model dir mfd).
    With RENAME_EXCHANGE the revision path always exists; the fallback leaves it missing between two
    renames (microseconds; a crash there leaves the verified partial, which the next run publishes
    without copying)."""
    old, partial = f"{OLD}{revision}", f"{PARTIAL}{revision}"

    def mv(a: str, b: str) -> None:
        os.rename(a, b, src_dir_fd=mfd, dst_dir_fd=mfd)

    _remove_tree(mfd, old)
    if _exchange(mfd, partial, revision):
        mv(partial, old)  # the damaged copy, out of the partial name a rerun would resume from
    else:
        mv(revision, old)
        try:
            mv(partial, revision)
        except OSError:
            mv(old, revision)  # put the published revision back as it was
            raise
    os.fsync(mfd)
    # Engines that still map a file of the damaged copy keep that inode until they exit.
    _remove_tree(mfd, old)


def finish_published(rdir: str) -> None:
    """The last step of a publish: drop the journal and freeze the revision's top directory. Also
    run on a published revision, for the case of a crash between the rename and this."""
    fd = _open_store_dir(rdir)
    try:
        if safefs.lstat_at(fd, JOURNAL) is not None:
            os.fchmod(fd, DIR_RW)
            os.unlink(JOURNAL, dir_fd=fd)
        if os.fstat(fd).st_mode & 0o777 != DIR_RO:
            os.fchmod(fd, DIR_RO)
            os.fsync(fd)
    finally:
        os.close(fd)


def publish(mdir: str, partial: str, revision: str, manifest: dict[str, Any]) -> None:
    """Check the structure, record, freeze and rename the partial dir to the revision name (or swap
    it with the damaged published copy it repairs). Any failure before the rename leaves the partial
    dir and its journal as they were: a rerun copies nothing again."""
    report = verify_structure(partial)
    if not report.ok:
        raise StageError(
            "revision "
            + revision
            + " is not publishable: "
            + "; ".join(str(p) for p in report.problems)
            + " (the source revision itself is incomplete or corrupt: fix it on shared storage)"
        )
    files = [
        {
            **{k: e[k] for k in ("path", "size", "sha256")},
            "mtime_ns": os.stat(os.path.join(partial, e["path"])).st_mtime_ns,
        }
        for e in manifest["files"]
    ]
    rdir = os.path.join(mdir, revision)
    rec = record_path(mdir, revision)
    name = os.path.basename(rec)
    tmp = name + ".tmp"
    # A repair keeps the revision's publish time: GC's "newest" order must not change because of it.
    published_at = (read_record(mdir, revision) or {}).get("published_at") if os.path.isdir(rdir) else None
    record = {"revision": revision, "published_at": published_at or time.time(), "manifest": manifest, "files": files}
    pname = f"{PARTIAL}{revision}"
    with model_fd(mdir) as mfd:
        recs, _ = safefs.subdir(mfd, ".records", shown=os.path.dirname(rec), mode=DIR_RW)
        try:
            _write_record(recs, tmp, record, rec, partial)
            pfd, _ = safefs.subdir(mfd, pname, shown=partial, create=False)
            try:
                _freeze(pfd, partial)
                os.replace(tmp, name, src_dir_fd=recs, dst_dir_fd=recs)
                os.fsync(recs)
                os.fsync(pfd)
            finally:
                os.close(pfd)
        finally:
            os.close(recs)
        have = safefs.lstat_at(mfd, revision)
        if have is not None and stat.S_ISDIR(have.st_mode):
            _swap_in(mfd, revision)
        else:
            os.rename(pname, revision, src_dir_fd=mfd, dst_dir_fd=mfd)  # the atomic publish
            os.fsync(mfd)
    finish_published(rdir)


def _write_record(recs: int, tmp: str, record: dict[str, Any], rec: str, partial: str) -> None:
    """The publish record, written to tmp in the .records fd and fsynced (renamed by the caller)."""
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=recs)
        with open(os.open(tmp, safefs.O_NEW_FILE, 0o644, dir_fd=recs), "w", encoding="utf-8") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=recs)
        where = f"{socket.gethostname()}: writing the publish record {rec}"
        kept = (
            f"all {len(record['files'])} files of {record['revision']} are verified and kept in {partial} with "
            "their journal, nothing published changed (published revisions and `current` are as before)"
        )
        if e.errno == errno.ENOSPC:
            raise DiskFullError(f"{where}: disk full; {kept}: free space and rerun (it copies nothing again)") from None
        raise StageError(f"{where}: {e.strerror or e}; {kept}: fix that and rerun") from None


def current_target(mdir: str) -> str | None:
    try:
        return os.readlink(os.path.join(mdir, "current"))
    except OSError:
        return None


def switch_current(mdir: str, revision: str) -> bool:
    """Point <mdir>/current at revision atomically; True when it changed."""
    if current_target(mdir) == revision:
        return False
    tmp = f".current-{os.getpid()}"
    with model_fd(mdir) as mfd:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=mfd)
        os.symlink(revision, tmp, dir_fd=mfd)
        os.replace(tmp, "current", src_dir_fd=mfd, dst_dir_fd=mfd)
        os.fsync(mfd)
    return True


# ---- free space ---------------------------------------------------------------------------------


def _tree_bytes(top: str, seen: set[tuple[int, int]]) -> int:
    """Disk space a tree takes (allocated blocks), each inode counted once across calls sharing
    `seen` (a repair's partial dir hard-links the published revision's intact files)."""
    n = 0
    for d, _dirs, files in os.walk(top):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(d, name))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    n += st.st_blocks * 512
    return n


def space_hint(mdir: str, revision: str = "") -> str:
    """What the model directory holds, and what frees space: true whatever the caller was doing
    (GC runs only after a publish, so lowering model_stage_keep frees nothing before one)."""
    cur = current_target(mdir)
    revs, partials = _scan(mdir) if os.path.isdir(mdir) else ([], [])
    seen: set[tuple[int, int]] = set()
    held = []
    for name in revs:
        size = _gib(_tree_bytes(os.path.join(mdir, name), seen))
        held.append(f"{name[:12]} ({size}{', current' if name == cur else ''})")
    for name in partials:
        size = _gib(_tree_bytes(os.path.join(mdir, name), seen))
        mine = name == f"{PARTIAL}{revision}"
        held.append(f"{name[:21]} ({size} more, {'this run' if mine else 'unpublished'})")
    here = f"{mdir} holds {', '.join(held)}; " if held else ""
    return (
        f"{here}free space (old revisions are removed by GC only after a successful publish: remove ones no "
        "engine uses by hand) or stage to a bigger disk (llmfleet_model_root)"
    )


def disk_check(mdir: str, need: int, margin: int, why: str, revision: str = "") -> None:
    """Refuse before copying when the numbers say it cannot fit. `why` says what the `need` bytes
    are (e.g. "3 file(s) of <rev> still missing")."""
    st = os.statvfs(mdir)
    free = st.f_bavail * st.f_frsize
    if free < need + margin:
        hint = space_hint(mdir, revision)
        raise StageError(
            f"{socket.gethostname()}: {mdir} has {_gib(free)} free, staging needs {_gib(need)} ({why}) + "
            f"{_gib(margin)} margin (model_stage_free_space_margin_gb). Nothing was copied; {hint}"
        )


# ---- the per-model lock -------------------------------------------------------------------------


def _user() -> str:
    for var in ("SUDO_USER", "LOGNAME", "USER"):
        if os.environ.get(var):
            return os.environ[var]
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return str(os.getuid())


def describe_holder(info: dict[str, Any] | None) -> str:
    if not info:
        return "a process whose lock record is not written yet"
    started = float(info.get("started", 0))
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started))
    ago = max(0, int(time.time() - started))
    who = info.get("run_by") or info.get("user", "?")
    return (
        f"pid {info.get('pid', '?')} on {info.get('host', '?')}, started {when} ({ago // 60} min {ago % 60} s ago) "
        f"by {who}, staging revision {str(info.get('revision', '?'))[:12]}"
    )


class ModelLock:
    """One staging run per model directory at a time (flock on <mdir>/.stage.lock, which records
    host, pid, start time, who and the revision). The kernel drops the flock when the holder dies
    (SIGKILL, reboot), so a stale file never blocks; the file is removed on release."""

    def __init__(self, mdir: str, revision: str = "", run_by: str = "") -> None:
        self.mdir = mdir
        self.path = os.path.join(mdir, LOCK)
        self.revision = revision
        self.run_by = run_by
        self.fd: int | None = None

    def try_acquire(self) -> bool:
        with model_fd(self.mdir, create=True) as mfd:
            return self._try_acquire_at(mfd)

    def _try_acquire_at(self, mfd: int) -> bool:
        while True:
            fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644, dir_fd=mfd)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise StageError(f"{self.path} is not a regular file: remove it and rerun")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            # A releaser unlinks the file while holding it: the one we locked must still be the one there.
            st = safefs.lstat_at(mfd, LOCK)
            if st is None:
                os.close(fd)
                continue
            mine = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
                os.close(fd)
                continue
            info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "user": _user(),
                    "run_by": self.run_by, "revision": self.revision}  # fmt: skip
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
            os.fsync(fd)
            self.fd = fd
            return True

    def holder(self) -> dict[str, Any] | None:
        try:
            with open(os.open(self.path, O_FILE), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def acquire(self, wait: float = 0.0, poll: float = 1.0) -> None:
        """Take the lock, waiting at most `wait` seconds; else LockedError naming the holder."""
        deadline = time.monotonic() + max(0.0, wait)
        while not self.try_acquire():
            if time.monotonic() >= deadline:
                waited = f" (waited {wait:g} s)" if wait > 0 else ""
                info = self.holder()
                pid, host = (info or {}).get("pid", "?"), (info or {}).get("host", "?")
                raise LockedError(
                    f"{socket.gethostname()}: another staging run of {os.path.basename(self.mdir)} is in progress"
                    f"{waited}: {describe_holder(info)} (lock {self.path}). It keeps its verified files as it goes. "
                    "Wait for it to finish (model_stage_lock_wait: seconds a run waits for the lock), or stop it "
                    f"(kill {pid} on {host}) and rerun: the rerun resumes from the files it verified"
                )
            time.sleep(min(poll, max(0.01, deadline - time.monotonic())))

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError, StageError):
            with model_fd(self.mdir) as mfd:
                os.unlink(LOCK, dir_fd=mfd)  # while still holding it (see try_acquire)
        os.close(self.fd)
        self.fd = None

    @contextlib.contextmanager
    def held(self, wait: float = 0.0) -> Iterator[ModelLock]:
        self.acquire(wait)
        try:
            yield self
        finally:
            self.release()


# ---- garbage collection -------------------------------------------------------------------------


def paths_in_use(prefix: str, proc: str = "/proc") -> set[str]:
    """Paths under prefix that a running process has open, mapped, as cwd or in its argv."""
    used: set[str] = set()
    prefix = os.path.realpath(prefix) + os.sep
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        for c in _proc_paths(os.path.join(proc, pid)):
            rc = os.path.realpath(c) if os.path.exists(c) else c
            if (rc + os.sep).startswith(prefix) or rc.startswith(prefix):
                used.add(rc)
    return used


def _proc_paths(base: str) -> list[str]:
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
    return cands


def _dir_names(mdir: str) -> list[str]:
    """The model directory as a unit or a process may spell it (as given, and resolved)."""
    return sorted({mdir.rstrip("/"), os.path.realpath(mdir)})


def revisions_named(text: str, mdir: str) -> set[str]:
    """Revision ids that text names as `<mdir>/<40-hex>` (an engine unit's ExecStart/Environment=,
    a process's argv or environment)."""
    out = set()
    for name in _dir_names(mdir):
        out.update(m.group(1) for m in re.finditer(re.escape(name) + "/(" + HEX40_IN_TEXT + ")", text))
    return out


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def revisions_in_units(mdir: str, unit_glob: str = UNIT_GLOB) -> tuple[dict[str, str], list[str]]:
    """Revisions named by installed engine units: revision -> unit file. A unit counts with its
    drop-ins (<unit>.d/*.conf) and the EnvironmentFile= files it loads. Also the units that could
    not be read (GC then deletes no revision: it cannot know which one they name)."""
    named: dict[str, str] = {}
    unreadable = []
    for unit in sorted(glob.glob(unit_glob)) if unit_glob else []:
        try:
            text = _read_text(unit)
            for drop_in in sorted(glob.glob(glob.escape(unit) + ".d/*.conf")):
                text += "\n" + _read_text(drop_in)
        except OSError as e:
            unreadable.append(f"{unit} ({e.strerror or e})")
            continue
        for line in text.splitlines():
            key, _, value = line.strip().partition("=")
            if key.strip() == "EnvironmentFile":
                with contextlib.suppress(OSError):  # "-/path" may be missing by design
                    text += "\n" + _read_text(value.strip().lstrip("-"))
        for rev in revisions_named(text, mdir):
            named.setdefault(rev, unit)
    return named, unreadable


def revisions_in_use(mdir: str, proc: str = "/proc") -> dict[str, str]:
    """Revisions (and partial dirs) of mdir a running process uses: open files, mappings, cwd, or
    the revision directory named in its argv or environment (engines close their files after
    loading, their command line still says what they serve). name -> "pid N (comm)"."""
    used: dict[str, str] = {}
    prefixes = [n + os.sep for n in _dir_names(mdir)]
    for pid in os.listdir(proc) if os.path.isdir(proc) else []:
        if not pid.isdigit():
            continue
        base = os.path.join(proc, pid)
        names: set[str] = set()
        for c in _proc_paths(base):
            for p in prefixes:
                if c.startswith(p):
                    names.add(c[len(p) :].split(os.sep, 1)[0])
        for part in ("cmdline", "environ"):
            with contextlib.suppress(OSError):
                with open(os.path.join(base, part), "rb") as f:
                    names |= revisions_named(f.read().replace(b"\0", b"\n").decode(errors="replace"), mdir)
        if names:
            comm = "?"
            with contextlib.suppress(OSError):
                comm = _read_text(os.path.join(base, "comm")).strip()
            for n in names:
                used.setdefault(n, f"pid {pid} ({comm})")
    return used


def _scan(mdir: str) -> tuple[list[str], list[str]]:
    """Published revisions (newest first) and partial/repair leftovers of a model directory."""
    revs, partials = [], []
    for name in os.listdir(mdir):
        path = os.path.join(mdir, name)
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        if HEX40.match(name):
            rec = read_record(mdir, name)
            revs.append(((rec or {}).get("published_at", os.stat(path).st_mtime), name))
        elif name.startswith((PARTIAL, OLD)):
            partials.append(name)
    return [name for _t, name in sorted(revs, reverse=True)], sorted(partials)


def gc(
    mdir: str,
    keep: int,
    protect: set[str] | frozenset[str] = frozenset(),
    *,
    proc: str = "/proc",
    unit_glob: str = UNIT_GLOB,
    lock_held: bool = False,
) -> dict[str, Any]:
    """Delete published revisions beyond the newest `keep` and abandoned partial dirs. Never deleted:
    `current`'s target, a revision in `protect` (the one just staged), one an installed engine unit
    names (unit_glob), one a process uses. Partial dirs are collected only under the model lock
    (lock_held, or taken here without waiting), so never one a live staging run writes.

    Returns removed (revisions), removed_partials, kept (name -> why, for every revision and
    partial left), kept_in_use (revisions beyond keep spared because a unit or process uses
    them) and skipped (why nothing was deleted, or None)."""
    out: dict[str, Any] = {"removed": [], "removed_partials": [], "kept": {}, "kept_in_use": [], "skipped": None}
    if not os.path.isdir(mdir):
        return out
    revs, partials = _scan(mdir)
    cur = current_target(mdir)
    why: dict[str, list[str]] = {}
    for i, name in enumerate(revs):
        for reason, applies in ((f"one of the newest {keep}", i < keep), ("current", name == cur),
                                ("just staged", name in protect)):  # fmt: skip
            if applies:
                why.setdefault(name, []).append(reason)
    for name in partials:
        rev = name[len(PARTIAL) :] if name.startswith(PARTIAL) else ""
        if rev in protect and rev not in revs:  # (a published revision's partial is a leftover)
            why.setdefault(name, []).append("being staged")
    candidates = [n for n in revs if n not in why]
    partials = [n for n in partials if n not in why]
    lock = None
    if partials and not lock_held:
        lock = ModelLock(mdir, run_by="gc")
        if not lock.try_acquire():
            busy = f"a staging run holds the model lock: {describe_holder(lock.holder())}"
            for name in partials:
                why[name] = [busy]
            partials, lock = [], None
    try:
        if candidates or partials:
            _collect(mdir, candidates=candidates, partials=partials, why=why, out=out, proc=proc, unit_glob=unit_glob)
    finally:
        if lock:
            lock.release()
    out["kept"] = {n: "; ".join(w) for n, w in sorted(why.items()) if os.path.isdir(os.path.join(mdir, n))}
    return out


def _collect(
    mdir: str,
    *,
    candidates: list[str],
    partials: list[str],
    why: dict[str, list[str]],
    out: dict[str, Any],
    proc: str,
    unit_glob: str,
) -> None:
    """gc's deletions, once the names nothing else protects are known."""
    units, unreadable = revisions_in_units(mdir, unit_glob)
    for rev, unit in units.items():
        why.setdefault(rev, []).append(f"named by {unit}")
    for name, user in revisions_in_use(mdir, proc).items():
        why.setdefault(name, []).append(f"in use by {user}")
    if unreadable:
        out["skipped"] = f"cannot read {', '.join(unreadable)}: no revision deleted (a unit may name it)"
    with model_fd(mdir) as mfd:
        for name in candidates:
            if name in why:
                out["kept_in_use"].append(name)
            elif unreadable:
                why[name] = ["an engine unit could not be read"]
            else:
                _remove_tree(mfd, name)
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    os.unlink(f".records/{name}.json", dir_fd=mfd)  # .records is root's, made by subdir()
                out["removed"].append(name)
        for name in partials:
            if name not in why:
                _remove_tree(mfd, name)
                out["removed_partials"].append(name)
        if out["removed"] or out["removed_partials"]:
            os.fsync(mfd)
