"""Stage a pinned model revision onto node-local NVMe: hashed in the same pass as the copy,
verified against the manifest as each file lands, fsynced, published atomically, resumable,
idempotent, with a fleet-wide cap on shared-storage readers (leases) and peer fan-out.

This module is the flow of one run on one node (StageRequest: plan, check space, copy, publish,
switch `current`, GC) and where the source revision is (resolve_source, assign_files). It builds on:

    manifest.py        the manifest: format, building, reading, verifying, the shared-storage cache
    store.py           the on-disk revision store: partial dir + journal, records, publish, current, GC
    transfer.py        copying from shared storage or a peer: hashing, threads, rate limit
    stage_progress.py  the progress file and its line
    stage_errors.py    StageError, DiskFullError

Stdlib only (runs inside an Ansible module on the node and in the CLI).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .manifest import HEX40
from .stage_errors import DiskFullError, StageError
from .stage_progress import Progress
from .store import (
    Journal,
    current_target,
    disk_check,
    gc,
    model_dir,
    partial_dir,
    publish,
    reopen_published,
    revision_state,
    switch_current,
)
from .transfer import LocalSource, PeerSource, RateLimit, copy_all

# The names of this module, and the ones re-exported so that `from .stage import X` keeps working
# where X used to live here (peer.py, swarm.py, library/llmfleet_engine_cache.py, bench/, tests);
# new code imports those from their own modules.
__all__ = [
    "DiskFullError",
    "LocalSource",
    "PeerSource",
    "StageError",
    "StageRequest",
    "assign_files",
    "check_revision",
    "plan",
    "resolve_source",
    "stage",
]


def check_revision(revision: str) -> None:
    if not HEX40.match(revision or ""):
        raise StageError(
            f"revision {revision!r} is not a 40-hex commit id: branch names like 'main' move; "
            "pin the commit (model_stage_revision)"
        )


@dataclass
class StageRequest:
    root: str
    model: str
    revision: str
    manifest: dict[str, Any]
    threads: int = 4
    margin_bytes: int = 0
    keep: int = 2
    deep_verify: bool = False
    activate: bool = True
    check_mode: bool = False
    progress_path: str | None = None
    rate_limit_bytes_per_s: int = 0


def plan(req: StageRequest) -> dict[str, Any]:
    """What staging would do: files and bytes still to copy (no side effects)."""
    check_revision(req.revision)
    mdir = model_dir(req.root, req.model)
    total = sum(e["size"] for e in req.manifest["files"])
    state, todo = revision_state(mdir, req.revision, req.manifest, req.deep_verify)
    return {"state": state, "todo": todo, "total_bytes": total}


def stage(
    req: StageRequest, sources: Callable[[str], list[Any]], on_source_phase: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """Stage one revision on this node.

    ``sources(rel)`` returns the ordered sources to try for a file (peers first, shared storage
    last). ``on_source_phase()`` is a context manager entered around every read from shared
    storage (the caller holds a fleet-wide reader lease there). Returns a result dict.
    """
    check_revision(req.revision)
    mdir = model_dir(req.root, req.model)
    p = plan(req)
    result: dict[str, Any] = {
        "changed": False,
        "revision": req.revision,
        "path": os.path.join(mdir, req.revision),
        "total_bytes": p["total_bytes"],
        "bytes_to_copy": sum(e["size"] for e in p["todo"]),
        "files_to_copy": len(p["todo"]),
        "bytes_copied": 0,
        "source_bytes_read": 0,
        "peer_bytes_read": 0,
        "state_before": p["state"],
    }
    if req.check_mode:
        result["changed"] = bool(p["todo"]) or (req.activate and current_target(mdir) != req.revision)
        return result
    os.makedirs(mdir, exist_ok=True)
    if p["state"] == "published" and not p["todo"]:
        if req.activate:
            result["changed"] = switch_current(mdir, req.revision)
        result["gc"] = gc(mdir, req.keep)
        return result
    if p["state"] == "damaged":
        partial = reopen_published(mdir, req.revision, [e["path"] for e in p["todo"]])
    else:
        partial = partial_dir(mdir, req.revision)
        os.makedirs(partial, exist_ok=True)
    disk_check(mdir, result["bytes_to_copy"], req.margin_bytes)
    progress = Progress(total=result["bytes_to_copy"], path=req.progress_path, phase="copying")
    progress.flush(force=True)
    journal = Journal(partial)
    try:
        copy_all(
            p["todo"],
            partial,
            journal,
            progress,
            req.threads,
            sources=sources,
            on_source_phase=on_source_phase,
            limit=RateLimit(req.rate_limit_bytes_per_s),
        )
    finally:
        journal.close()
        progress.phase = "verifying"
        progress.flush(force=True)
    publish(mdir, partial, req.revision, req.manifest)
    result.update(
        changed=True,
        bytes_copied=progress.done,
        source_bytes_read=progress.source_bytes,
        peer_bytes_read=progress.peer_bytes,
    )
    if req.activate:
        switch_current(mdir, req.revision)
    result["gc"] = gc(mdir, req.keep)
    progress.phase = "published"
    progress.flush(force=True)
    return result


def resolve_source(source: str, revision: str) -> str:
    """The directory holding the revision's files: a plain checkpoint dir, a hub-cache repo dir
    (``models--org--name`` → ``snapshots/<revision>``), or a snapshot dir whose name must match."""
    check_revision(revision)
    src = os.path.normpath(source)
    base = os.path.basename(src)
    if base.startswith("models--"):
        snap = os.path.join(src, "snapshots", revision)
        if not os.path.isdir(snap):
            have = (
                sorted(os.listdir(os.path.join(src, "snapshots")))
                if os.path.isdir(os.path.join(src, "snapshots"))
                else []
            )
            raise StageError(
                f"{src} has no snapshot {revision} (snapshots: {', '.join(have) or 'none'}): download that revision"
            )
        return snap
    if os.path.basename(os.path.dirname(src)) == "snapshots" and HEX40.match(base) and base != revision:
        raise StageError(f"{src} is snapshot {base}, not the requested revision {revision}")
    if not os.path.isdir(src):
        raise StageError(f"source {src} is not a directory on this node (is the shared storage mounted?)")
    return src


def assign_files(files: list[dict[str, Any]], seeds: list[str]) -> dict[str, str]:
    """Split the revision's files over the seed nodes by bytes (largest first to the least
    loaded), so shared storage serves each byte once and the seeds share the reading."""
    if not seeds:
        return {}
    load = {s: 0 for s in seeds}
    out = {}
    for e in sorted(files, key=lambda e: (-e["size"], e["path"])):
        s = min(seeds, key=lambda s: (load[s], seeds.index(s)))
        out[e["path"]] = s
        load[s] += e["size"]
    return out
