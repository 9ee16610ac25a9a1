"""Serve a node's verified files of one revision to its peers (HTTP on the fabric network).

Only files that are verified (listed in the publish record or the partial dir's journal) and
named by the manifest are served; receivers hash what they get and compare with the manifest,
so a peer is never trusted. ``/status`` says which files this node has and whether it is done.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .store import JOURNAL, read_journal, read_record


class PeerState:
    def __init__(self, mdir: str, revision: str, manifest: dict[str, Any], host: str) -> None:
        self.mdir = mdir
        self.revision = revision
        self.names = {e["path"] for e in manifest["files"]}
        self.host = host
        self.done = False  # this node finished (published or failed) and only serves now
        self.failed: str | None = None
        self.served_bytes = 0
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

    def status(self) -> dict[str, Any]:
        rdir = os.path.join(self.mdir, self.revision)
        pub = read_record(self.mdir, self.revision) is not None and os.path.isdir(rdir)
        if pub:
            have = sorted(self.names)
        else:
            have = sorted(set(read_journal(os.path.join(self.mdir, f".partial-{self.revision}"))) & self.names)
        return {
            "host": self.host,
            "revision": self.revision,
            "published": pub,
            "have": have,
            "done": self.done,
            "failed": self.failed,
        }

    def add_served(self, n: int) -> None:
        with self._lock:
            self.served_bytes += n


def make_server(state: PeerState, bind: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # keep module output clean
            pass

        def do_GET(self) -> None:
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
            if path == "/status":
                body = json.dumps(state.status()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            rel = path[len("/files/") :] if path.startswith("/files/") else None
            local = state.locate(rel) if rel and not rel.endswith(JOURNAL) else None
            if local is None:
                self.send_error(404, "not a verified file of this revision here")
                return
            try:
                f = open(local, "rb")
            except OSError:
                self.send_error(404)
                return
            with f:
                size = os.fstat(f.fileno()).st_size
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                shutil.copyfileobj(f, self.wfile, 4 * 1024 * 1024)
                state.add_served(size)

    server = ThreadingHTTPServer((bind, port), Handler)
    server.daemon_threads = True
    return server


def serve_in_background(state: PeerState, bind: str, port: int) -> ThreadingHTTPServer:
    server = make_server(state, bind, port)
    threading.Thread(target=server.serve_forever, name="peer-server", daemon=True).start()
    return server
