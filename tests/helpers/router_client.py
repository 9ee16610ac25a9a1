"""A bounded client through a replicas' router for the lab tests: one request at a time, each bounded by the ask
function's own timeout, with a pause between them; it counts requests sent and failed (with their time), the longest
stretch without a correct answer, and whether a request is in flight now."""

from __future__ import annotations

import threading
import time
import urllib.error
from collections.abc import Callable


class RouterClient(threading.Thread):
    def __init__(self, ask: Callable[[], str], expect: str = "703", pause: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.ask, self.expect, self.pause = ask, expect, pause
        self.stop, self.sent, self.failed, self.gap = threading.Event(), 0, 0, 0.0
        self.errors: list[str] = []
        self.failed_at: list[float] = []
        self.busy = False

    def run(self) -> None:
        last_ok = time.monotonic()
        while not self.stop.is_set():
            self.sent += 1
            self.busy = True
            try:
                ok = self.ask() == self.expect
            except (OSError, urllib.error.URLError, KeyError, ValueError) as e:
                ok = False
                self.errors.append(repr(e)[:200])
            self.busy = False
            now = time.monotonic()
            if ok:
                self.gap = max(self.gap, now - last_ok)
                last_ok = now
            else:
                self.failed += 1
                self.failed_at.append(now)
            time.sleep(self.pause)
