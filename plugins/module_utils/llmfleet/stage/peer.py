"""Serve a node's files of one revision to its peers (HTTP on the fabric network).

Verified files (listed in the publish record or the partial dir's journal) and named by the
manifest are served whole. A file this node is still writing is served cut-through on request
(``?follow=1``): the response follows the copy as it grows, so a peer's fetch runs one chunk
behind this node's instead of after it. Receivers hash what they get and compare with the
manifest either way, so a peer is never trusted (a copy that fails here reaches them as a short
or wrong file and they try another source). ``/status`` says which files this node has and is
writing and whether it is done; ``/status?seen=SIG&wait=S`` answers as soon as that differs from
the status the caller saw (or after S seconds), so peers learn of a new file without polling.

Only the deployment's nodes are served: every request carries proof of the deployment's fabric key
(fabric_key.PEER_HEADER: an HMAC over the request, fresh, never replayed). A request without it gets 403 and
nothing else (no file, no listing), is counted and logged to the node's journal (syslog). Who asks is the
node named in that proof, never a query parameter.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..admission import Unproven
from ..fabric_key import PEER_HEADER, Refused, RequestGuard
from .store import JOURNAL, read_journal, read_record

PART = ".llmfleet-part"  # transfer.fetch_file writes a file under its name + PART until it is verified
# A file being written that has not grown for this long is abandoned (a killed run's leftover, a stuck
# source): it is not offered, and a cut-through response following it ends short (the receiver then
# tries another source). Generous: shared storage under load can pause a read for tens of seconds, and
# a receiver that gives up on its parent may end up reading shared storage itself. A following
# receiver's socket timeout (transfer.FOLLOW_TIMEOUT_S) is longer, so it hears of a stall from here.
STALL_S = 120.0
STATUS_WAIT_MAX_S = 10.0
# How often a waiting request looks at the local disk again (no network in the loop): a cut-through
# response for the next bytes, a status long poll (each look reads the journal) for a new file.
_TICK_S = 0.02
_STATUS_TICK_S = 0.1
REFUSED_KEEP = 10
# A connection must send its request (and its proof) within this many seconds; until its proof is checked it counts
# against its address, which may hold at most MAX_UNVERIFIED_PER_ADDR such connections (a node's own long polls and
# copies send their proof at once): a stranger's silent or slow connections cost a bounded number of threads.
REQUEST_TIMEOUT_S = 10.0
MAX_UNVERIFIED_PER_ADDR = 64


def _journal(message: str) -> None:
    try:
        import syslog  # not on every platform; staging runs on Linux nodes

        syslog.syslog(syslog.LOG_WARNING | syslog.LOG_AUTH, message)
    except Exception:  # noqa: S110 (a refusal is counted in the result either way)
        pass


class PeerState:
    def __init__(self, mdir: str, revision: str, manifest: dict[str, Any], host: str, *, key: bytes) -> None:
        self.guard = RequestGuard(key)  # ValueError without a key: no peer server answers strangers
        self.refused = 0  # requests without valid proof of the key
        self.refused_from: list[str] = []  # the first REFUSED_KEEP of them: "address: why"
        self.mdir = mdir
        self.revision = revision
        self.sizes = {e["path"]: e["size"] for e in manifest["files"]}
        self.names = set(self.sizes)
        self.host = host
        self.done = False  # this node finished (published or failed) and only serves now
        self.failed: str | None = None
        self.served_bytes = 0
        self.serving = 0  # responses sending a file now: receivers prefer the least busy peer
        self.seen_done: set[str] = set()  # peers that were told this node is done
        self._lock = threading.Lock()

    def locate(self, rel: str) -> str | None:
        """Where a file of the revision is, published or still in the partial dir. Files reach
        their final name in the partial dir only after verification (and receivers re-verify),
        and publishing renames the dir, so both places are tried."""
        if rel not in self.names:
            return None
        for d in (os.path.join(self.mdir, self.revision), os.path.join(self.mdir, f".partial-{self.revision}")):
            path = os.path.join(d, rel)
            if os.path.isfile(path):
                return path
        return None

    def writing(self, rel: str) -> str | None:
        """The file this node is writing under rel (it grew in the last STALL_S seconds), or None."""
        if rel not in self.names:
            return None
        path = os.path.join(self.mdir, f".partial-{self.revision}", rel + PART)
        try:
            st = os.stat(path)
        except OSError:
            return None
        return path if time.time() - st.st_mtime < STALL_S else None

    def status(self) -> dict[str, Any]:
        rdir = os.path.join(self.mdir, self.revision)
        pub = read_record(self.mdir, self.revision) is not None and os.path.isdir(rdir)
        if pub:
            have = sorted(self.names)
        else:
            have = sorted(set(read_journal(os.path.join(self.mdir, f".partial-{self.revision}"))) & self.names)
        held = set(have)
        st = {
            "host": self.host,
            "revision": self.revision,
            "published": pub,
            "have": have,
            "writing": sorted(r for r in self.names - held if self.writing(r)),
            "done": self.done,
            "failed": self.failed,
        }
        # What a waiting peer reacts to; the load changes too often to wake anybody for it.
        st["sig"] = hashlib.sha256(json.dumps(st, sort_keys=True).encode()).hexdigest()[:16]
        st["serving"] = self.serving
        return st

    def status_after(self, seen: str, wait: float) -> dict[str, Any]:
        """The status once its signature is not `seen`, or after `wait` seconds (at most STATUS_WAIT_MAX_S)."""
        end = time.monotonic() + min(max(wait, 0.0), STATUS_WAIT_MAX_S)
        st = self.status()
        while st["sig"] == seen and time.monotonic() < end:
            time.sleep(_STATUS_TICK_S)
            st = self.status()
        return st

    def refuse(self, client: str, why: str) -> None:
        with self._lock:
            self.refused += 1
            n = self.refused
            if len(self.refused_from) < REFUSED_KEEP:
                self.refused_from.append(f"{client}: {why}")
        if n <= REFUSED_KEEP or n % 1000 == 0:  # the journal hears of a flood without being flooded
            _journal(f"llmfleet staging peer server {self.host}: refused a request from {client} ({n} so far): {why}")

    def add_served(self, n: int) -> None:
        with self._lock:
            self.served_bytes += n

    def _busy(self, d: int) -> None:
        with self._lock:
            self.serving += d


def make_server(state: PeerState, bind: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S  # for the request and its headers; lifted once the proof is checked

        def log_message(self, *args: Any) -> None:  # keep module output clean
            pass

        def finish(self) -> None:
            server.verified(self)
            super().finish()

        def _asker(self) -> str | None:
            """The node the request's proof names (None: refused with 403)."""
            server.verified(self)
            try:
                asker = state.guard.check(self.headers.get(PEER_HEADER), "GET", self.path)
            except Refused as e:
                state.refuse(f"{self.client_address[0]}:{self.client_address[1]}", str(e))
                self.send_error(403, "not a node of this deployment")
                return None
            self.connection.settimeout(None)  # a node's copy: STALL_S and the client's own deadlines bound it
            return asker

        def do_GET(self) -> None:
            asker = self._asker()
            if asker is None:
                return
            url = urllib.parse.urlsplit(self.path)
            path = urllib.parse.unquote(url.path)
            query = urllib.parse.parse_qs(url.query)
            if path == "/status":
                try:
                    wait = float(query.get("wait", ["0"])[0])
                except ValueError:
                    wait = 0.0
                seen = query.get("seen", [""])[0]
                st = state.status_after(seen, wait) if seen else state.status()
                if st["done"]:
                    state.seen_done.add(asker)  # the node its proof names (a `from=` anyone could write is ignored)
                body = json.dumps(st).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            rel = path[len("/files/") :] if path.startswith("/files/") else None
            if not rel or rel.endswith(JOURNAL) or rel not in state.names:
                self.send_error(404, "not a file of this revision")
                return
            local = state.locate(rel)
            growing = None if local or query.get("follow") != ["1"] else state.writing(rel)
            try:
                f = open(local or growing or "", "rb")
            except OSError:
                local = state.locate(rel) if growing else None  # verified and renamed in between
                try:
                    f = open(local or "", "rb")
                except OSError:
                    self.send_error(404, "not a verified file of this revision here")
                    return
            state._busy(1)
            try:
                with f:
                    size = os.fstat(f.fileno()).st_size if local else state.sizes[rel]
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(size))
                    self.end_headers()
                    sent = self.connection.sendfile(f) if local else _follow(f, self.connection, size)
                    state.add_served(sent)
            finally:
                state._busy(-1)

    server = _Server((bind, port), Handler)
    server.daemon_threads = True
    server.state = state
    return server


