"""Connections that have not proved the deployment's fabric key yet, counted per source address: llmfleet's
listeners on the fabric (the deployment link's head, the staging peer server) admit a bounded number, so that a
stranger's silent connections cost a bounded number of threads while nodes on other addresses get in.

Stdlib only, Python >= 3.8 (runs on the nodes).
"""

from __future__ import annotations

import threading


class Unproven:
    """At most `per_address` connections from one address (and `total` in all; 0 = no total) until each is
    proven or ends."""

    def __init__(self, per_address: int, total: int = 0) -> None:
        self.per_address, self.total = per_address, total
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def admit(self, address: str) -> int | None:
        """None when the connection is admitted (it counts until `release`); else how many its address holds."""
        with self._lock:
            held = self.counts.get(address, 0)
            if held >= self.per_address or (self.total and sum(self.counts.values()) >= self.total):
                return held
            self.counts[address] = held + 1
            return None

    def release(self, address: str) -> None:
        """An admitted connection proved the key, or ended."""
        with self._lock:
            left = self.counts.get(address, 1) - 1
            if left > 0:
                self.counts[address] = left
            else:
                self.counts.pop(address, None)
