"""Staging progress: what a staging run writes to its progress file (Progress), and the one
function that turns a snapshot read back from that file into a line (progress_line), used by
``llmfleet stage`` and by the llmfleet_job_wait action plugin on the controller.

Stdlib only (the writer runs inside the Ansible module on nodes, Python >= 3.8).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import safefs

GiB = 1024**3
BAR_WIDTH = 30


@dataclass
class Progress:
    """Bytes done / total and rate, written to a JSON file while staging runs."""

    total: int = 0
    done: int = 0
    source_bytes: int = 0
    peer_bytes: int = 0
    phase: str = "starting"
    started: float = field(default_factory=time.time)
    path: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _last_write: float = 0.0

    def add(self, n: int, from_peer: bool | None) -> None:
        """n bytes copied: from a peer (True), from shared storage (False), or neither (None: this
        node's own published copy, when a repair cannot hard-link an intact file)."""
        with self._lock:
            self.done += n
            if from_peer:
                self.peer_bytes += n
            elif from_peer is False:
                self.source_bytes += n
        self.flush()

    def snapshot(self) -> dict[str, Any]:
        elapsed = max(time.time() - self.started, 1e-6)
        return {
            "phase": self.phase,
            "total_bytes": self.total,
            "done_bytes": self.done,
            "source_bytes_read": self.source_bytes,
            "peer_bytes_read": self.peer_bytes,
            "elapsed_s": round(elapsed, 3),
            "rate_bytes_per_s": int(self.done / elapsed),
            "updated": time.time(),
        }

    def flush(self, force: bool = False) -> None:
        if not self.path or (not force and time.time() - self._last_write < 1.0):
            return
        self._last_write = time.time()
        # Root writes this under /var/lib/llmfleet, which the engine user owns: never through a link
        # planted there (progress is best effort: a refused path only means no progress file).
        with contextlib.suppress(OSError):
            safefs.write_json(self.path, self.snapshot())


def progress_line(p: dict[str, Any], host: str | None = None) -> str:
    """One line for a progress snapshot (``Progress.snapshot()`` as read back from its file).

    Without host (``llmfleet stage``: one node, the line redrawn in place on the terminal): a bar,
    %, GiB done/total, rate and phase. With host (the playbook: one line per node and poll, in the
    log): host, phase, GiB done/total, %, rate, and the bytes read from shared storage vs from peers.
    """
    total, done = p.get("total_bytes", 0), p.get("done_bytes", 0)
    rate_mib = p.get("rate_bytes_per_s", 0) / 2**20
    if host is None:
        frac = done / total if total else 1.0
        fill = int(frac * BAR_WIDTH)
        return (
            f"[{'#' * fill}{'.' * (BAR_WIDTH - fill)}] {frac * 100:5.1f}% {done / GiB:.2f}/{total / GiB:.2f} GiB "
            f"{rate_mib:.0f} MiB/s {p.get('phase', '')}"
        )
    pct = 100.0 * done / total if total else 100.0
    return (
        f"{host}: {p.get('phase', '?')} {done / GiB:.2f}/{total / GiB:.2f} GiB ({pct:.0f}%) "
        f"at {rate_mib:.0f} MiB/s; from shared storage "
        f"{p.get('source_bytes_read', 0) / GiB:.2f} GiB, from peers {p.get('peer_bytes_read', 0) / GiB:.2f} GiB"
    )
