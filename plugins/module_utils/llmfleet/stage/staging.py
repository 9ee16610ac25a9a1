"""Stage a pinned model revision onto node-local NVMe: hashed in the same pass as the copy,
verified against the manifest as each file lands, fsynced, published atomically, resumable,
idempotent, with a fleet-wide cap on shared-storage readers (leases) and peer fan-out.

This module is the flow of one run on one node (StageRequest: take the model's lock, plan, check
space, copy or repair, publish, switch `current`, GC) and where the source revision is
(resolve_source, assign_files). It builds on:

    manifest.py        the manifest: format, building, reading, verifying, the shared-storage cache
    store.py           the on-disk revision store: partial dir + journal, records, publish, repair,
                       current, the per-model lock, GC
    transfer.py        copying from shared storage or a peer: hashing, threads, rate limit
    progress.py        the progress file and its line
    errors.py          StageError, DiskFullError, LeaseLostError, LockedError

Stdlib only (runs inside an Ansible module on the node and in the CLI).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..facts import HEX40, revision_problem
from .errors import DiskFullError, StageError
from .manifest import MANIFEST_FORMAT, check_against_source, manifest_digest, stat_manifest
from .progress import Progress
from .store import (
    UNIT_GLOB,
    Journal,
    ModelLock,
    current_target,
    disk_check,
    ensure_model_dir,
    finish_published,
    gc,
    make_partial,
    model_dir,
    open_model_dir,
    open_repair,
    partial_dir,
    publish,
    read_journal,
    read_record,
    revision_state,
    switch_current,
)
from .transfer import LocalCopy, LocalSource, PeerSource, RateLimit, copy_all, source_identity

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
    "sizes_manifest",
    "stage",
]


def check_revision(revision: str) -> None:
    problem = revision_problem(revision, "revision")
    if problem:
        raise StageError(problem)


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
    lock_wait: float = 0.0  # seconds to wait for another staging run of the model to finish
    unit_glob: str = UNIT_GLOB  # installed engine units: GC never deletes a revision they name
    run_by: str = ""  # who started the run (recorded in the lock, shown to a second run)
    # A first run without a manifest: the source directory whose copy builds it (manifest: sizes_manifest;
    # one read of the source instead of two; transfer.fetch_file's learn).
    build_from: str = ""


def sizes_manifest(src: str, revision: str, allow_links_into: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """The manifest a run with StageRequest.build_from starts from: every file of the source with its size
    and no sha256 yet (each one is filled by its copy)."""
    return {**stat_manifest(src, allow_links_into), "format": MANIFEST_FORMAT, "revision": revision}


def _known_sha256(req: StageRequest, mdir: str) -> None:
    """build_from: the sha256 of the files an earlier run already has: copied into the partial dir from
    the same source file, unchanged since (the journal records its identity), or published (the
    record). Those files are then verified as with any manifest; the others are hashed as they land."""
    rec = read_record(mdir, req.revision) if os.path.isdir(os.path.join(mdir, req.revision)) else None
    recorded = {e.get("path"): e for e in ((rec or {}).get("manifest") or {}).get("files", [])}
    journal = read_journal(partial_dir(mdir, req.revision))
    for e in req.manifest["files"]:
        if e["sha256"]:
            continue
        j, r = journal.get(e["path"]), recorded.get(e["path"])
        if j and j.get("size") == e["size"] and isinstance(j.get("source"), list):
            try:
                now = list(source_identity(os.stat(os.path.join(req.build_from, e["path"]))))
            except OSError:
                now = None
            if now == j["source"]:
                e["sha256"] = j["sha256"]
                continue
        if r and r.get("size") == e["size"] and isinstance(r.get("sha256"), str):
            e["sha256"] = r["sha256"]


def plan(req: StageRequest) -> dict[str, Any]:
    """What staging would do: files and bytes still to copy (no side effects)."""
    check_revision(req.revision)
    mdir = model_dir(req.root, req.model)
    fd = open_model_dir(mdir, create=False)  # refuses a model root or dir another account can write
    if fd is not None:
        os.close(fd)
    total = sum(e["size"] for e in req.manifest["files"])
    state, todo = revision_state(mdir, req.revision, req.manifest, req.deep_verify)
    return {"state": state, "todo": todo, "total_bytes": total}


def stage(
    req: StageRequest,
    sources: Callable[[str], Iterable[Any]],
    on_source_phase: Callable[[], Any] | None = None,
    *,
    locked: bool = False,
    check: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Stage one revision on this node.

    ``sources(rel)`` returns the ordered sources to try for a file (peers first, shared storage
    last). ``on_source_phase()`` is a context manager entered around every read from shared
    storage (the caller holds a fleet-wide reader lease there); ``check()`` runs between the chunks
    read there and raises when the lease is lost. The run holds the model's lock (waiting at most
    ``req.lock_wait``) unless the caller already does (``locked``). Returns a result dict.
    """
    check_revision(req.revision)
    mdir = model_dir(req.root, req.model)
    if req.check_mode:
        p = plan(req)
        return {
            "changed": p["state"] != "published" or (req.activate and current_target(mdir) != req.revision),
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
    ensure_model_dir(mdir)  # root-owned and only root's, before anything is written (store.open_model_dir)
    held = contextlib.nullcontext() if locked else ModelLock(mdir, req.revision, req.run_by).held(req.lock_wait)
    with held:
        t0 = time.monotonic()
        result = _stage_locked(req, mdir, sources, on_source_phase, check)
    # Wall time of the work under the lock (plan, copy, verify, publish, GC): the report's GiB/s per node.
    result["elapsed_s"] = round(time.monotonic() - t0, 3)
    return result


def _stage_locked(
    req: StageRequest,
    mdir: str,
    sources: Callable[[str], Iterable[Any]],
    on_source_phase: Callable[[], Any] | None,
    check: Callable[[], None] | None,
) -> dict[str, Any]:
    if req.build_from:
        _known_sha256(req, mdir)  # under the lock, as the plan
    p = plan(req)  # under the lock: another run may have changed the store while we waited
    rdir = os.path.join(mdir, req.revision)
    result: dict[str, Any] = {
        "changed": False,
        "revision": req.revision,
        "path": rdir,
        "total_bytes": p["total_bytes"],
        "bytes_to_copy": sum(e["size"] for e in p["todo"]),
        "files_to_copy": len(p["todo"]),
        "bytes_copied": 0,
        "source_bytes_read": 0,
        "peer_bytes_read": 0,
        "state_before": p["state"],
    }

    def collect() -> None:
        # The revision just staged is never collected, whatever keep says (keep 0, activate false).
        result["gc"] = gc(mdir, req.keep, {req.revision}, unit_glob=req.unit_glob, lock_held=True)
        if result["gc"]["removed"] or result["gc"]["removed_partials"]:
            result["changed"] = True

    if p["state"] == "published":
        finish_published(rdir)
        if req.activate:
            result["changed"] = switch_current(mdir, req.revision)
        collect()
        return result
    todo, fetch = p["todo"], sources
    if p["state"] == "damaged":
        # Repair beside the published revision, which stays intact (and `current` untouched) until
        # the repaired copy is verified and swapped in.
        partial, unlinkable = open_repair(mdir, req.revision, req.manifest, todo)
        todo = todo + unlinkable
        own = LocalCopy(rdir)
        intact = {e["path"] for e in unlinkable}

        def fetch(rel: str) -> Iterable[Any]:
            return [own] if rel in intact else sources(rel)

        why = f"repairing {req.revision[:12]}: {len(p['todo'])} damaged file(s) to re-fetch"
        if unlinkable:
            why += f", {len(unlinkable)} intact file(s) to copy as the filesystem refused hard links"
    else:
        partial = make_partial(mdir, req.revision)
        why = f"{len(todo)} file(s) of {req.revision[:12]} still missing"
    need = sum(e["size"] for e in todo)
    result.update(bytes_to_copy=need, files_to_copy=len(todo))
    disk_check(mdir, need, req.margin_bytes, why, req.revision)
    progress = Progress(total=need, path=req.progress_path, phase="copying")
    progress.flush(force=True)
    journal = Journal(partial)
    try:
        copy_all(
            todo,
            partial,
            journal,
            progress,
            req.threads,
            sources=fetch,
            on_source_phase=on_source_phase,
            limit=RateLimit(req.rate_limit_bytes_per_s),
            check=check,
            learn=bool(req.build_from),
        )
    finally:
        journal.close()
        progress.phase = "verifying"
        progress.flush(force=True)
    if req.build_from:
        # The manifest built from the copies, checked against what the source says of itself (a hub
        # cache's blob names and git ids, LFS pointers, sha256 lists) before anything is published.
        result["upstream"] = check_against_source(
            req.build_from, req.manifest, req.revision, rehash_small=False,
            fix="stage with --manifest naming a manifest of the revision",
        )  # fmt: skip
        result["manifest_sha256"] = manifest_digest(req.manifest)
    publish(mdir, partial, req.revision, req.manifest)
    result.update(
        changed=True,
        bytes_copied=progress.done,
        source_bytes_read=progress.source_bytes,
        peer_bytes_read=progress.peer_bytes,
    )
    if req.activate:
        switch_current(mdir, req.revision)
    collect()
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
