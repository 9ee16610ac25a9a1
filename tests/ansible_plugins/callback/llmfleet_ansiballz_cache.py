"""Test runs only: keep the module_utils scan of AnsiballZ payloads from one ansible-playbook run to the next.

Before it sends a Python module, Ansible parses the module and every module_utils file it imports to find what
to pack (module_common.recursive_finder). It keeps the result only in the run's own temporary directory, so each
of the test suite's few hundred ansible-playbook runs parsed the same sources again: a fifth of the controller's
CPU in an engine converge (py-spy: 14 payloads, about 6 CPU-s of 29). This callback, enabled by the test suites
only (tests/helpers/ansible_cache.py), wraps recursive_finder with a cache on disk:

- keyed by the module's source, its name, the payload's extensions, ansible-core's version and the size and
  mtime of every file under the module_utils directories (Ansible's, configured ones, and every collection's
  plugins/module_utils on the collection paths - llmfleet.fleet's package among them): any change scans again;
- never used for a payload that takes module_utils from a collection outside those paths (not in that
  fingerprint) or with the debugger extension (it needs the scan's source mapping);
- in a directory private to the user (0700, owned by them, else not used), written atomically;
- when ansible-core's internals differ from what this expects, it does nothing and Ansible scans as always.

Ansible still builds, caches and sends every payload itself: only the scan's result (which files, their
contents, the module's metadata) comes from the cache. Operators' runs never load this plugin.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile

from ansible import __version__ as ansible_version
from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: llmfleet_ansiballz_cache
type: aggregate
short_description: test suites only - cache AnsiballZ module_utils scans across runs
description:
  - Wraps ansible.executor.module_common.recursive_finder with an on-disk cache keyed by the sources it scans.
requirements:
  - enabled in callbacks_enabled (the test suites set it through the environment)
"""

_FORMAT = 1


def _private_dir() -> str | None:
    from ansible import constants as C

    home = C.config.get_config_value("ANSIBLE_HOME")
    path = os.path.join(home, "llmfleet-ansiballz-cache", f"v{_FORMAT}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return None
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return None
    return path


def _fingerprint(dirs) -> str:
    h = hashlib.sha256(f"ansible-core {ansible_version}\n".encode())
    for top in sorted(set(dirs)):
        h.update(f"dir {top}\n".encode())
        for root, subdirs, files in os.walk(top):
            subdirs.sort()
            for name in sorted(files):
                path = os.path.join(root, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                h.update(f"{os.path.relpath(path, top)} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _bytes(data) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


class _Recorder:
    """The payload's zip as recursive_finder sees it: every file it writes is also kept for the cache."""

    def __init__(self, zf):
        self._zf = zf
        self.entries = []

    def writestr(self, zinfo, data, *args, **kwargs):
        self.entries.append((zinfo.filename, _bytes(data)))
        return self._zf.writestr(zinfo, data, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._zf, name)


def _collection_of(arcname: str) -> str | None:
    """'ns.name' of a payload entry that comes from a collection, else None."""
    parts = arcname.split("/")
    return ".".join(parts[1:3]) if parts[0] == "ansible_collections" and len(parts) > 3 else None


def wrap(finder, module_utils_dirs, make_zinfo, metadata_v1, covered=set):
    """recursive_finder with the cache; module_utils_dirs() lists the directories the fingerprint covers, and
    covered() the collections ('ns.name') whose module_utils are among them."""
    state: dict = {}

    def cached_finder(name, module_fqn, module_data, zf, date_time, extension_manager):
        if getattr(extension_manager, "debugger_enabled", True):
            return finder(name, module_fqn, module_data, zf, date_time, extension_manager)
        if "dir" not in state:
            state["dir"] = _private_dir()
            state["fingerprint"] = _fingerprint(module_utils_dirs())
        if state["dir"] is None:
            return finder(name, module_fqn, module_data, zf, date_time, extension_manager)
        key = hashlib.sha256(
            json.dumps([state["fingerprint"], name, module_fqn, list(extension_manager.module_names)]).encode()
            + _bytes(module_data)
        ).hexdigest()
        path = os.path.join(state["dir"], key + ".json")
        try:  # read whole before anything goes into the payload: an unreadable entry is a miss, not half a zip
            with open(path, encoding="utf-8") as f:
                hit = json.load(f)
            entries = [(arcname, base64.b64decode(data)) for arcname, data in hit["entries"]]
            profile = hit["serialization_profile"]
        except (OSError, ValueError, KeyError, TypeError):
            entries = None
        if entries is not None:
            for arcname, data in entries:
                zf.writestr(make_zinfo(arcname, date_time, zf=zf), data)
            return metadata_v1(serialization_profile=profile)
        recorder = _Recorder(zf)
        metadata = finder(name, module_fqn, module_data, recorder, date_time, extension_manager)
        from_collections = {c for c in map(_collection_of, (a for a, _ in recorder.entries)) if c}
        if type(metadata) is metadata_v1 and from_collections <= covered():
            doc = {
                "serialization_profile": metadata.serialization_profile,
                "entries": [[a, base64.b64encode(d).decode()] for a, d in recorder.entries],
            }
            fd, tmp = tempfile.mkstemp(dir=state["dir"], prefix=".part-")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f)
            os.replace(tmp, path)
        return metadata

    cached_finder.llmfleet_cached = True
    return cached_finder


def collection_utils() -> dict:
    """{'ns.name': its plugins/module_utils} for the collections on the collection paths (first one wins,
    as the collection loader's search)."""
    try:
        from ansible.utils.collection_loader import AnsibleCollectionConfig

        paths = list(AnsibleCollectionConfig.collection_paths or [])
    except (ImportError, AttributeError):
        return {}
    found = {}
    for top in paths:
        base = os.path.join(top, "ansible_collections")
        for ns in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            for name in sorted(os.listdir(os.path.join(base, ns))) if os.path.isdir(os.path.join(base, ns)) else []:
                utils = os.path.join(base, ns, name, "plugins", "module_utils")
                if os.path.isdir(utils):
                    found.setdefault(f"{ns}.{name}", utils)
    return found


def install() -> None:
    try:
        from ansible.executor import module_common as mc

        finder = mc.recursive_finder
        make_zinfo = mc._make_zinfo
        metadata_v1 = mc.ModuleMetadataV1
        mu_loader = mc.module_utils_loader
        mu_path = mc._MODULE_UTILS_PATH
    except (ImportError, AttributeError):  # another ansible-core: leave Ansible as it is
        return
    if getattr(finder, "llmfleet_cached", False):
        return

    def module_utils_dirs():
        loader = [p for p in mu_loader._get_paths(subdirs=False) if os.path.isdir(p)]
        return [*loader, mu_path, *sorted(collection_utils().values())]

    mc.recursive_finder = wrap(finder, module_utils_dirs, make_zinfo, metadata_v1, lambda: set(collection_utils()))


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "llmfleet_ansiballz_cache"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        # Callbacks load before the strategy forks its workers, so every worker inherits the wrapped finder.
        install()
