"""Lab nodes only: keep the bytecode Python compiles for modules it imports from zip files.

Every Ansible module run unpacks nothing: Python imports Ansible's module_utils straight from the
AnsiballZ payload's zip, and zipimport never writes bytecode, so each run compiled the same sources
again - about half of a module run's CPU on a node. On a real cluster that is a fraction of a
second per task on each node's own cores; in the lab every node shares the ops host's two cores, so
it counted twice against every lab test. node-init.sh installs this file and a .pth line that
imports it into each node's system Python (the interpreter Ansible uses there), never into the
engine's venv. Bytecode is kept per user in a private directory (0700, owned by the user, else not
used) and keyed by a hash of the source, so a changed payload compiles again.
"""

from __future__ import annotations

import os
import sys
import zipimport

_compile = zipimport._compile_source


def _cache_dir() -> str | None:
    import pwd

    home = pwd.getpwuid(os.geteuid()).pw_dir  # never $HOME: sudo may keep the caller's
    path = os.path.join(home, ".cache", "llmfleet-lab-zipcache", sys.implementation.cache_tag)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return None
    if st.st_uid != os.geteuid() or st.st_mode & 0o077 or not os.path.isdir(path) or os.path.islink(path):
        return None
    return path


def _refile(code, filename):
    """The cached code under this run's path (tracebacks name the payload that ran)."""
    consts = tuple(_refile(c, filename) if isinstance(c, type(code)) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _compile_source(pathname, source):
    import hashlib
    import marshal

    where = _cache_dir()
    if where is None:
        return _compile(pathname, source)
    path = os.path.join(where, hashlib.sha256(source).hexdigest())
    try:
        with open(path, "rb") as f:
            return _refile(marshal.load(f), pathname)  # noqa: S302 (our own 0700 directory, checked above)
    except (OSError, EOFError, ValueError, TypeError):
        pass
    code = _compile(pathname, source)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "xb") as f:
            marshal.dump(code, f)
        os.replace(tmp, path)
    except OSError:
        pass
    return code


zipimport._compile_source = _compile_source
