"""Stage a revision on one node as part of a fleet: seeds read their share of the files from
shared storage (under a fleet-wide reader lease), every node serves what it has verified, and
every node fetches the rest from peers (verifying each file against the manifest). Shared
storage therefore reads each byte once per run, whatever the node count.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import lease as lease_module
from .lease import Lease, SharedLease
from .peer import PeerState, serve_in_background
from .stage import StageRequest, assign_files, stage
from .stage_errors import LeaseLostError, StageError
from .store import LOCK, ModelLock, model_dir
from .transfer import LocalSource, PeerSource


def lease_check(lease: Any, where: str) -> Callable[[], None] | None:
    """A check() for the copy loops, run between the chunks read from shared storage: runs
    lease.check() (cheap: no I/O while the last renewal is recent) and turns lease.LeaseLost into
    a LeaseLostError that says what happened and that a rerun resumes. None when the lease has no
    check()."""
    check = getattr(lease, "check", None)
    if check is None:
        return None

    def run() -> None:
        try:
            check()
        except Exception as e:
            lost = getattr(lease_module, "LeaseLost", None)
            if lost is None or not isinstance(e, lost):
                raise
            raise LeaseLostError(
                f"lost the shared-storage reader lease on {where} ({e}): stopped reading shared storage; the "
                "files verified so far are kept and the file being copied was removed; rerun to resume"
            ) from None

    return run


@dataclass
class SwarmConfig:
    me: str
    source_dir: str
    lease_dir: str
    max_source_readers: int = 2
    peers: dict[str, str] = field(default_factory=dict)  # host -> http://ip:port (may include me)
    seeds: list[str] = field(default_factory=list)
    serve_bind: str = "0.0.0.0"  # noqa: S104 (the fabric address is passed in by the role)
    serve_port: int = 0  # 0: do not serve
    lease_ttl: float = 120.0
    lease_timeout: float = 3600.0
    peer_wait: float = 3600.0
    peer_dead_after: float = 60.0
    finish_wait: float = 600.0


def _refused(e: BaseException) -> bool:
    return isinstance(e, ConnectionRefusedError) or isinstance(getattr(e, "reason", None), ConnectionRefusedError)


class StatusBoard:
    """Peers' /status, refreshed at most every 0.5 s, shared by the copy threads."""

    def __init__(self, peers: dict[str, PeerSource]) -> None:
        self.peers = peers
        self.status: dict[str, dict[str, Any]] = {}
        self.last_seen: dict[str, float] = {}
        self.fresh: set[str] = set()
        self.closed: set[str] = set()
        self.first_try = time.monotonic()
        self._t = 0.0
        self._lock = threading.Lock()

    def refresh(self) -> None:
        with self._lock:
            if time.monotonic() - self._t < 0.5:
                return
            self._t = time.monotonic()
            for h, ps in self.peers.items():
                try:
                    self.status[h] = ps.status()
                    self.last_seen[h] = time.monotonic()
                    self.fresh.add(h)
                except (OSError, ValueError) as e:
                    if h in self.last_seen and _refused(e):
                        self.closed.add(h)  # it served before and stopped: finished or dead
                    # Keep the last status (a peer that said "done" and then stopped serving is
                    # done), but never fetch from a peer that did not answer this round.
                    self.fresh.discard(h)

    def holders(self, rel: str) -> list[str]:
        return [h for h, st in self.status.items() if h in self.fresh and rel in st.get("have", ())]

    def gone(self, host: str, dead_after: float) -> bool:
        """The peer failed, or has not answered for dead_after seconds."""
        st = self.status.get(host)
        if st and st.get("failed"):
            return True
        seen = self.last_seen.get(host, self.first_try)
        return time.monotonic() - seen > dead_after

    def all_done(self, dead_after: float) -> bool:
        """Every peer finished, failed or stopped answering (so nobody still needs our files)."""
        return all(
            self.status.get(h, {}).get("done") or h in self.closed or self.gone(h, dead_after) for h in self.peers
        )


