"""The deployment link: the wrappers of one multi-node deployment watch each other, so the deployment (not
a node) is the unit of failure and restart.

Why: after one node's engine dies, its peers sit in a collective until the engine's distributed timeout
(600 s in vLLM) holding their GPUs, and a lone node restarted by systemd cannot rendezvous with them. With
the link, the head's wrapper listens on the fabric and every worker's wrapper holds a TCP connection to it
with a heartbeat each way. When any engine ends without a stop request, its wrapper says so (FAIL), the
head tells every node to stop (STOP), and each wrapper stops its engine and exits EXIT_PEER_FAILED, so
``Restart=on-failure`` brings every node back together: workers start their engine only once the head's
wrapper welcomes them (rank order: head first). A node that vanishes (SIGKILLed wrapper, lost network)
counts as failed after ``timeout`` seconds without a heartbeat. A stop on request anywhere stops every
node with exit 0 (stopping one node of a TP x PP world stops the deployment; nothing restarts).

The barrier: a head given its workers' names (``peers``) starts no engine until every one of them has joined; it
answers each joined worker ``WAIT <missing,...>`` until then and ``WELCOME`` to all at once when the last one
joins. So after a failure (a crash, a partition) no engine starts on part of the world and dies in its rendezvous:
the nodes meet at the link first, however long the missing node takes (a partition that heals, a host that
reboots), up to the wait's deadline, naming the missing node meanwhile (``on_wait``: the journal, the status file,
the metrics). A worker that loses the head while it waits joins again; a joined worker that goes away before the
welcome is missing again, not a failure (no engine runs yet).

Only the deployment's nodes take part: each wrapper holds the deployment's fabric key (a root-only credential,
fabric_key.py). A connection starts with a challenge-response both ways: worker -> head ``HELLO <node>
<worker-nonce>``, head -> worker ``CHALLENGE <head-nonce> <head-proof>`` (an HMAC of the key over the node and
both nonces: the worker knows it talks to the real head), worker -> head ``AUTH <worker-proof>``. A peer that
fails it is refused and logged, never acted on: its connection does not count as a node lost. Every later line
carries a tag (HMAC under a key of this connection, over its direction and sequence number): a line injected
into the stream or replayed ends the connection like a lost peer instead of being obeyed.

Protocol after that (one line each, ASCII, each followed by its tag): head -> worker ``WAIT <node,...>`` (the
barrier still misses those), ``WELCOME``, ``BUSY`` (the head is stopping: try again) or ``UNKNOWN`` (not one of the
head's peers), both ways ``PING``, worker -> head ``FAIL <node> <reason>`` or
``BYE <node> <reason>``, head -> worker ``STOPPING <node> <reason>`` (notice: the head was asked to stop and
winds its engine down first, its workers' ranks still up) and ``STOP <failed|requested> <node> <reason>``.

Stdlib only, Python >= 3.8 (copied to nodes).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ..admission import Unproven
from ..fabric_key import head_proof, is_nonce, is_token, line_tag, nonce, same, session_key, worker_proof

# EX_TEMPFAIL: stopped because a peer failed; Restart=on-failure restarts the node with the others.
EXIT_PEER_FAILED = 75
HEARTBEAT_S = 1.0
MAX_LINE = 4096
BARRIER_LOG_S = 30.0  # a barrier still waiting says so in the journal this often (and at every change)
REPORT_S = 5.0  # ...and to the wrapper (status file, metrics, systemd's start timeout) this often
# Connections still in their handshake, from one address and in all: past these a new one is closed at once (a
# stranger's flood costs a bounded number of threads, and a node's address is not the stranger's).
MAX_PENDING_PER_ADDR = 4
MAX_PENDING = 64
FLOOD_LOG_S = 10.0  # a refused flood is said in the journal at most this often per address
_ANSWERS = {  # the head's refusals, as a worker says them
    "BUSY": "the head's wrapper is stopping",
    "UNKNOWN": "the head's wrapper does not expect {node} (not among its peers): rerun the play on every node",
}


def parse_addr(text: str) -> tuple[str, int]:
    """HOST:PORT (IPv4 or a name) -> (host, port); ValueError with the reason."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def _clean(text: str) -> str:
    return " ".join(str(text).split())[:1000]


