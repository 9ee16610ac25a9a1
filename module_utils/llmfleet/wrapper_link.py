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

Protocol (one line each, ASCII): worker -> head ``HELLO <node>``, head -> worker ``WELCOME`` or ``BUSY``
(the head is stopping: try again), both ways ``PING``, worker -> head ``FAIL <node> <reason>`` or
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

# EX_TEMPFAIL: stopped because a peer failed; Restart=on-failure restarts the node with the others.
EXIT_PEER_FAILED = 75
HEARTBEAT_S = 1.0
MAX_LINE = 4096


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

    def send(self, line: str) -> bool:
        with self.send_lock:
            if self.closed:
                return False
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
        return line.decode("ascii", "replace").strip()

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
        on_stop: Callable[[str, dict[str, Any]], None],
        log: Callable[[str], None],
    ) -> None:
        if (listen is None) == (head is None):
            raise ValueError("a link end is either the head (listen) or a worker (head)")
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

    @property
    def is_head(self) -> bool:
        return self.listen_addr is not None

    # ---- start

    def start(self, deadline: float) -> None:
        """Head: listen. Worker: connect and be welcomed before ``deadline`` (time.monotonic()); OSError with
        the reason when it cannot."""
        if self.is_head:
            self.server = socket.create_server(self.listen_addr, reuse_port=False)
            self.server.settimeout(0.5)
            self._thread(self._accept_loop)
        else:
            self.conn = self._connect(deadline)
            self._thread(self._worker_reader, self.conn)
        self._thread(self._heartbeat)

    def _connect(self, deadline: float) -> _Conn:
        host, port = self.head_addr
        last = "no answer"
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=min(self.timeout, 5.0))
                conn = _Conn(sock, self.timeout)
                conn.send(f"HELLO {self.node}")
                answer = conn.readline()
                if answer == "WELCOME":
                    self.log(f"link: joined the head's wrapper at {host}:{port}")
                    return conn
                conn.close()
                last = "the head's wrapper is stopping" if answer == "BUSY" else f"unexpected answer {answer!r}"
            except OSError as e:
                last = e.strerror or str(e)
            if time.monotonic() >= deadline:
                raise OSError(f"the head's wrapper at {host}:{port} did not welcome this node: {last}")
            time.sleep(1.0)

    def _thread(self, fn: Callable[..., None], *args: Any) -> None:
        threading.Thread(target=fn, args=args, daemon=True).start()

    # ---- head

    def _accept_loop(self) -> None:
        while not self.done.is_set():
            try:
                sock, _ = self.server.accept()
            except socket.timeout:  # noqa: UP041 (an alias of TimeoutError only from 3.10; nodes may run 3.8)
                continue
            except OSError:
                return
            self._thread(self._head_reader, _Conn(sock, self.timeout))

    def _head_reader(self, conn: _Conn) -> None:
        hello = conn.readline() or ""
        word, _, name = hello.partition(" ")
        if word != "HELLO" or not name:
            conn.close()
            return
        with self.lock:
            busy = self.stopping
            if not busy:
                old = self.peers.pop(name, None)
                self.peers[name] = conn
        if busy:
            conn.send("BUSY")
            conn.close()
            return
        if old is not None:
            old.close()  # that node's earlier wrapper is gone: its reader must not report it
        conn.send("WELCOME")
        self.log(f"link: {name} joined")
        while True:
            line = conn.readline()
            if line is None:
                with self.lock:
                    current = self.peers.get(name) is conn
                if current and not conn.closed:
                    self._head_stop("failed", name, f"lost contact with {name}'s wrapper (connection closed or no "
                                                     f"heartbeat for {self.timeout:g} s)")  # fmt: skip
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
                    why = f"connection closed or no heartbeat for {self.timeout:g} s"
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