def run_node(req: StageRequest, cfg: SwarmConfig) -> dict[str, Any]:
    mdir = model_dir(req.root, req.model)
    if req.check_mode:
        return stage(req, lambda rel: [])
    os.makedirs(mdir, exist_ok=True)
    # The model's lock first: a second run while the first one's job is alive (lost SSH, a wait that
    # timed out, two operators) waits or says who holds it, before it binds the same peer port.
    lock = ModelLock(mdir, req.revision, req.run_by)
    lock.acquire(req.lock_wait)
    try:
        return _run_locked(req, cfg, mdir)
    finally:
        lock.release()


def _serve(state: PeerState, cfg: SwarmConfig, mdir: str) -> Any:
    try:
        return serve_in_background(state, cfg.serve_bind, cfg.serve_port)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        raise StageError(
            f"{cfg.me}: peer port {cfg.serve_bind}:{cfg.serve_port} is already in use, not by a staging run of "
            f"{os.path.basename(mdir)} (this run holds its lock {os.path.join(mdir, LOCK)}) but by a run of another "
            "model whose derived port is the same, or another server: set model_stage_peer_port to a free port"
        ) from None


def _run_locked(req: StageRequest, cfg: SwarmConfig, mdir: str) -> dict[str, Any]:
    state = PeerState(mdir, req.revision, req.manifest, cfg.me)
    server = _serve(state, cfg, mdir) if cfg.serve_port else None
    peers = {h: PeerSource(u) for h, u in cfg.peers.items() if h != cfg.me}
    board = StatusBoard(peers)
    assignment = assign_files(req.manifest["files"], [s for s in cfg.seeds if s in cfg.peers or s == cfg.me])
    local = LocalSource(cfg.source_dir)
    lease = SharedLease(
        Lease(
            cfg.lease_dir,
            cfg.max_source_readers,
            ttl=cfg.lease_ttl,
            host=cfg.me,
            label=f"{req.model}@{req.revision[:12]}",
        ),
        timeout=cfg.lease_timeout,
    )
    fallbacks: list[str] = []

    def sources(rel: str) -> list[Any]:
        owner = assignment.get(rel)
        if not peers or owner == cfg.me:
            return [local]
        deadline = time.monotonic() + cfg.peer_wait
        while time.monotonic() < deadline:
            board.refresh()
            have = board.holders(rel)
            if have:
                have.sort(key=lambda h: h != owner)  # the owner first: it has the file in page cache
                return [peers[h] for h in have] + [local]
            candidates = [owner] if owner else list(peers)
            if all(board.gone(h, cfg.peer_dead_after) for h in candidates):
                break
            time.sleep(0.25)
        fallbacks.append(rel)
        return [local]

    result: dict[str, Any] = {}
    try:
        result = stage(req, sources, lease, locked=True, check=lease_check(lease, cfg.me))
    except Exception as e:
        state.failed = str(e)
        raise
    finally:
        state.done = True
        if server and not req.check_mode:
            # Keep serving until every peer is done (or the deadline): they may still need our files.
            end = time.monotonic() + cfg.finish_wait
            while time.monotonic() < end and peers:
                board._t = 0.0
                board.refresh()
                if board.all_done(cfg.peer_dead_after):
                    time.sleep(1.0)  # linger so peers polling us can see "done" before we close
                    break
                time.sleep(0.5)
        if server:
            with contextlib.suppress(Exception):
                server.shutdown()
                server.server_close()
    result.update(
        served_bytes=state.served_bytes,
        reader_intervals=lease.intervals,
        source_fallback_files=fallbacks,
        seed=cfg.me in assignment.values(),
        assigned_files=sum(1 for v in assignment.values() if v == cfg.me),
    )
    return result


__all__ = ["StageError", "SwarmConfig", "lease_check", "run_node"]