class _Conn:
    """One TCP connection of the link: line reads with a heartbeat deadline, sends that never block long."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.sock.settimeout(timeout)
        self.buf = b""
        self.send_lock = threading.Lock()
        self.closed = False
        # After the handshake: this connection's key, who this end is ("h"/"w") and each direction's next number.
        self.session: bytes | None = None
        self.me = self.other = ""
        self.sent = self.received = 0
        self.forged = False  # a line whose tag did not match ended the connection

    def authenticated(self, session: bytes, me: str) -> None:
        self.session, self.me, self.other = session, me, "w" if me == "h" else "h"

    def send(self, line: str) -> bool:
        with self.send_lock:
            if self.closed:
                return False
            if self.session is not None:
                line = f"{line} {line_tag(self.session, self.me, self.sent, line)}"
                self.sent += 1
            try:
                self.sock.sendall((line + "\n").encode("ascii", "replace"))
                return True
            except OSError:
                return False

    def readline(self) -> str | None:
        """The next line; None on EOF, an error or no data within the timeout (the peer is gone)."""
        while b"\n" not in self.buf:
            try:
                data = self.sock.recv(MAX_LINE)
            except OSError:
                return None
            if not data:
                return None
            self.buf += data
            if len(self.buf) > MAX_LINE and b"\n" not in self.buf:
                return None
        line, self.buf = self.buf.split(b"\n", 1)
        text = line.decode("ascii", "replace").strip()
        if self.session is None:
            return text
        body, _, tag = text.rpartition(" ")
        if not same(tag, line_tag(self.session, self.other, self.received, body)):
            self.forged = True
            return None
        self.received += 1
        return body

    def close(self) -> None:
        with self.send_lock:
            self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class DeploymentLink:
    """One wrapper's end of the link. ``on_stop(kind, detail)`` is called at most once, from a link thread,
    when the deployment must stop: kind ``failed`` (a peer failed or vanished) or ``requested``."""

    def __init__(
        self,
        node: str,
        *,
        listen: tuple[str, int] | None = None,
        head: tuple[str, int] | None = None,
        timeout: float = 5.0,
        key: bytes,
        on_stop: Callable[[str, dict[str, Any]], None],
        log: Callable[[str], None],
        peers: tuple[str, ...] = (),
        on_wait: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if (listen is None) == (head is None):
            raise ValueError("a link end is either the head (listen) or a worker (head)")
        if not key:
            raise ValueError("the deployment link needs the deployment's fabric key")
        if not is_token(node):
            raise ValueError(f"link node name {node!r}: letters, digits and _.@:- only")
        self.key = key
        self.refused = 0  # connections that failed the handshake (strangers, another deployment's key)
        self.pending = Unproven(MAX_PENDING_PER_ADDR, MAX_PENDING)  # connections still in their handshake
        self._flood_said: dict[str, float] = {}
        self.node = node
        self.listen_addr, self.head_addr = listen, head
        self.timeout = timeout
        self.on_stop = on_stop
        self.log = log
        self.lock = threading.Lock()
        self.stopping = False  # no new peers: on_stop fired or the engine ended
        self.broadcast = False  # the head told every worker to stop
        self.notice: dict[str, Any] | None = None  # a worker heard that the deployment is being stopped on request
        self.stop_event: dict[str, Any] | None = None
        self.peers: dict[str, _Conn] = {}
        self.server: socket.socket | None = None
        self.conn: _Conn | None = None
        self.done = threading.Event()
        # The barrier (head): the workers that must join before any engine starts; a worker's view of it.
        for peer in peers:
            if not is_token(peer) or peer == node:
                raise ValueError(f"link peer {peer!r}: another node's name (letters, digits and _.@:- only)")
        self.expected = tuple(dict.fromkeys(peers))
        # The barrier is behind us: a head without peers welcomes at once; a worker once the head welcomed it.
        self.welcomed = listen is not None and not self.expected
        self.changed = threading.Event()  # a peer joined or left while the barrier waits
        self.on_wait = on_wait or (lambda _snap: None)
        self.waiting: dict[str, Any] | None = None  # the barrier's last snapshot while it waits, else None

    @property
    def is_head(self) -> bool:
        return self.listen_addr is not None

    # ---- start

    def start(self, deadline: float, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Head: listen, and with peers wait until every one has joined (the barrier). Worker: connect and be
        welcomed. Both before ``deadline`` (time.monotonic()); OSError with the reason when it cannot. Returns
        early when ``cancelled()`` (a stop request): the caller checks."""
        self._thread(self._heartbeat)
        if self.is_head:
            self.server = socket.create_server(self.listen_addr, reuse_port=False)
            self.server.settimeout(0.5)
            self._thread(self._accept_loop)
            self._await_barrier(deadline, cancelled)
        else:
            conn = self._connect(deadline, cancelled)
            if conn is not None:
                self._thread(self._worker_reader, conn)

    def barrier(self) -> dict[str, Any]:
        """The barrier now: expected, joined and missing nodes (the head's own view; a worker's from WAIT)."""
        with self.lock:
            if self.is_head:
                joined = [n for n in self.expected if n in self.peers]
                missing = [n for n in self.expected if n not in self.peers]
            else:
                joined, missing = [], list((self.waiting or {}).get("missing") or [])
        return {"role": "head" if self.is_head else "worker", "node": self.node, "expected": list(self.expected),
                "joined": joined, "missing": missing, "complete": self.welcomed}  # fmt: skip

    def _report(self, since: float, said: dict[str, Any], what: str) -> None:
        """How the wait stands: to on_wait at a change and every REPORT_S, to the journal at a change and every
        BARRIER_LOG_S. said: what was last told and when, kept by the caller."""
        now = time.monotonic()
        if what == said.get("what") and now - said.get("told", -1e9) < REPORT_S:
            return
        snap = self.barrier()
        snap.update(waiting_s=round(now - since, 1), since=round(time.time() - (now - since), 3), what=what)
        with self.lock:
            snap["missing"] = snap["missing"] or list((self.waiting or {}).get("missing") or [])
            self.waiting = snap
        said["told"] = now
        if what != said.get("what") or now - said.get("logged", -1e9) >= BARRIER_LOG_S:
            self.log(f"link: barrier: {what} ({snap['waiting_s']:.0f} s so far)")
            said.update(what=what, logged=now)
        self.on_wait(dict(snap))

    def _await_barrier(self, deadline: float, cancelled: Callable[[], bool]) -> None:
        since, said = time.monotonic(), {}
        while not self.welcomed and not cancelled() and not self.stopping:
            snap = self.barrier()
            missing, joined = snap["missing"], [self.node, *snap["joined"]]
            what = f"waiting for {', '.join(missing)} to join (here: {', '.join(joined)})"
            if time.monotonic() >= deadline:
                with self.lock:
                    if self.welcomed:
                        break
                    self.stopping = True  # nobody is welcomed after this
                raise OSError(
                    f"{', '.join(missing)} did not join the deployment link in {time.monotonic() - since:.0f} s "
                    f"(here: {', '.join(joined)}): down, or cut off from {self.node}"
                )
            self._report(since, said, what)
            self.changed.wait(1.0)
            self.changed.clear()
        with self.lock:
            self.waiting = None
        if self.welcomed:
            self.log(f"link: barrier: every node joined ({', '.join((self.node, *self.expected))}): starting")
            self.on_wait({"complete": True, "missing": []})

    def _connect(self, deadline: float, cancelled: Callable[[], bool]) -> _Conn | None:
        """The welcomed connection, None when cancelled; OSError at the deadline. Lost while waiting: join again."""
        host, port = self.head_addr
        last = "no answer"
        since, said = time.monotonic(), {}
        while not cancelled():
            try:
                sock = socket.create_connection((host, port), timeout=min(self.timeout, 2.0))  # next try sooner
                conn = _Conn(sock, self.timeout)
                problem = self._worker_handshake(conn)
                answer = None if problem else conn.readline()
                while answer == "PING":  # the head's heartbeat may come before its answer
                    answer = conn.readline()
                if answer is not None and answer.startswith("WAIT"):
                    answer = self._wait_for_welcome(
                        conn, answer, deadline=deadline, cancelled=cancelled, since=since, said=said
                    )
                    last = f"the head's wrapper waits for {', '.join(self.barrier()['missing'])} to join"
                    if cancelled():
                        return None  # self.conn stays: the caller says BYE (a stop on request stops the deployment)
                if answer == "WELCOME":
                    with self.lock:
                        self.conn, self.waiting, self.welcomed = conn, None, True
                    self.log(f"link: joined the head's wrapper at {host}:{port}")
                    return conn
                with self.lock:
                    self.conn = None
                conn.close()
                if problem:
                    last = problem
                    self.log(f"link: {host}:{port}: {problem}")
                elif answer in _ANSWERS:
                    last = _ANSWERS[answer].format(node=self.node)
                elif answer is not None:
                    last = f"unexpected answer {answer!r}"
            except OSError as e:
                last = e.strerror or str(e)
            if time.monotonic() >= deadline:
                raise OSError(f"the head's wrapper at {host}:{port} did not welcome this node: {last}")
            self._report(since, said, f"waiting for the head's wrapper at {host}:{port}: {last}")
            time.sleep(1.0)
        return None

    def _wait_for_welcome(
        self, conn: _Conn, answer: str, *, deadline: float, cancelled: Callable[[], bool], since: float,
        said: dict[str, Any],
    ) -> str | None:  # fmt: skip
        """Joined, the head still waits for others: heartbeats both ways until its next answer other than WAIT."""
        host, port = self.head_addr
        with self.lock:
            self.conn = conn  # heartbeats, and a stop on request says BYE, while the head waits
        while answer is not None and answer.split(" ", 1)[0] in ("WAIT", "PING") and not cancelled():
            if answer.startswith("WAIT"):
                with self.lock:
                    self.waiting = {"missing": [n for n in answer[5:].split(",") if n]}
            if time.monotonic() >= deadline:
                break
            self._report(since, said, f"the head's wrapper at {host}:{port} waits for "
                         f"{', '.join(self.barrier()['missing'])} to join")  # fmt: skip
            answer = conn.readline()
        return answer

    def _worker_handshake(self, conn: _Conn) -> str | None:
        """Prove the key to the head and make it prove it first; the problem, or None (conn is authenticated)."""
        mine = nonce()
        conn.send(f"HELLO {self.node} {mine}")
        words = (conn.readline() or "").split(" ")
        if len(words) != 3 or words[0] != "CHALLENGE" or not is_nonce(words[1]):
            return f"no challenge from the head's wrapper (got {' '.join(words)[:60]!r}): an older llmfleet there?"
        theirs, proof = words[1], words[2]
        if not same(proof, head_proof(self.key, self.node, mine, theirs)):
            return (
                "the listener did not prove the deployment's fabric key: not this deployment's head (another "
                "deployment's, or a stranger on the fabric), or the key differs (rerun the play on every node)"
            )
        conn.send(f"AUTH {worker_proof(self.key, self.node, mine, theirs)}")
        conn.authenticated(session_key(self.key, self.node, mine, theirs), "w")
        return None

    def _thread(self, fn: Callable[..., None], *args: Any) -> None:
        threading.Thread(target=fn, args=args, daemon=True).start()

    # ---- head

    def _accept_loop(self) -> None:
        while not self.done.is_set():
            try:
                sock, addr = self.server.accept()
            except socket.timeout:  # noqa: UP041 (an alias of TimeoutError only from 3.10; nodes may run 3.8)
                continue
            except OSError:
                return
            ip = str(addr[0])
            waiting = self.pending.admit(ip)
            if waiting is not None:
                with self.lock:
                    self.refused += 1
                sock.close()
                self._say_flood(ip, waiting)
                continue
            self._thread(self._head_reader, _Conn(sock, self.timeout), f"{ip}:{addr[1]}", ip)

    def _say_flood(self, ip: str, waiting: int) -> None:
        now = time.monotonic()
        if now - self._flood_said.get(ip, -1e9) >= FLOOD_LOG_S:
            self._flood_said[ip] = now
            self.log(f"link: refused connections from {ip}: {waiting} of its connections are still in their "
                     f"handshake (at most {MAX_PENDING_PER_ADDR} per address, {MAX_PENDING} in all)")  # fmt: skip

    def _head_handshake(self, conn: _Conn) -> tuple[str | None, str]:
        """(the node that proved the key, "") or (None, why it was refused)."""
        words = (conn.readline() or "").split(" ")
        if len(words) != 3 or words[0] != "HELLO" or not is_token(words[1]) or not is_nonce(words[2]):
            return None, f"no valid HELLO (got {' '.join(words)[:60]!r})"
        name, theirs, mine = words[1], words[2], nonce()
        conn.send(f"CHALLENGE {mine} {head_proof(self.key, name, theirs, mine)}")
        words = (conn.readline() or "").split(" ")
        if len(words) != 2 or words[0] != "AUTH":
            return None, f"{name!r} did not answer the challenge"
        if not same(words[1], worker_proof(self.key, name, theirs, mine)):
            return None, f"{name!r} did not prove the deployment's fabric key (a stranger, or another deployment's key)"
        conn.authenticated(session_key(self.key, name, theirs, mine), "h")
        return name, ""

    def _admit(self, conn: _Conn, name: str, peer: str) -> bool:
        """A node that proved the key: refused (not one of the peers, or the head is stopping), welcomed, or told to
        wait for the barrier; whether it is a peer now."""
        if self.expected and name not in self.expected:
            with self.lock:
                self.refused += 1
            self.log(f"link: refused {name!r} from {peer}: not a node of this deployment (expected: "
                     f"{', '.join(self.expected)})")  # fmt: skip
            conn.send("UNKNOWN")
            conn.close()
            return False
        welcome: list[_Conn] = []
        with self.lock:
            busy = self.stopping
            if not busy:
                old = self.peers.pop(name, None)
                self.peers[name] = conn
                if not self.welcomed and all(n in self.peers for n in self.expected):
                    self.welcomed = True  # the last one: every node is here, every engine may start
                    welcome = list(self.peers.values())
                elif self.welcomed:
                    welcome = [conn]
        if busy:
            conn.send("BUSY")
            conn.close()
            return False
        if old is not None:
            old.close()  # that node's earlier wrapper is gone: its reader must not report it
        for c in welcome:
            c.send("WELCOME")
        missing = self._tell_waiting()
        self.log(f"link: {name} joined" + (f"; still missing: {', '.join(missing)}" if missing else ""))
        return True

    def _tell_waiting(self) -> list[str]:
        """While the barrier waits: every joined worker hears who is still missing (and the head's loop wakes)."""
        with self.lock:
            conns = [] if self.welcomed else list(self.peers.values())
            missing = [n for n in self.expected if n not in self.peers]
        for c in conns:
            c.send(f"WAIT {','.join(missing)}")
        self.changed.set()
        return missing if conns else []

    def _head_reader(self, conn: _Conn, peer: str, ip: str = "") -> None:
        try:
            name, why = self._head_handshake(conn)
        finally:
            self.pending.release(ip)
        if name is None:  # never acted on: not a peer, so its connection is nobody's loss either
            with self.lock:
                self.refused += 1
            self.log(f"link: refused a connection from {peer}: {why}")
            conn.close()
            return
        if not self._admit(conn, name, peer):
            return
        while True:
            line = conn.readline()
            if line is None:
                with self.lock:
                    current = self.peers.get(name) is conn
                    early = current and not self.welcomed  # no engine runs yet: missing again, not a failure
                    if early:
                        self.peers.pop(name, None)
                if early:
                    conn.close()
                    self.log(f"link: barrier: {name} left before the engines started: waiting for it again")
                    self._tell_waiting()
                    return
                if current and not conn.closed:
                    why = ("a line that failed its authentication: injected on the way?" if conn.forged
                           else f"connection closed or no heartbeat for {self.timeout:g} s")  # fmt: skip
                    self._head_stop("failed", name, f"lost contact with {name}'s wrapper ({why})")
                return
            word, _, rest = line.partition(" ")
            if word in ("FAIL", "BYE"):
                node, _, reason = rest.partition(" ")
                with self.lock:
                    self.peers.pop(name, None)
                conn.close()
                self._head_stop("failed" if word == "FAIL" else "requested", node or name, reason)
                return

    def _head_stop(self, kind: str, node: str, reason: str, notify: bool = True) -> None:
        """Tell every worker to stop (once) and, for a peer's event, stop this node's engine too."""
        with self.lock:
            if self.broadcast:
                return
            self.broadcast = self.stopping = True
            peers = list(self.peers.items())
            self.stop_event = {"kind": kind, "node": node, "reason": _clean(reason), "at": time.time()}
        for _, conn in peers:
            conn.send(f"STOP {kind} {node} {_clean(reason)}")
        if notify:
            self.on_stop(kind, dict(self.stop_event))

    # ---- worker

    def _worker_reader(self, conn: _Conn) -> None:
        while True:
            line = conn.readline()
            if line is None:
                if not self.stopping:
                    host, port = self.head_addr
                    why = ("a line that failed its authentication: injected on the way?" if conn.forged
                           else f"connection closed or no heartbeat for {self.timeout:g} s")  # fmt: skip
                    lost = f"lost contact with the head's wrapper at {host}:{port}: {why}"
                    self._worker_stop("failed", "head", lost)
                return
            word, _, rest = line.partition(" ")
            if word == "STOPPING":
                node, _, reason = rest.partition(" ")
                self.notice = {"kind": "requested", "node": node, "reason": _clean(reason), "at": time.time()}
                continue
            if word == "STOP":
                kind, _, rest = rest.partition(" ")
                node, _, reason = rest.partition(" ")
                self._worker_stop("requested" if kind == "requested" else "failed", node, reason)
                return

    def _worker_stop(self, kind: str, node: str, reason: str) -> None:
        with self.lock:
            if self.stopping:
                return
            self.stopping = True
            self.stop_event = {"kind": kind, "node": node, "reason": _clean(reason), "at": time.time()}
        self.on_stop(kind, dict(self.stop_event))

    # ---- both

    def _heartbeat(self) -> None:
        while not self.done.wait(HEARTBEAT_S):
            with self.lock:
                conns = list(self.peers.values()) if self.is_head else [self.conn]
            for conn in conns:
                if conn is not None:
                    conn.send("PING")

    def local_stop(self, reason: str) -> None:
        """A stop was requested on this node (systemd). The head only gives notice (STOPPING): its engine may need
        the workers' ranks to shut down cleanly, so they are told to stop once it is down; a worker whose engine
        exits 0 on the head's own shutdown message meanwhile knows the deployment is stopping. A worker stopped
        on request says so at once (BYE): the deployment stops with it."""
        if self.is_head:
            with self.lock:
                peers = list(self.peers.values())
            for conn in peers:
                conn.send(f"STOPPING {self.node} {_clean(reason)}")
            return
        with self.lock:
            told = self.stopping
            self.stopping = True
        if not told and self.conn is not None:
            self.conn.send(f"BYE {self.node} {_clean(reason)}")

    def wait_for_stop(self, timeout: float) -> dict[str, Any] | None:
        """The link's stop event or the head's notice, waiting up to timeout for one (an engine just exited 0)."""
        end = time.monotonic() + timeout
        while self.stop_event is None and self.notice is None and time.monotonic() < end and not self.done.is_set():
            time.sleep(0.02)
        return self.stop_event or self.notice

    def engine_ended(self, failed: bool, reason: str) -> None:
        """This node's engine ended on its own (failed) or on a stop request: tell the others, then close."""
        kind = "failed" if failed else "requested"
        if self.is_head:
            self._head_stop(kind, self.node, reason, notify=False)  # a no-op when a peer's event stopped it
            self.close()
            return
        with self.lock:
            told = self.stopping
            self.stopping = True
        if not told and self.conn is not None:
            self.conn.send(f"{'FAIL' if failed else 'BYE'} {self.node} {_clean(reason)}")
        self.close()

    def close(self) -> None:
        self.done.set()
        if self.server is not None:
            try:
                self.server.close()
            except OSError:
                pass
        with self.lock:
            conns = list(self.peers.values()) + ([self.conn] if self.conn else [])
        for conn in conns:
            conn.close()
