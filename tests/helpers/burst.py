"""How many of a burst of TCP connections a listening socket completes at once: the kernel finishes a handshake for
a connection waiting in the listen backlog even while nothing accepts; past the backlog it drops the SYN, and the
client's retransmit comes 1 s later."""

from __future__ import annotations

import select
import socket


def completed(port: int, n: int = 40, within: float = 0.5, host: str = "127.0.0.1") -> int:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((host, port))
            socks.append(s)
        _, writable, _ = select.select([], socks, [], within)  # a completed handshake makes the socket writable
        return sum(1 for s in writable if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0)
    finally:
        for s in socks:
            s.close()
