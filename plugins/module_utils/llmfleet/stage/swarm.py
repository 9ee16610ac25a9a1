"""Stage a revision on one node as part of a fleet: seeds read their share of the files from
shared storage (under a fleet-wide reader lease), every node serves what it has verified, and
every node fetches the rest from peers (verifying each file against the manifest). Shared
storage therefore reads each byte once per run, whatever the node count.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import lease as lease_module
from .errors import LeaseLostError, StageError
from .lease import Lease, SharedLease
from .peer import PeerState, serve_in_background
from .staging import StageRequest, assign_files, stage
from .store import LOCK, ModelLock, ensure_model_dir, model_dir
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


# Every node passes a file on to at most this many others (a binary tree per file). 1 (a chain per file, the
# seed sending each file once) was measured slower: same wall time at 4 nodes, 1.5x at 8 (the depth adds up per
# file); docs/measurements/device-runs/2026-12-03-h200x1-stage-fanout-pinned.
RELAY_FANOUT = 2


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
    relay_fanout: int = RELAY_FANOUT
    # The deployment's fabric key (fabric_key.py): every peer request proves it, the peer server serves nobody
    # else. Needed whenever this node serves or has peers.
    peer_key: bytes = field(default=b"", repr=False)
    # Directories a link in the source may point into (manifest.source_bounds); any other link out is refused.
    source_allow_links_into: list[str] = field(default_factory=list)


def _refused(e: BaseException) -> bool:
    return isinstance(e, ConnectionRefusedError) or isinstance(getattr(e, "reason", None), ConnectionRefusedError)


STATUS_WAIT_S = 5.0  # one long poll of a peer's /status


class StatusBoard:
    """Peers' /status as it changes: one thread per peer long-polls it (peer.py answers when its
    status changes), and whoever waits for a file wakes on the change (no polling interval)."""

    def __init__(self, peers: dict[str, PeerSource], me: str = "") -> None:
        self.peers = peers
        self.me = me
        self.status: dict[str, dict[str, Any]] = {}
        self.last_seen: dict[str, float] = {}
        self.fresh: set[str] = set()
        self.closed: set[str] = set()
        self.first_try = time.monotonic()
        self.changed = threading.Condition()
        self._stop = threading.Event()

    def start(self) -> StatusBoard:
        for h in self.peers:
            threading.Thread(target=self._watch, args=(h,), name=f"status-{h}", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self, h: str) -> None:
        seen = ""
        while not self._stop.is_set():
            try:
                st = self.peers[h].status(seen, STATUS_WAIT_S)
            except Exception as e:  # any failure of one peer's answer: its watcher must go on
                with self.changed:
                    if h in self.last_seen and _refused(e):
                        self.closed.add(h)  # it served before and stopped: finished or dead
                    # Keep the last status (a peer that said "done" and then stopped serving is
                    # done), but never fetch from a peer that did not answer this round.
                    self.fresh.discard(h)
                    self.changed.notify_all()
                seen = ""
                self._stop.wait(0.25)  # not up yet or gone: ask again soon, not in a tight loop
                continue
            with self.changed:
                self.status[h] = st
                self.last_seen[h] = time.monotonic()
                self.fresh.add(h)
                self.closed.discard(h)
                self.changed.notify_all()
            seen = st.get("sig") or ""
            if not seen:
                self._stop.wait(0.25)  # a peer without long polls (an older llmfleet): plain polling

    def wait(self, timeout: float) -> None:
        """Until some peer's status changed, or timeout seconds. Call with self.changed held."""
        self.changed.wait(timeout)

    def holders(self, rel: str) -> list[str]:
        return [h for h, st in self.status.items() if h in self.fresh and rel in st.get("have", ())]

    def writers(self, rel: str) -> list[str]:
        return [h for h, st in self.status.items() if h in self.fresh and rel in st.get("writing", ())]

    def load(self, host: str) -> int:
        return int(self.status.get(host, {}).get("serving") or 0)

    def gone(self, host: str, dead_after: float) -> bool:
        """The peer failed, or has not answered for dead_after seconds."""
        st = self.status.get(host)
        if (st and st.get("failed")) or host in self.closed:
            return True
        seen = self.last_seen.get(host, self.first_try)
        return time.monotonic() - seen > dead_after

    def all_done(self, dead_after: float) -> bool:
        """Every peer finished, failed or stopped answering (so nobody still needs our files)."""
        return all(
            self.status.get(h, {}).get("done") or h in self.closed or self.gone(h, dead_after) for h in self.peers
        )


def choose(
    board: StatusBoard,
    rel: str,
    parent: str | None,
    owner: str | None,
    tried: set[str],
    *,
    dead_after: float,
    fanout: int = RELAY_FANOUT,
) -> tuple[str | None, bool]:
    """The peer to take rel from next, and whether to wait for the board to change first (none has
    it yet, but one that will is alive). Peers in tried failed already. In order: the tree parent
    when it has the file or is writing it (cut-through); else a peer other than the file's seed
    that has it whole and sends fewer than RELAY_FANOUT files now (the least busy; the seed is
    also reading shared storage, and late nodes would all land on it); else, when the parent
    cannot help (none, failed, gone), the least busy peer that has it or is writing it."""
    have = [h for h in board.holders(rel) if h not in tried]
    busy = [h for h in board.writers(rel) if h not in tried]
    if parent and parent not in tried and (parent in have or parent in busy):
        return parent, False
    spare = [h for h in have if h != owner and board.load(h) < fanout]
    if spare:
        return min(spare, key=board.load), False
    parent_alive = parent is not None and parent not in tried and not board.gone(parent, dead_after)
    if (have or busy) and not parent_alive:
        return min(have or busy, key=board.load), False
    cands = [c for c in (parent, owner) if c and c not in tried] or [h for h in board.peers if h not in tried]
    return None, any(not board.gone(c, dead_after) for c in cands)


