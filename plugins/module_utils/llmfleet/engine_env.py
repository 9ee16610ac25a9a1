"""Running the engine's own Python or command from root's modules (the NCCL check's ranks, the engine's
--help and version probes, preflight's NCCL version): as the engine's service account, so a venv that account
can write gains it nothing it does not already have; or as root only from a path no other account can write
(the interpreter, every directory above it, the venv's pyvenv.cfg, site-packages and what sits in it: a .pth
file or sitecustomize runs at every start). Stdlib only, Python >= 3.8.
"""

from __future__ import annotations

import glob
import os
import shutil
import stat
import sys
from typing import Any

MAX_ENTRIES = 5000  # site-packages entries looked at (a CUDA venv holds a few hundred)


class EngineEnvError(Exception):
    """The engine's command cannot be run safely; the message names the path, its owner and the fix."""


def _user(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        import grp

        return grp.getgrgid(gid).gr_name
    except (KeyError, ImportError):
        return f"gid {gid}"


def writers(st: os.stat_result, allowed: tuple[int, ...] = (0,), ancestor: bool = False) -> list[str]:
    """Who, besides the `allowed` uids (and group root), can change this entry. A symlink's own mode means
    nothing (its directory is checked); a root-owned sticky directory above the path only lets others
    change their own entries."""
    if stat.S_ISLNK(st.st_mode):
        return [] if st.st_uid in allowed else [f"its owner {_user(st.st_uid)} (a symlink)"]
    who = [] if st.st_uid in allowed else [f"its owner {_user(st.st_uid)}"]
    if ancestor and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and st.st_uid in allowed:
        return who
    if st.st_mode & 0o020 and st.st_gid != 0:
        who.append(f"group {_group(st.st_gid)}")
    if st.st_mode & 0o002:
        who.append("every user")
    return who


def resolve(command: str) -> str | None:
    """The file a command word executes (PATH searched for a bare name), None when there is none."""
    path = command if os.sep in command else shutil.which(command)
    return os.path.abspath(path) if path and os.path.exists(path) else None


def _chain(path: str) -> list[tuple[str, bool]]:
    """(path, is an ancestor) for the path and every directory above it."""
    out, p = [(path, False)], path
    while True:
        parent = os.path.dirname(p)
        if parent == p:
            return out
        out.append((parent, True))
        p = parent


def trusted_paths(exe: str) -> list[tuple[str, bool]]:
    """What running `exe` trusts: the file and its directories (as named and resolved), and for a venv (or any
    prefix outside /usr; the resolved interpreter's too) its pyvenv.cfg, lib directories, site-packages and each
    entry of site-packages (a .pth file, sitecustomize, a package)."""
    seen: dict[str, bool] = {}
    for p in (exe, os.path.realpath(exe)):
        for q, anc in _chain(p):
            seen[q] = seen.get(q, True) and anc
    for prefix in dict.fromkeys(os.path.dirname(os.path.dirname(p)) for p in (exe, os.path.realpath(exe))):
        if prefix in ("/", "/usr", "/usr/local"):
            continue  # the system's own Python: the distribution's packages, root's
        seen.setdefault(os.path.join(prefix, "pyvenv.cfg"), False)
        for lib in sorted(glob.glob(os.path.join(prefix, "lib*"))):
            seen[lib] = False
            for pyd in sorted(glob.glob(os.path.join(lib, "python*"))):
                seen[pyd] = False
                site = os.path.join(pyd, "site-packages")
                try:
                    names = sorted(os.listdir(site))[:MAX_ENTRIES]
                except OSError:
                    continue
                seen[site] = False
                for name in names:
                    seen[os.path.join(site, name)] = False
    return list(seen.items())


def unsafe_paths(exe: str, allowed: tuple[int, ...] = (0,)) -> list[dict[str, Any]]:
    """[{path, owner, group, mode, writable_by}] for every path `exe` trusts that an account besides `allowed` can
    change."""
    out = []
    for path, ancestor in trusted_paths(exe):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        who = writers(st, allowed, ancestor)
        if who:
            out.append({"path": path, "owner": _user(st.st_uid), "group": _group(st.st_gid),
                        "mode": f"{stat.S_IMODE(st.st_mode):04o}", "writable_by": who})  # fmt: skip
    return out


def describe(found: list[dict[str, Any]], n: int = 3) -> str:
    """`path (owner bob, mode 0775): writable by its owner bob, group staff; ...` for the first n."""
    parts = [f"{f['path']} (owner {f['owner']}, group {f['group']}, mode {f['mode']}): writable by "
             f"{', '.join(f['writable_by'])}" for f in found[:n]]  # fmt: skip
    more = f"; and {len(found) - n} more" if len(found) > n else ""
    return "; ".join(parts) + more


def venv_root(exe: str) -> str:
    """The directory to chown in the fix: the venv (or prefix) holding bin/<exe>, else the file's directory."""
    prefix = os.path.dirname(os.path.dirname(exe))
    return prefix if prefix not in ("/", "/usr", "/usr/local") else os.path.dirname(exe)


def popen_kwargs(command: str, run_as: str | None, env: dict[str, str] | None = None, what: str = "") -> dict:
    """subprocess keyword arguments that run `command` (argv[0], or the interpreter behind it) safely from root.

    run_as (the engine's service account): the child drops to that account, its primary group and the groups
    /etc/group gives it (what systemd's User= gives the engine, GPU device groups included), with HOME, USER
    and LOGNAME its own and / as working directory. Without it (as root, or an account not created on this node
    yet), root runs `command` only when no other account can change what it executes: EngineEnvError names the
    path, its owner and the fix. A process that is not root runs it as itself (it has nothing to drop)."""
    base = dict(os.environ if env is None else env)
    if os.geteuid() != 0:
        return {"env": base}
    import pwd

    try:
        pw = pwd.getpwnam(run_as) if run_as and run_as != "root" else None
    except KeyError:
        pw = None  # no engine on this node yet (the base role creates the account): root, if nothing is writable
    if pw is not None and pw.pw_uid != 0:  # an account with uid 0 is root: checked as root
        groups = sorted(set(os.getgrouplist(run_as, pw.pw_gid)))
        base.update(HOME=pw.pw_dir, USER=run_as, LOGNAME=run_as)
        if sys.version_info >= (3, 9):  # noqa: UP036 (nodes run Python >= 3.8; the CLI's own floor is 3.11)
            return {"env": base, "cwd": "/", "user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": groups}

        def demote() -> None:  # Python 3.8: no user=/group= in subprocess
            os.setgroups(groups)
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)

        return {"env": base, "cwd": "/", "preexec_fn": demote}
    exe = resolve(command)
    found = unsafe_paths(exe) if exe else []
    if found:
        instead = (f"create the engine account {run_as} first (the base role)" if run_as and run_as != "root"
                   else "run it as the engine account")  # fmt: skip
        raise EngineEnvError(
            f"root will not run {what or command} from {exe}: another account can change what it executes: "
            f"{describe(found)}. Own the engine's environment by root (chown -R root:root {venv_root(exe)}; "
            f"chmod -R go-w {venv_root(exe)}), or {instead}"
        )
    return {"env": base}
