"""Writes as root into directories another user can change, without following that user's symlinks.

Root-run code (the llmfleet_engine_cache and llmfleet_model_stage modules) creates, chowns, writes and deletes under
directories that the engine's service user owns (the compile-cache root, /var/lib/llmfleet) or that
every node writes (shared storage). A plain ``makedirs``/``chown``/``open(path, "w")``/``rmtree`` there
follows whatever symlink that user planted: ``<cache>/<fingerprint> -> /etc`` gets /etc chowned to the
engine user. Here every path is walked one component at a time from ``/`` with ``O_NOFOLLOW``; a symlink
is followed only when root alone could have made it (a root-owned link in a root-owned directory that
nobody else may write, or a sticky one), anything else is refused with :class:`UnsafePathError`. Once a
directory is open, everything below it goes through its file descriptor (``dir_fd``), so renaming a
path component afterwards cannot redirect the write.

Stdlib only, Python >= 3.8 (runs on the nodes).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any

O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
O_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_SYMLINKS = 40  # the kernel's limit for one path resolution
_CREATE_RETRIES = 5


class UnsafePathError(OSError):
    """A path that would make root follow a symlink, or write through a non-directory, that another
    user controls. The message names the path, its owner and what to do."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.msg = msg

    def __str__(self) -> str:
        return self.msg


def only_root_can_change(st: os.stat_result) -> bool:
    """A directory whose entries no user but root can add, remove or rename."""
    return st.st_uid == 0 and not st.st_mode & 0o022


def _may_follow(dir_st: os.stat_result, link_st: os.stat_result) -> bool:
    """A symlink only root could have made and only root can replace."""
    if link_st.st_uid != 0 or dir_st.st_uid != 0:
        return False
    return only_root_can_change(dir_st) or bool(dir_st.st_mode & stat.S_ISVTX)


def _who(st: os.stat_result) -> str:
    try:
        import pwd

        name = pwd.getpwuid(st.st_uid).pw_name
    except (ImportError, KeyError):
        name = str(st.st_uid)
    return f"uid {st.st_uid} ({name})"


def _refuse_link(shown: str, fd: int, name: str, link_st: os.stat_result) -> UnsafePathError:
    try:
        target = os.readlink(name, dir_fd=fd)
    except OSError:
        target = "?"
    dir_st = os.fstat(fd)
    return UnsafePathError(
        f"{shown} is a symlink to {target} owned by {_who(link_st)} in a directory {_who(dir_st)} can change "
        f"(mode {stat.S_IMODE(dir_st.st_mode):04o}): root does not follow symlinks another user could have planted; "
        f"nothing was changed. Remove {shown} (or point the setting at a real directory) and rerun"
    )


def _join(shown: str, name: str) -> str:
    return shown.rstrip("/") + "/" + name


def _trusted_link(fd: int, name: str, shown: str) -> str:
    """The target of the symlink ``name`` in ``fd`` if root alone could have made it; else refused."""
    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{shown} is not a directory")
    if not _may_follow(os.fstat(fd), st):
        raise _refuse_link(shown, fd, name, st)
    return os.readlink(name, dir_fd=fd)


def open_dir(path: str, *, create_mode: int | None = None) -> int:
    """File descriptor of the directory ``path`` (absolute), resolved without following a symlink that a
    user other than root could have planted. Missing components are created (root-owned, ``create_mode``
    before the umask) when ``create_mode`` is given, else FileNotFoundError. The caller closes the fd."""
    if not os.path.isabs(path):
        raise UnsafePathError(f"{path}: an absolute path is required")
    todo = [c for c in path.split("/") if c not in ("", ".")]
    fd = os.open("/", O_DIR)
    shown, links, retries = "/", 0, 0
    try:
        while todo:
            name = todo.pop(0)
            try:
                nfd = os.open(name, O_DIR, dir_fd=fd)
            except FileNotFoundError:
                if create_mode is None or retries >= _CREATE_RETRIES:
                    raise FileNotFoundError(errno.ENOENT, "No such file or directory", _join(shown, name)) from None
                retries += 1
                try:
                    os.mkdir(name, create_mode, dir_fd=fd)
                except FileExistsError:
                    pass  # made by someone else meanwhile: open it (or refuse it) like any other entry
                todo.insert(0, name)
                continue
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                links += 1
                if links > MAX_SYMLINKS:
                    raise UnsafePathError(f"{path}: too many levels of symbolic links") from None
                target = _trusted_link(fd, name, _join(shown, name))
                todo[:0] = [c for c in target.split("/") if c not in ("", ".")]
                if target.startswith("/"):
                    os.close(fd)
                    fd, shown = -1, "/"
                    fd = os.open("/", O_DIR)
                continue
            os.close(fd)
            fd, shown = nfd, _join(shown, name)
        return fd
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


