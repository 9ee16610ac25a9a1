"""The output pump of ``llmfleet exec``: one thread per engine pipe passes the output through line by line (to the
wrapper's own stdout / stderr and the --log-file), secrets redacted, and hands each line's text on.

Stdlib only, Python >= 3.8 (copied to nodes).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

READER_JOIN_S = 2.0  # grandchildren outside the group may hold the pipes: never wait for EOF longer
MAX_LINE = 65536  # a line without a newline is passed on in pieces of this size
_EOL = re.compile(rb"\r\n|\n|\r")  # tqdm bars end their updates with \r: progress must be seen before \n


def err(msg: str) -> None:
    """A message of the wrapper's own, on its stderr (the journal)."""
    try:
        sys.stderr.write(f"llmfleet exec: {msg}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class OutputPump:
    """Reads the engine's pipes until EOF or drain().

    redact: a Redactor (falsy when no secret is loaded); on_text(text) gets each non-empty line, redacted, decoded,
    without its end of line. Writes hold out_lock only, so a stuck stdout (journald) blocks only the readers."""

    def __init__(self, redact: Any, on_text: Callable[[str], None]) -> None:
        self.redact = redact
        self.on_text = on_text
        self.out_lock = threading.Lock()
        self.closed = False
        self.dead_streams: set[int] = set()
        self.log: Any = None
        self.readers: list[threading.Thread] = []
        self.pipes: tuple = ()

    def open_log(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.log = open(path, "ab")  # closed once the readers are done

    def close_log(self) -> None:
        if self.log is not None:
            self.log.close()

    def start(self, pipes: tuple, outs: tuple) -> None:
        """One reader thread per pipe, writing to the matching stream of outs (a text stream's buffer is used)."""
        self.pipes = pipes
        for pipe, out in zip(pipes, outs):
            t = threading.Thread(target=self._reader, args=(pipe.fileno(), getattr(out, "buffer", None)), daemon=True)
            t.start()
            self.readers.append(t)

    def _reader(self, fd: int, out: Any) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            pos = 0
            for m in _EOL.finditer(buf):
                self._line(buf[pos : m.end()], out)
                pos = m.end()
            buf = buf[pos:]
            while len(buf) >= MAX_LINE:
                cut = self.redact.safe_cut(buf, MAX_LINE) if self.redact else MAX_LINE
                self._line(buf[:cut], out)
                buf = buf[cut:]
        if buf:
            self._line(buf, out)

    def _line(self, raw: bytes, out: Any) -> None:
        if self.redact:  # engines log their own arguments (SGLang: server_args=... at info level)
            raw = self.redact.data(raw)
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        with self.out_lock:
            if self.closed:
                return
            if out is not None and id(out) not in self.dead_streams:
                try:
                    out.write(raw)
                    out.flush()
                except (OSError, ValueError):  # EPIPE: journald gone; keep draining so the engine never blocks
                    self.dead_streams.add(id(out))
            if self.log is not None:
                try:
                    self.log.write(raw)
                    self.log.flush()
                except OSError as e:
                    err(f"--log-file: {e.strerror}; no longer copying output there")
                    self.log = None
        if text.strip():
            self.on_text(text)

    def drain(self) -> None:
        """After the child ended: give the readers READER_JOIN_S to reach EOF, then stop all output."""
        end = time.monotonic() + READER_JOIN_S
        for t in self.readers:
            t.join(max(0.0, end - time.monotonic()))
        # Readers still blocked (a pipe held outside the group) must not write any more. A reader stuck in a
        # write to a full stdout holds out_lock: do not wait for it forever.
        got = self.out_lock.acquire(timeout=1.0)
        self.closed = True
        if got:
            if self.log is not None:
                self.log.close()
                self.log = None
            self.out_lock.release()
        for t, pipe in zip(self.readers, self.pipes):
            if not t.is_alive():  # closing an fd another thread reads from could hit a reused fd number
                pipe.close()
