"""Serving health after READY (``llmfleet exec --health-url``): ask the readiness gate's question again and again.

An engine whose port and ``/health`` stay fine while every generation hangs (a stuck collective, a scheduler
deadlock, a stream that never closes) looks healthy to systemd. From READY on, every interval, this part asks
the gate's question (gate.chat_body, judged by gate.judge_chat) as a chat completion. A failure is no complete,
correct answer within the timeout (the whole answer is bounded, not each read: a stream that never ends
fails), a wrong answer, an HTTP error, a refused or reset connection. ``failures`` in a row call ``on_unhealthy``
once (the wrapper then stops the engine as on a stop request); a good answer resets the count.

Stdlib only, Python >= 3.8 (copied to nodes with the wrapper).
"""

from __future__ import annotations

import collections
import http.client
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from ..engine.gate import chat_body, judge_chat

PROBES_KEPT = 5  # the last probes kept in the status and the record
MAX_BODY = 1 << 20  # an answer longer than this is not the one asked for


def check_url(url: str) -> str | None:
    """The problem with a --health-url, or None."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        return f"--health-url {url!r}: an http(s) URL of the engine's API base, e.g. http://127.0.0.1:30000"
    if u.query or u.fragment or u.username or u.password:
        return f"--health-url {url!r}: no query, fragment or user part (the API key comes from --health-key)"
    try:
        u.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        return f"--health-url {url!r}: bad port"
    return None


def api_base(path: str) -> str:
    """The URL's path as the API's base: `http://h:p` and `http://h:p/v1` are the same API."""
    path = path.rstrip("/")
    return path[: -len("/v1")] if path.endswith("/v1") else path


def ask(url: str, model: str, prompt: str, expect: str, *, api_key: str | None, timeout: float,
        cut: Callable[[Callable[[], None]], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """One probe: {"ok", "error", "latency_s"}. The whole exchange (connect, request, headers, body) ends by
    ``timeout``: a timer shuts the socket down at the deadline, whatever the server trickles. ``cut`` receives
    the function that ends the exchange at once (the wrapper's stop must never wait for a probe)."""
    t0 = time.monotonic()
    u = urllib.parse.urlsplit(url)
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(u.hostname, u.port, timeout=timeout)
    expired = threading.Event()

    def end(timed_out: bool = False) -> None:
        if timed_out:
            expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout, end, (True,))
    timer.daemon = True
    timer.start()
    if cut is not None:
        cut(end)
    req = chat_body(model, prompt)
    if not model:  # no --health-model: the engine's own (vLLM and SGLang answer with their served model)
        del req["model"]
    body = json.dumps(req).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        code, raw = _exchange(conn, api_base(u.path) + "/v1/chat/completions", body, headers)
        if expired.is_set():  # the cut may look like a clean end of a body without a length
            raise TimeoutError
    except (OSError, http.client.HTTPException, ValueError) as e:
        latency = round(time.monotonic() - t0, 3)
        if expired.is_set() or isinstance(e, (socket.timeout, TimeoutError)):
            why = f"no complete answer within {timeout:g} s"
        else:
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return {"ok": False, "error": why, "latency_s": latency}
    finally:
        timer.cancel()
        conn.close()
    latency = round(time.monotonic() - t0, 3)
    try:
        resp_obj: Any = json.loads(raw)
    except ValueError:
        resp_obj = raw.decode(errors="replace")[:500]
    judged = judge_chat(code, resp_obj, prompt, expect)
    return {"ok": bool(judged["ok"]), "error": None if judged["ok"] else judged["why"], "latency_s": latency}


def _exchange(conn: http.client.HTTPConnection, path: str, body: bytes, headers: dict) -> tuple[int, bytes]:
    """POST and read the whole answer, one recv at a time (read1), so the deadline's cut ends it."""
    conn.request("POST", path, body, headers)
    resp = conn.getresponse()
    raw = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        raw += chunk
        if len(raw) > MAX_BODY:
            raise ValueError(f"answer longer than {MAX_BODY} bytes")
    if resp.length:  # Content-Length not met: the connection ended early
        raise http.client.IncompleteRead(raw, resp.length)
    return resp.status, raw


class HealthProbe:
    """The probe loop (a daemon thread from start() on). snapshot() is what the status, the record and the
    metrics show; on_unhealthy(snapshot) is called once, from this thread, after ``failures`` in a row."""

    def __init__(
        self,
        url: str,
        model: str,
        prompt: str,
        expect: str,
        *,
        api_key: str | None,
        interval: float,
        timeout: float,
        failures: int,
        on_probe: Callable[[dict], None],
        on_unhealthy: Callable[[dict], None],
        stopping: Callable[[], bool],
    ) -> None:
        self.url, self.model, self.prompt, self.expect = url, model, prompt, expect
        self.api_key = api_key
        self.interval, self.timeout, self.failures = interval, timeout, failures
        self.on_probe, self.on_unhealthy, self.stopping = on_probe, on_unhealthy, stopping
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.probes: collections.deque = collections.deque(maxlen=PROBES_KEPT)
        self.failed_in_row = 0
        self.last_good_at: float | None = None
        self.last_good_latency_s: float | None = None
        self.unhealthy = False
        self._end: Callable[[], None] | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="health", daemon=True)
            self.thread.start()

    def close(self) -> None:
        """Stop asking, and end a probe in flight at once (never joined: a stop waits for no probe)."""
        self.done.set()
        with self.lock:
            end = self._end
        if end is not None:
            end()

    def _set_end(self, end: Callable[[], None]) -> None:
        with self.lock:
            self._end = end
        if self.done.is_set():
            end()

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            probes = [dict(p) for p in self.probes]
            return {
                "url": self.url,
                "interval_s": self.interval,
                "timeout_s": self.timeout,
                "failures_allowed": self.failures,
                "failures_in_row": self.failed_in_row,
                "last": probes[-1] if probes else None,
                "last_good_at": self.last_good_at,
                "last_good_latency_s": self.last_good_latency_s,
                "unhealthy": self.unhealthy,
                "probes": probes,
            }

    def _loop(self) -> None:
        # The first probe one interval after READY (the gate has just asked the same question), then one every
        # interval from the start of the last: a slow probe does not push the next one out, so a hang is found at
        # most interval x failures + timeout after it began (with timeout <= interval).
        next_at = time.monotonic() + self.interval
        while not self.done.wait(max(0.0, next_at - time.monotonic())):
            next_at = max(next_at + self.interval, time.monotonic())
            at = time.time()
            res = ask(self.url, self.model, self.prompt, self.expect, api_key=self.api_key,
                      timeout=self.timeout, cut=self._set_end)  # fmt: skip
            if self.done.is_set() or self.stopping():
                return  # a stop came meanwhile: this probe (cut or not) is nobody's story
            self._count(dict(res, at=round(at, 3)))

    def _count(self, probe: dict) -> None:
        with self.lock:
            self.probes.append(probe)
            if probe["ok"]:
                self.failed_in_row = 0
                self.last_good_at, self.last_good_latency_s = probe["at"], probe["latency_s"]
            else:
                self.failed_in_row += 1
            fire = not self.unhealthy and self.failed_in_row >= self.failures
            if fire:
                self.unhealthy = True
        self.on_probe(self.snapshot())
        if fire:
            self.done.set()
            self.on_unhealthy(self.snapshot())
