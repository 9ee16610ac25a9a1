"""The per-revision manifest: size + sha256 of every file (sha256 = the hub's LFS oid).

Its format, building it (every file read once), reading and checking a manifest file, comparing
a directory with it, and obtaining a revision's manifest for staging (cached on shared storage,
shipped with the source, or built). Checkpoint structure (safetensors headers, the shard index,
required files) and the Problem/Report types are in checkpoint.py, which builds on this module.

Stdlib only: runs inside Ansible modules on nodes and in the CLI.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import safefs
from .stage_errors import StageError

MANIFEST_FORMAT = "llmfleet-manifest/1"
SHIPPED_MANIFEST = ".llmfleet-manifest.json"
HEX40 = re.compile(r"^[0-9a-f]{40}$")  # a pinned revision: a commit id (branch and tag names move)
HASH_CHUNK = 8 * 1024 * 1024


def sha256_file(path: str, chunk: int = HASH_CHUNK) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def revision_from_path(directory: str) -> str | None:
    """The commit of a hub-cache snapshot dir (models--org--name/snapshots/<40-hex>/), else None."""
    parts = os.path.normpath(os.path.abspath(directory)).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "snapshots" and HEX40.match(parts[-1]) and parts[-3].startswith("models--"):
        return parts[-1]
    return None


def list_files(directory: str) -> list[str]:
    """Relative paths of the revision's files (symlinks followed, as in hub snapshots), sorted.
    Hidden entries (.cache, .git, .llmfleet-*) are not part of a revision."""
    out = []
    for top, dirs, files in os.walk(directory, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if not name.startswith("."):
                out.append(os.path.relpath(os.path.join(top, name), directory))
    return sorted(out)


# ---- building ---------------------------------------------------------------------------------


def build_manifest(directory: str, threads: int = 4, revision: str | None = None) -> dict[str, Any]:
    """Read every file once and record its size and sha256."""
    files = list_files(directory)

    def one(rel: str) -> dict[str, Any]:
        path = os.path.join(directory, rel)
        return {"path": rel, "size": os.path.getsize(path), "sha256": sha256_file(path)}

    with ThreadPoolExecutor(max_workers=max(1, threads)) as ex:  # hashlib releases the GIL
        entries = list(ex.map(one, files))
    return {
        "format": MANIFEST_FORMAT,
        "revision": revision or revision_from_path(directory),
        "files": entries,
        "total_bytes": sum(e["size"] for e in entries),
    }


def stat_manifest(src: str) -> dict[str, Any]:
    """Sizes only (no hashing): what check mode uses to predict bytes before a manifest exists."""
    files = [{"path": p, "size": os.path.getsize(os.path.join(src, p)), "sha256": ""} for p in list_files(src)]
    return {"files": files, "total_bytes": sum(e["size"] for e in files), "revision": None}


# ---- reading and verifying ----------------------------------------------------------------------


def load_manifest(path: str) -> dict[str, Any]:
    """Read and check a manifest file; raises ValueError naming what is wrong."""
    with open(path, encoding="utf-8") as f:
        m = json.load(f)
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT or not isinstance(m.get("files"), list):
        raise ValueError(f"{path}: not an {MANIFEST_FORMAT} manifest")
    for e in m["files"]:
        if not (
            isinstance(e, dict)
            and isinstance(e.get("path"), str)
            and isinstance(e.get("size"), int)
            and isinstance(e.get("sha256"), str)
            and re.fullmatch(r"[0-9a-f]{64}", e["sha256"])
        ):
            raise ValueError(f"{path}: malformed entry {e!r}")
        rel = e["path"]
        if os.path.isabs(rel) or ".." in rel.split("/") or rel.startswith(".") or "\\" in rel:
            raise ValueError(f"{path}: entry path {rel!r} leaves the revision directory")
    return m


def verify_manifest(
    directory: str, manifest: dict[str, Any], deep: bool = True, threads: int = 4
) -> tuple[list[tuple[str, str, str]], list[str]]:
    """Compare files on disk with the manifest: presence, size, and (deep) sha256.

    Returns (problems, warnings); each problem is (file, kind, message) with kind one of
    missing_file, truncated, size_mismatch, hash_mismatch (checkpoint.KIND_FIX says the fix;
    checkpoint.verify turns them into its Problems)."""
    expected = {e["path"]: e for e in manifest["files"]}

    def one(rel: str) -> tuple[str, str, str] | None:
        e = expected[rel]
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            return (rel, "missing_file", "listed in the manifest, not on disk")
        size = os.path.getsize(path)
        if size != e["size"]:
            kind = "truncated" if size < e["size"] else "size_mismatch"
            return (rel, kind, f"{size} bytes on disk, manifest says {e['size']}")
        if deep:
            got = sha256_file(path)
            if got != e["sha256"]:
                return (rel, "hash_mismatch", f"sha256 {got[:12]}… on disk, manifest says {e['sha256'][:12]}…")
        return None

    with ThreadPoolExecutor(max_workers=max(1, threads)) as ex:
        problems = [p for p in ex.map(one, sorted(expected)) if p]
    warnings = []
    extra = sorted(set(list_files(directory)) - set(expected))
    if extra:
        warnings.append(f"files not in the manifest: {', '.join(extra[:5])}{' …' if len(extra) > 5 else ''}")
    return problems, warnings


def sizes_match(src: str, manifest: dict[str, Any]) -> list[str]:
    """Files whose size on the source differs from the manifest (a revision must be immutable)."""
    bad = []
    for e in manifest["files"]:
        try:
            if os.path.getsize(os.path.join(src, e["path"])) != e["size"]:
                bad.append(e["path"])
        except OSError:
            bad.append(e["path"])
    return bad


# ---- obtaining a revision's manifest for staging ------------------------------------------------


def manifest_cache_path(cache_dir: str, model: str, revision: str) -> str:
    return os.path.join(cache_dir, "manifests", model, f"{revision}.json")


def obtain_manifest(
    src: str,
    model: str,
    revision: str,
    cache_dir: str,
    *,
    build: Callable[[], dict[str, Any]],
    check_mode: bool = False,
) -> dict[str, Any]:
    """The revision's manifest: from the cache next to the source, shipped with the source, or
    built (``build()`` reads every file once; the caller holds a reader lease). Cached atomically."""
    cache = manifest_cache_path(cache_dir, model, revision)
    found = [
        (o, p) for o, p in (("cache", cache), ("shipped", os.path.join(src, SHIPPED_MANIFEST))) if os.path.isfile(p)
    ]
    if found:
        origin, path = found[0]
        try:
            manifest = load_manifest(path)
        except (OSError, ValueError) as e:
            raise StageError(f"{path}: {e}; delete it so the manifest is rebuilt") from None
    elif check_mode:
        return {"origin": "would build", "path": cache, "manifest": None}
    else:
        origin, manifest = "built", build()
    if manifest.get("revision") not in (None, revision):
        raise StageError(f"manifest {cache} is for revision {manifest.get('revision')}, not {revision}")
    manifest["revision"] = revision
    changed_files = sizes_match(src, manifest)
    if changed_files:
        raise StageError(
            f"source {src} no longer matches the manifest of {revision} ({', '.join(changed_files[:5])}): a pinned "
            "revision must not change on shared storage; restore it or delete the cached manifest "
            f"{cache} if the change is intended"
        )
    if origin != "cache" and not check_mode:
        # Shared storage that every node (or, squashed, every user) may write: never through a planted link.
        try:
            safefs.write_json(cache, manifest, create_dirs=True)
        except safefs.UnsafePathError as e:
            raise StageError(f"cannot cache the manifest: {e}") from None
    return {"origin": origin, "path": cache, "manifest": manifest}
