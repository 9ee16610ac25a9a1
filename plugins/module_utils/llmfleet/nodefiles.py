"""Directories and small files on a node, as root sets them: created or corrected (owner, group, mode, content),
never through a symlink another user could have planted (safefs), with check mode and a diff of what a file's content
would become: the llmfleet_files module.

Stdlib only, Python >= 3.8 (runs on the nodes)."""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat

from .safefs import open_dir, write_file


class Refused(Exception):
    """A clear reason to stop, with what to do; nothing after it is changed."""


def octal(mode: str, where: str) -> int:
    try:
        value = int(str(mode), 8)
    except ValueError:
        raise Refused(f"{where}: mode {mode!r} is not an octal mode such as '0755'") from None
    if not 0 <= value <= 0o7777:
        raise Refused(f"{where}: mode {mode!r} is out of range")
    return value


def ids(owner: str, group: str, check: bool, where: str) -> tuple[int, int] | None:
    """(uid, gid), or None in check mode when they do not exist yet (the base role creates them first: in
    check mode they were only predicted)."""
    try:
        return pwd.getpwnam(owner).pw_uid, grp.getgrnam(group).gr_gid
    except KeyError:
        if check:
            return None
        raise Refused(f"{where}: user {owner!r} or group {group!r} does not exist on this node") from None


def ensure_dir(d: dict, check: bool) -> bool:
    """Create the directory (parents 0755, root's) and give it its owner, group and mode; True if it changed."""
    path, mode = d["path"], octal(d["mode"], d["path"])
    if not os.path.isabs(path):
        raise Refused(f"{path}: give an absolute path")
    want = ids(d["owner"], d["group"], check, path)
    try:
        fd, created = open_dir(path), False
    except FileNotFoundError:
        if check:
            return True
        fd, created = open_dir(path, create_mode=0o755), True
    try:
        st = os.fstat(fd)
        changed = created or stat.S_IMODE(st.st_mode) != mode or want is None or (st.st_uid, st.st_gid) != want
        if changed and not check:
            if want:
                os.fchown(fd, *want)
            os.fchmod(fd, mode)  # after chown: chown clears set-id bits
    finally:
        os.close(fd)
    return changed


def _read_regular(path: str) -> tuple[os.stat_result, bytes] | None:
    """(stat, content) of a regular file at path, never through a symlink at its end; None when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink: replaced by the write, never read through
            return None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        return (st, f.read()) if stat.S_ISREG(st.st_mode) else None


def ensure_file(f: dict, check: bool, diffs: list | None = None) -> bool:
    """Write the file (atomically, owned by whoever runs this - root, as the roles run it) when its content, mode or
    owner differ; True if it changed. With diffs, a changed file's before and after are appended to it."""
    path, data, mode = f["path"], f["content"].encode(), octal(f["mode"], f["path"])
    if not os.path.isabs(path):
        raise Refused(f"{path}: give an absolute path")
    cur = _read_regular(path)
    if cur is not None:
        st, old = cur
        if old == data and stat.S_IMODE(st.st_mode) == mode and (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid()):
            return False
    if diffs is not None:
        before = cur[1].decode(errors="replace") if cur else ""
        diffs.append({"before_header": path, "after_header": path, "before": before, "after": f["content"]})
    if not check:
        write_file(path, data, mode=mode)  # a temporary name beside it, renamed over: never through a link
    return True
