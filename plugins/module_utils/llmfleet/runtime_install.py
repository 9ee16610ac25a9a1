"""Install the llmfleet node runtime on this node (the llmfleet_runtime module's work): the Python check, the metrics
directory and the package from its archive, compiled and swapped in whole.

Stdlib only, Python >= 3.8 (runs on the nodes)."""

from __future__ import annotations

import grp
import os
import stat
import subprocess
import tarfile

from .nodefiles import Refused
from .safefs import UnsafePathError, open_dir, rmtree_at

MARKER = ".archive-sha256"  # in the package directory: swapped in with it
LEGACY_ARCHIVE = ".llmfleet-runtime.tar.gz"  # where the base role kept the archive before this module
MIN_PYTHON = (3, 8)

__all__ = ["MARKER", "Refused", "UnsafePathError", "run"]


def python_version(python: str) -> str:
    code = "import sys; print('%d.%d' % sys.version_info[:2])"
    try:
        cp = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Refused(f"{python} is not a usable Python >= 3.8 ({e}). Set base_python to a Python 3.8+ interpreter "
                      "that exists on every node") from None  # fmt: skip
    version = cp.stdout.strip()
    try:
        ok = cp.returncode == 0 and tuple(int(x) for x in version.split(".")) >= MIN_PYTHON
    except ValueError:
        ok = False
    if not ok:
        raise Refused(f"{python} is not a usable Python >= 3.8 (rc={cp.returncode}, output: {version} "
                      f"{cp.stderr.strip()}). Set base_python to a Python 3.8+ interpreter that exists on every "
                      "node")  # fmt: skip
    return version


def ensure_metrics_dir(path: str, group: str, check: bool) -> bool:
    if not group:
        raise Refused(f"metrics_dir {path}: give metrics_group, the group that may write there")
    try:
        fd = open_dir(path)
    except (FileNotFoundError, UnsafePathError):
        raise Refused(f"llmfleet_metrics_dir {path} is not a directory. Install node_exporter and set "
                      "llmfleet_metrics_dir to its --collector.textfile.directory, or set llmfleet_metrics_dir: '' to "
                      "write no metrics") from None  # fmt: skip
    try:
        st = os.fstat(fd)
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            if check:
                return True
            raise Refused(f"metrics_dir {path}: group {group!r} does not exist on this node") from None
        changed = st.st_gid != gid or stat.S_IMODE(st.st_mode) != 0o1775
        if changed and not check:
            os.fchown(fd, -1, gid)
            os.fchmod(fd, 0o1775)
    finally:
        os.close(fd)
    return changed


def installed_sha(lib: str) -> str:
    try:
        with open(os.path.join(lib, "llmfleet", MARKER), encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def extract(archive: str, dest: str) -> int:
    """Extract our own archive into the fresh directory dest: regular files and directories only, each name
    relative and without '..' (a tampered archive is refused, never written outside dest). Returns the file count."""
    n = 0
    with tarfile.open(archive, "r:gz") as tar:
        for m in tar:
            parts = m.name.split("/")
            if m.name.startswith("/") or ".." in parts or not (m.isreg() or m.isdir()):
                raise Refused(f"the runtime archive holds {m.name!r}, which is not a plain file of the package")
            target = os.path.join(dest, *parts)
            if m.isdir():
                os.makedirs(target, 0o755, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
            src = tar.extractfile(m)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as out:
                while True:
                    chunk = src.read(1 << 20)
                    if not chunk:
                        break
                    out.write(chunk)
            os.chmod(target, 0o644)
            n += 1
    return n


def _remove(lib: str, *names: str) -> None:
    """Remove entries of lib (a tree, a file or a link; never what a link points to)."""
    fd = open_dir(lib)
    try:
        for name in names:
            rmtree_at(fd, name)
    finally:
        os.close(fd)


def install(lib: str, archive: str, sha: str, python: str) -> int:
    """Extract beside the old package, compile it, record the sha256, swap it in. Returns the file count."""
    fd = open_dir(lib)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        raise Refused(f"lib_dir {lib} must be root-owned and writable by nobody else: root installs code there "
                      "(the base role's llmfleet_files task makes it root's, mode 0755)")  # fmt: skip
    _remove(lib, "llmfleet.new", "llmfleet.old")
    cur, new, old = (os.path.join(lib, n) for n in ("llmfleet", "llmfleet.new", "llmfleet.old"))
    os.mkdir(new, 0o755)
    os.chmod(new, 0o755)  # noqa: S103 (every user's Python imports the package; nothing secret)
    try:
        n = extract(archive, new)
        if not os.path.isfile(os.path.join(new, "__init__.py")):
            raise Refused("the runtime archive holds no __init__.py: it is not the llmfleet package")
        # Compiled before the swap, with the path it will have (-d: tracebacks name the installed file; a .pyc is
        # checked against its source's mtime and size, not its path): a package that does not compile is never
        # swapped in, and the recorded sha256 never claims one that did not.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}  # beside the package
        cp = subprocess.run([python, "-m", "compileall", "-q", "-d", cur, new], capture_output=True, text=True,
                            timeout=300, check=False, env=env)  # fmt: skip
        if cp.returncode != 0:
            raise Refused(f"{python} cannot compile the llmfleet package (nothing was installed, the old package "
                          f"stays): {(cp.stdout + cp.stderr).strip()[-2000:]}")  # fmt: skip
        with open(os.path.join(new, MARKER), "w", encoding="ascii") as f:
            f.write(sha + "\n")
        os.chmod(os.path.join(new, MARKER), 0o644)
    except BaseException:
        _remove(lib, "llmfleet.new")
        raise
    if os.path.lexists(cur):
        os.rename(cur, old)
    os.rename(new, cur)
    _remove(lib, "llmfleet.old", LEGACY_ARCHIVE)
    return n


def run(p: dict, check: bool) -> dict:
    version = python_version(p["python"])
    changed: list[str] = []
    if p["metrics_dir"] and ensure_metrics_dir(p["metrics_dir"], p["metrics_group"], check):
        changed.append(p["metrics_dir"])
    lib, sha = p["lib_dir"], p["archive_sha256"]
    current = installed_sha(lib) == sha and os.path.isfile(os.path.join(lib, "llmfleet", "__init__.py"))
    out = {"python_version": version, "sha256": sha, "installed": not current, "changed_paths": changed}
    if current:
        return out
    if check:
        return {**out, "changed_paths": [*changed, os.path.join(lib, "llmfleet")]}
    if not p["archive"]:
        return {**out, "needs_archive": True}  # the action sends it and runs this again
    out["package_files"] = install(lib, p["archive"], sha, p["python"])
    out["changed_paths"].append(os.path.join(lib, "llmfleet"))
    return out
