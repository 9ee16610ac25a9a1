"""Removing one deployment from a node (the engine role's ``engine_state: absent``, playbooks/reset.yml).

Everything is named exactly (no globs over other deployments' names): the units' files, drop-ins and enablement
links, the deployment's own files and directories, the credentials ``<credentials dir>/<deployment>.*``, metrics
textfiles by name, and - asked for explicitly - its staged revision and the node runtime. What another deployment on
the node still uses is kept, with the reason: a revision another installed unit names (or a process outside this
deployment's units uses), and the runtime while any other deployment is installed (a claim or a unit file).

Root removes through file descriptors, never by path with ``rm -rf``: the parent of each path is reached without
following a link another account could plant (safefs.open_dir), and a directory is emptied level by level, each
opened O_NOFOLLOW through its parent's fd (safefs.rmtree_at), so a link planted in a directory the engine's account
can write (its state directory, the compile caches, the metrics directory) is unlinked, its target never touched.

Stdlib only, Python >= 3.8 (runs inside an Ansible module on the node and on the ops host).
"""

from __future__ import annotations

import glob
import os
import re
import stat
from typing import Any

from .. import safefs
from ..facts import HEX40
from ..stage import store

UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system")
# Where `systemctl enable` (and a unit's own Wants=/Requires= in [Install]) leaves links to a unit.
ENABLE_SUFFIXES = (".wants", ".requires", ".upholds")
UNIT_RE = re.compile(r"llmfleet-(.+)\.service\Z")
LABEL_READ_LIMIT = 4 << 20  # a metrics textfile is a few KiB; never read an unbounded file as root


class Result:
    """What a reset did (or would do, in check mode): removed paths, kept paths with why, refused paths."""

    def __init__(self) -> None:
        self.removed: list[str] = []
        self.kept: list[dict[str, str]] = []
        self.refused: list[str] = []

    def keep(self, path: str, why: str) -> None:
        self.kept.append({"path": path, "why": why})

    def as_dict(self) -> dict[str, Any]:
        return {"removed": self.removed, "kept": self.kept, "refused": self.refused}


def unit_paths(units: list[str], unit_dirs: tuple[str, ...] | list[str] = UNIT_DIRS) -> list[str]:
    """Every path systemd reads for these units that exists: the unit file, its drop-in directory
    (<unit>.d/) and the links that enable it (<dir>/<target>.wants/<unit>, .requires/, .upholds/)."""
    out: list[str] = []
    for d in unit_dirs:
        for u in units:
            out += [os.path.join(d, u), os.path.join(d, u + ".d")]
        try:
            entries = sorted(os.listdir(d))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            if e.endswith(ENABLE_SUFFIXES):
                out += [os.path.join(d, e, u) for u in units]
    return [p for p in out if os.path.lexists(p)]


def other_deployments(
    deployment: str, claim_dir: str, units: list[str], unit_dirs: tuple[str, ...] | list[str] = UNIT_DIRS
) -> list[str]:
    """The other deployments installed on this node: a claim <claim_dir>/<name>.json, or a unit file
    llmfleet-<name>.service that is not one of this deployment's ``units``."""
    names: set[str] = set()
    try:
        claims = os.listdir(claim_dir) if claim_dir else []
    except (FileNotFoundError, NotADirectoryError):
        claims = []
    names.update(f[: -len(".json")] for f in claims if f.endswith(".json") and not f.startswith("."))
    for d in unit_dirs:
        try:
            files = os.listdir(d)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for f in files:
            m = UNIT_RE.match(f)
            if m and f not in units and not os.path.isdir(os.path.join(d, f)):
                names.add(m.group(1))
    names.discard(deployment)
    # A P/D router unit is its deployment's (llmfleet-<name>-router.service beside llmfleet-<name>.service).
    return sorted(n for n in names if not (n.endswith("-router") and n[: -len("-router")] in names))