def relay_parent(rel: str, me: str, owner: str | None, hosts: list[str], fanout: int = RELAY_FANOUT) -> str | None:
    """Whom `me` takes `rel` from when everything goes to plan: the nodes form a `fanout`-ary tree
    per file with the file's owner (the seed reading it from shared storage) at the root and the
    others in an order rotated by the file, so each node passes on about as much as it receives
    and no node (the seed least of all) sends one file to every other. None for the root, or
    when rel has no owner (every node then takes it from whoever has it)."""
    if owner is None or owner == me or me not in hosts:
        return None
    rest = sorted(h for h in hosts if h != owner)
    k = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % len(rest)
    order = [owner, *rest[k:], *rest[:k]]
    return order[(order.index(me) - 1) // fanout]


def run_node(req: StageRequest, cfg: SwarmConfig) -> dict[str, Any]:
    mdir = model_dir(req.root, req.model)
    if req.check_mode:
        return stage(req, lambda rel: [])
    ensure_model_dir(mdir)  # refuses a model root or dir another account can write, before anything is written
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


def _serve_until_peers_done(board: StatusBoard, state: PeerState, cfg: SwarmConfig) -> None:
    """Keep serving until every peer is done (or finish_wait): they may still need our files. And
    until every peer still there has seen us done: one that never reached us would otherwise wait
    for us until peer_dead_after (one that saw us, then finds the port closed, counts us as done)."""
    end = time.monotonic() + cfg.finish_wait
    with board.changed:
        while time.monotonic() < end:
            if board.all_done(cfg.peer_dead_after):
                if all(h in state.seen_done or board.gone(h, cfg.peer_dead_after) for h in board.peers):
                    return
                board.wait(0.05)  # what we wait for now is a peer's next status request, not a change
                continue
            board.wait(min(1.0, max(0.0, end - time.monotonic())))


def _run_locked(req: StageRequest, cfg: SwarmConfig, mdir: str) -> dict[str, Any]:
    others = {h: u for h, u in cfg.peers.items() if h != cfg.me}
    if (cfg.serve_port or others) and not cfg.peer_key:
        raise StageError(f"{cfg.me}: staging with peers needs the deployment's fabric key (peer_key_file)")
    # A lone node (no peers, not serving) starts no server: its state's key is a throwaway.
    state = PeerState(mdir, req.revision, req.manifest, cfg.me, key=cfg.peer_key or secrets.token_bytes(32))
    server = _serve(state, cfg, mdir) if cfg.serve_port else None
    peers = {h: PeerSource(u, key=cfg.peer_key, me=cfg.me) for h, u in others.items()}
    board = StatusBoard(peers, cfg.me).start()
    assignment = assign_files(req.manifest["files"], [s for s in cfg.seeds if s in cfg.peers or s == cfg.me])
    hosts = sorted({*cfg.peers, cfg.me})
    local = LocalSource(cfg.source_dir, cfg.source_allow_links_into)
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

    def pick(rel: str, owner: str | None, parent: str | None, tried: set[str]) -> str | None:
        deadline = time.monotonic() + cfg.peer_wait
        with board.changed:
            while True:
                h, wait = choose(
                    board, rel, parent, owner, tried, dead_after=cfg.peer_dead_after, fanout=cfg.relay_fanout
                )
                if not wait or time.monotonic() >= deadline:
                    return h
                board.wait(min(1.0, max(0.0, deadline - time.monotonic())))

    def sources(rel: str) -> Iterator[Any]:
        owner = assignment.get(rel)
        if not peers or owner == cfg.me:
            yield local
            return
        parent = relay_parent(rel, cfg.me, owner, hosts, cfg.relay_fanout)
        tried: set[str] = set()
        while (h := pick(rel, owner, parent, tried)) is not None:
            tried.add(h)
            yield peers[h].following()
        fallbacks.append(rel)
        yield local

    result: dict[str, Any] = {}
    try:
        result = stage(req, sources, lease, locked=True, check=lease_check(lease, cfg.me))
    except Exception as e:
        state.failed = str(e)
        raise
    finally:
        state.done = True
        if server and not req.check_mode and peers:
            _serve_until_peers_done(board, state, cfg)
        board.stop()
        if server:
            with contextlib.suppress(Exception):
                server.shutdown()
                server.server_close()
    result.update(
        served_bytes=state.served_bytes,
        peer_refused=state.refused,
        peer_refused_from=state.refused_from,
        reader_intervals=lease.intervals,
        source_fallback_files=fallbacks,
        seed=cfg.me in assignment.values(),
        assigned_files=sum(1 for v in assignment.values() if v == cfg.me),
        cpu_s=round(sum(os.times()[:2]), 2),  # what staging cost this node: copy threads, hashing, serving
    )
    return result


__all__ = ["StageError", "SwarmConfig", "lease_check", "run_node"]