def subdir(dir_fd: int, name: str, *, shown: str, mode: int = 0o750, create: bool = True) -> tuple[int, bool]:
    """(fd, created) of the directory ``name`` inside ``dir_fd``; a symlink or a non-directory there is
    refused, never followed or replaced."""
    if not name or "/" in name or name in (".", ".."):
        raise UnsafePathError(f"{shown}: not a plain directory name")
    created = False
    for _ in range(_CREATE_RETRIES):
        try:
            return os.open(name, O_DIR, dir_fd=dir_fd), created
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, mode, dir_fd=dir_fd)
                created = True
            except FileExistsError:
                pass
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise _refuse_link(shown, dir_fd, name, st) from None
            raise UnsafePathError(f"{shown} is not a directory (nothing was changed): remove it and rerun") from None
    raise UnsafePathError(f"{shown} keeps changing while it is created: another process is racing root")


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def chown_fd(fd: int, uid: int, gid: int) -> bool:
    """chown an open directory (never a path: the path may have been swapped since); True if it changed."""
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) == (uid, gid):
        return False
    os.fchown(fd, uid, gid)
    return True


def rmtree_at(dir_fd: int, name: str, *, dir_mode: int | None = None) -> None:
    """Remove ``name`` inside ``dir_fd``: a directory with everything below it, each level opened with
    O_NOFOLLOW and emptied through its fd; a symlink or file is unlinked (a link's target is never touched).
    ``dir_mode``: each directory is fchmod-ed to it first (a read-only tree, such as a published revision, needs
    write permission on its directories to be emptied); files keep their modes."""
    try:
        fd = os.open(name, O_DIR, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        os.unlink(name, dir_fd=dir_fd)
        return
    try:
        if dir_mode is not None:
            os.fchmod(fd, dir_mode)
        with os.scandir(fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for child, is_dir in entries:
            if is_dir:
                rmtree_at(fd, child, dir_mode=dir_mode)
            else:
                try:
                    os.unlink(child, dir_fd=fd)
                except FileNotFoundError:
                    pass
                except IsADirectoryError:  # replaced by a directory meanwhile
                    rmtree_at(fd, child, dir_mode=dir_mode)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def write_file_at(dir_fd: int, name: str, data: bytes, *, mode: int = 0o644, fsync: bool = False) -> None:
    """Replace ``name`` in ``dir_fd`` atomically: a new temporary file (O_EXCL|O_NOFOLLOW: never an
    existing file or link), then rename over ``name`` (which replaces a planted symlink, not its target)."""
    tmp = f".{name}.{os.getpid()}.tmp"
    for _ in range(_CREATE_RETRIES):
        try:
            fd = os.open(tmp, O_NEW_FILE, mode, dir_fd=dir_fd)
            break
        except FileExistsError:
            os.unlink(tmp, dir_fd=dir_fd)  # a stale or planted entry: remove the entry, never follow it
    else:
        raise UnsafePathError(f"{name}: temporary file {tmp} keeps reappearing: another process is racing root")
    try:
        os.fchmod(fd, mode)  # independent of the umask
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def write_file(path: str, data: bytes, *, mode: int = 0o644, create_dirs: bool = False, fsync: bool = False) -> None:
    """:func:`write_file_at` for an absolute path: the parent is opened with :func:`open_dir`."""
    parent, name = os.path.split(os.path.abspath(path))
    fd = open_dir(parent, create_mode=0o755 if create_dirs else None)
    try:
        write_file_at(fd, name, data, mode=mode, fsync=fsync)
    finally:
        os.close(fd)


def write_json(path: str, data: Any, *, mode: int = 0o644, create_dirs: bool = False, fsync: bool = False) -> None:
    write_file(path, json.dumps(data).encode(), mode=mode, create_dirs=create_dirs, fsync=fsync)
