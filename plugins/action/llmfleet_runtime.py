"""Action plugin: install the llmfleet node runtime package with one module run per node when nothing changed, two and
one transfer when the package did. The base role did this in about a dozen tasks (a temporary directory, packing, copy,
stat, extract, swap, compile), each a module run on every node.

The package is packed here, in the controller's process, into a deterministic archive; the module
(library/llmfleet_runtime.py) compares its sha256 with the node's and asks for the archive only when they differ."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

# The ops host's tools (on-call, the deployment report, API acceptance): left out of what nodes get. The package's
# CLI (llmfleet.cli.OPS_HOST, which a test holds equal) tells a node that runs one where it runs instead.
OPS_HOST = ("accept", "oncall", "report")


def argument_spec() -> dict:
    """The options (a fresh dict each call); tests compare them with the module's DOCUMENTATION."""
    return {
        "src": {"type": "path", "required": True},
        "lib_dir": {"type": "path", "required": True},
        "python": {"type": "path", "required": True},
        "metrics_dir": {"type": "path", "default": ""},
        "metrics_group": {"type": "str", "default": ""},
    }


def pack(src: str) -> tuple[bytes, int]:
    """(archive, file count) of the node runtime in src: the package without its ops-host subpackages (OPS_HOST),
    sorted names, no __pycache__ or .pyc, mtimes 0, root owners, mode 0644, no name or time in the gzip header - the
    same bytes for the same files, on any ops host."""
    src = src.rstrip("/")
    if not os.path.isfile(os.path.join(src, "__init__.py")):
        raise AnsibleActionFail(f"src={src} holds no llmfleet package (__init__.py) on the ops host: point "
                                "base_runtime_src at this project's module_utils/llmfleet")  # fmt: skip
    names = []
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not (root == src and d in OPS_HOST))
        names += [os.path.join(root, f) for f in sorted(files) if not f.endswith(".pyc")]
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", fileobj=buf, mode="wb", mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for n in names:
                info = tar.gettarinfo(n, arcname=os.path.relpath(n, src))
                info.uid = info.gid = info.mtime = 0
                info.uname = info.gname = "root"
                info.mode = 0o644
                with open(n, "rb") as f:
                    tar.addfile(info, f)
    return buf.getvalue(), len(names)


class ActionModule(ActionBase):
    TRANSFERS_FILES = False  # only when the node's package differs: the temporary directory is made then

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        _, args = self.validate_argument_spec(argument_spec=argument_spec())
        try:
            archive, count = pack(args.pop("src"))
        except OSError as e:
            raise AnsibleActionFail(f"cannot pack the runtime package: {e}") from None
        args["archive_sha256"] = hashlib.sha256(archive).hexdigest()
        res = self._execute_module("llmfleet.fleet.llmfleet_runtime", module_args=args, task_vars=task_vars)
        if res.pop("needs_archive", False) and not res.get("failed"):
            first = res.get("changed_paths", [])
            try:
                tmpdir = self._make_tmp_path()
                remote = self._connection._shell.join_path(tmpdir, "llmfleet-runtime.tar.gz")
                self._transfer_data(remote, archive)
                self._fixup_perms2((tmpdir, remote))
                res = self._execute_module("llmfleet.fleet.llmfleet_runtime", module_args={**args, "archive": remote},
                                           task_vars=task_vars)  # fmt: skip
            finally:
                self._remove_tmp_path(self._connection._shell.tmpdir)
            res["changed_paths"] = list(dict.fromkeys([*first, *res.get("changed_paths", [])]))
            res["changed"] = res.get("changed", False) or bool(first)
        if not res.get("failed"):
            res["package_files"] = count
        result.update(res)
        return result
