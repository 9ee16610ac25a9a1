"""sd_notify(3) for ``llmfleet exec``, without libsystemd. Stdlib only, Python >= 3.8 (copied to nodes)."""

from __future__ import annotations

import socket
import threading


class Notifier:
    """sd_notify(3) without libsystemd: a datagram to $NOTIFY_SOCKET ('@' = abstract); no-op when unset."""

    def __init__(self, address: str | None) -> None:
        self.addr = None
        if address and address[0] in "/@":
            self.addr = "\0" + address[1:] if address[0] == "@" else address
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()

    def send(self, *fields: str) -> None:
        if not self.addr:
            return
        with self.lock:
            try:
                if self.sock is None:
                    self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self.sock.sendto("\n".join(fields).encode("utf-8", "replace"), self.addr)
            except OSError:
                pass  # systemd gone or not listening: the engine must keep running regardless