class _Server(ThreadingHTTPServer):
    # socketserver listens with a backlog of 5. Every peer's status long poll and copy threads connect at once:
    # past 5 the kernel dropped the SYN and the client's retransmit came 1 s later (then 3 s, 7 s).
    request_queue_size = 1024
    state: PeerState | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unverified = Unproven(MAX_UNVERIFIED_PER_ADDR)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Whether to serve a new connection: not when its address holds MAX_UNVERIFIED_PER_ADDR connections whose
        proof is not checked yet (closed at once, counted as refused)."""
        held = self._unverified.admit(str(client_address[0]))
        if held is not None and self.state is not None:
            self.state.refuse(str(client_address[0]), f"{held} of its connections have not sent their request yet "
                              f"(at most {MAX_UNVERIFIED_PER_ADDR} per address)")  # fmt: skip
        return held is None

    def verified(self, handler: Any) -> None:
        """The handler's connection no longer counts against its address (its proof was checked, or it ended)."""
        if not getattr(handler, "_llmfleet_verified", False):
            handler._llmfleet_verified = True
            self._unverified.release(str(handler.client_address[0]))


def _follow(f: Any, sock: Any, size: int) -> int:
    """Send a file that is still being written, up to `size` bytes, as it grows. Ends short when the
    writer gave up: the file was removed (a failed copy), truncated (a copy restarted), or has not
    grown for STALL_S seconds. Returns the bytes sent."""
    fd = f.fileno()
    sent, last_growth = 0, time.monotonic()
    while sent < size:
        st = os.fstat(fd)
        if st.st_size < sent:
            break
        avail = min(st.st_size, size) - sent
        if avail > 0:
            sent += sock.sendfile(f, sent, avail)
            last_growth = time.monotonic()
            continue
        if st.st_nlink == 0 or time.monotonic() - last_growth > STALL_S:
            break
        time.sleep(_TICK_S)
    return sent


def serve_in_background(state: PeerState, bind: str, port: int) -> ThreadingHTTPServer:
    server = make_server(state, bind, port)
    # shutdown() waits for the loop's next look at its flag: every 0.5 s by default, half a second at the end of
    # every staging run (measured on 16 cores: 0.6 s between the last node's copy and the run's end)
    poll = {"poll_interval": 0.05}
    threading.Thread(target=server.serve_forever, kwargs=poll, name="peer-server", daemon=True).start()
    return server