def remove(path: str, check: bool, res: Result) -> bool:
    """Remove ``path`` (a file, a link - never its target - or a directory with everything below it) when it is
    there; True when it was (would be, in check mode) removed. A path root cannot reach without following another
    account's link is refused (res.refused, with the reason), not removed."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path.rstrip("/") or "/")
    if not name:
        raise ValueError(f"{path}: refusing to remove /")
    try:
        fd = safefs.open_dir(parent)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except safefs.UnsafePathError as e:
        res.refused.append(f"{path}: {e}")
        return False
    try:
        if safefs.lstat_at(fd, name) is None:
            return False
        if not check:
            safefs.rmtree_at(fd, name)
    finally:
        os.close(fd)
    res.removed.append(path)
    return True


def remove_prefixed(prefix: str, check: bool, res: Result) -> None:
    """Remove every entry of prefix's directory whose name starts with prefix's last component
    (``<credentials dir>/<deployment>.``: the API key, engine_secret_env's files, the fabric key)."""
    parent, start = os.path.split(prefix)
    if not start:
        raise ValueError(f"{prefix}: a prefix names the start of the files' names")
    try:
        fd = safefs.open_dir(parent)
    except (FileNotFoundError, NotADirectoryError):
        return
    except safefs.UnsafePathError as e:
        res.refused.append(f"{prefix}*: {e}")
        return
    try:
        names = sorted(n for n in os.listdir(fd) if n.startswith(start))
    finally:
        os.close(fd)
    for n in names:
        remove(os.path.join(parent, n), check, res)


def carries_label(path: str, deployment: str) -> bool | None:
    """Whether the metrics textfile at path has a sample labelled deployment="<deployment>"; None when it is
    missing, not a regular file (a link, a FIFO: never opened) or its directory cannot be reached safely."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        dfd = safefs.open_dir(parent)
    except (OSError, safefs.UnsafePathError):
        return None
    try:
        fd = os.open(name, store.O_FILE, dir_fd=dfd)
    except OSError:
        return None
    finally:
        os.close(dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        text = os.read(fd, LABEL_READ_LIMIT).decode("utf-8", "replace")
    finally:
        os.close(fd)
    return f'deployment="{deployment}"' in text


def remove_labelled(path: str, deployment: str, check: bool, res: Result) -> None:
    """A textfile one file per node holds for whichever deployment ran last (the NCCL check's, staging's):
    removed only when it is this deployment's."""
    mine = carries_label(path, deployment)
    if mine:
        remove(path, check, res)
    elif mine is False:
        res.keep(path, "another deployment's (its samples are not labelled deployment=" + repr(deployment) + ")")


def _own_pid(pid: str, units: list[str], proc: str) -> bool:
    """Whether a process runs in one of this deployment's units (its cgroup path names the unit)."""
    try:
        with open(os.path.join(proc, pid, "cgroup"), encoding="utf-8", errors="replace") as f:
            cg = f.read()
    except OSError:
        return False
    return any("/" + u in cg for u in units)


def revision_users(mdir: str, revision: str, units: list[str], unit_glob: str, proc: str) -> list[str]:
    """Why the revision must stay: another installed engine unit names it (with drop-ins and environment files),
    an engine unit cannot be read, or a process outside this deployment's units uses it."""
    why = []
    for unit in sorted(glob.glob(unit_glob)):
        if os.path.basename(unit) in units:
            continue
        named, unreadable = store.revisions_in_units(mdir, glob.escape(unit))
        if revision in named:
            why.append(f"named by {unit}")
        why += [f"cannot read {u}: it may name it" for u in unreadable]
    for name, user in store.revisions_in_use(mdir, proc).items():
        if name not in (revision, store.PARTIAL + revision):
            continue
        m = re.match(r"pid (\d+) ", user)
        # Only in check mode are this deployment's engines still running (a real reset stops them first).
        if not (m and _own_pid(m.group(1), units, proc)):
            why.append(f"in use by {user}")
    return why


def remove_revision(
    rdir: str,
    check: bool,
    res: Result,
    *,
    units: list[str],
    unit_glob: str = store.UNIT_GLOB,
    proc: str = "/proc",
) -> None:
    """Remove a staged revision <root>/<model>/<revision> (with its partial copy and publish record), `current`
    when it points there, and the model directory when nothing else is left in it; kept, with why, while another
    deployment or process uses it or a staging run holds the model's lock."""
    rdir = os.path.abspath(rdir).rstrip("/")
    mdir, rev = os.path.split(rdir)
    if not HEX40.match(rev):
        raise ValueError(f"{rdir} is not a revision directory (<model root>/<model>/<40-hex revision>)")
    try:
        mfd = store.open_model_dir(mdir, create=False)
    except store.StageError as e:
        res.refused.append(f"{rdir}: {e}")
        return
    if mfd is None:
        return
    os.close(mfd)
    why = revision_users(mdir, rev, units, unit_glob, proc)
    if why:
        res.keep(rdir, "; ".join(why))
        return
    lock = None
    if not check:
        lock = store.ModelLock(mdir, run_by="reset")
        if not lock.try_acquire():
            res.keep(rdir, f"a staging run holds the model lock: {store.describe_holder(lock.holder())}")
            return
    try:
        _remove_revision_files(mdir, rev, check, res)
    finally:
        if lock:
            lock.release()
    _remove_if_empty_model_dir(mdir, rev, check, res)


def _remove_revision_files(mdir: str, rev: str, check: bool, res: Result) -> None:
    """The revision, its partial copy and publish record, and `current` when it points there."""
    with store.model_fd(mdir) as mfd:
        for name in (rev, store.PARTIAL + rev, f".records/{rev}.json"):
            if _lexists_at(mfd, name):
                if not check:
                    _remove_at(mfd, name)
                res.removed.append(os.path.join(mdir, name))
        if store.current_target(mdir) == rev:
            if not check:
                os.unlink("current", dir_fd=mfd)
            res.removed.append(os.path.join(mdir, "current"))
        if not check:
            os.fsync(mfd)


def _lexists_at(dir_fd: int, rel: str) -> bool:
    head, name = os.path.split(rel)
    if not head:
        return safefs.lstat_at(dir_fd, name) is not None
    try:
        fd, _ = safefs.subdir(dir_fd, head, shown=head, create=False)
    except (FileNotFoundError, safefs.UnsafePathError):
        return False
    try:
        return safefs.lstat_at(fd, name) is not None
    finally:
        os.close(fd)


def _remove_at(dir_fd: int, rel: str) -> None:
    head, name = os.path.split(rel)
    if not head:
        safefs.rmtree_at(dir_fd, name, dir_mode=store.DIR_RW)  # a published revision is read-only
        return
    fd, _ = safefs.subdir(dir_fd, head, shown=head, create=False)
    try:
        safefs.rmtree_at(fd, name)
    finally:
        os.close(fd)


def _remove_if_empty_model_dir(mdir: str, removed_rev: str, check: bool, res: Result) -> None:
    """The model directory goes when nothing but an empty .records is left (in check mode: would be left)."""
    try:
        left = set(os.listdir(mdir))
        records = set(os.listdir(os.path.join(mdir, ".records"))) if ".records" in left else set()
    except OSError:
        return
    if check:
        left -= {removed_rev, store.PARTIAL + removed_rev, "current"}
        records.discard(f"{removed_rev}.json")
    if left - {".records"} or records:
        return
    if check:
        res.removed.append(mdir)
    else:
        remove(mdir, False, res)


def reset(
    *,
    deployment: str,
    units: list[str],
    claim_dir: str = "",
    paths: list[str] = (),  # type: ignore[assignment]
    prefixes: list[str] = (),  # type: ignore[assignment]
    labelled: list[str] = (),  # type: ignore[assignment]
    revisions: list[str] = (),  # type: ignore[assignment]
    shared: list[str] = (),  # type: ignore[assignment]
    check: bool = False,
    unit_dirs: tuple[str, ...] | list[str] = UNIT_DIRS,
    unit_glob: str = store.UNIT_GLOB,
    proc: str = "/proc",
) -> dict[str, Any]:
    """Remove one deployment's traces from this node, in this order: the units' files (the caller has stopped
    them and reloads systemd after), the deployment's paths and credentials, its labelled textfiles, its staged
    revisions, then - only when no other deployment is installed here - the shared paths (the runtime)."""
    res = Result()
    others = other_deployments(deployment, claim_dir, units, unit_dirs)
    unit_files = unit_paths(units, unit_dirs)
    for p in unit_files:
        remove(p, check, res)
    units_removed = [p for p in res.removed if p in unit_files]
    for p in paths:
        remove(p, check, res)
    for p in prefixes:
        remove_prefixed(p, check, res)
    for p in labelled:
        remove_labelled(p, deployment, check, res)
    for p in revisions:
        remove_revision(p, check, res, units=units, unit_glob=unit_glob, proc=proc)
    for p in shared:
        if others:
            if os.path.lexists(p):
                res.keep(p, "still used by deployment(s) " + ", ".join(others) + " on this node")
        else:
            remove(p, check, res)
    return {**res.as_dict(), "units_removed": units_removed, "other_deployments": others}
