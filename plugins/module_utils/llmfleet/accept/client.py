"""HTTP for the API acceptance checker (`llmfleet accept`): every call is bounded by deadlines.

A request runs in a worker thread; the caller waits on a queue with the time left and, when a deadline
passes, shuts the socket down (which ends the worker's blocked read) and reports how long the server
hung and in which phase. So a server that never answers, trickles bytes, or keeps a finished stream
open is a measured failure, never a hang of the checker.

Streams (SSE, `stream: true`) are read line by line with three deadlines: the first token (a chunk whose
delta carries content, reasoning or a tool call; vLLM's first chunk only says `role: assistant`), the gap
between chunks, and the close: after the last token the server must send `data: [DONE]` and end the
response within `close_s`. Stdlib only (http.client), so it runs on any Python the package runs on.
"""

from __future__ import annotations

import http.client
import json
import queue
import socket
import ssl
import threading
import time
from typing import Any
from urllib.parse import urlsplit

# Deltas that carry generated text (vLLM 0.32 names the reasoning field `reasoning`; SGLang and older vLLM
# `reasoning_content`).
TOKEN_FIELDS = ("content", "reasoning", "reasoning_content")
MAX_LINE = 1 << 20


class UrlError(ValueError):
    """The endpoint URL cannot be used (not http(s), no host)."""


def split_base(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path prefix) of an endpoint URL; a trailing /v1 is dropped
    (`http://head:8000` and `http://head:8000/v1` name the same API)."""
    u = urlsplit(url.strip())
    if u.scheme not in ("http", "https"):
        raise UrlError(f"{url!r} is not an http(s) URL (e.g. http://head:8000)")
    if not u.hostname:
        raise UrlError(f"{url!r} has no host (e.g. http://head:8000)")
    try:
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        raise UrlError(f"{url!r} has a bad port") from None
    prefix = u.path.rstrip("/")
    if prefix.endswith("/v1"):
        prefix = prefix[:-3]
    return u.scheme, u.hostname, port, prefix


class Reply:
    """One answered (or unanswered) request: status 0 means no HTTP answer and `error` says why."""

    def __init__(self, status: int, body: Any = None, error: str | None = None, seconds: float = 0.0) -> None:
        self.status, self.body, self.error, self.seconds = status, body, error, round(seconds, 3)

    @property
    def ok(self) -> bool:
        return self.status == 200

    def problem(self) -> str:
        """What went wrong, in words: the HTTP status and the server's message, or the transport error."""
        if self.status == 0:
            return self.error or "no answer"
        return f"HTTP {self.status}: {error_message(self.body)}"


def error_message(body: Any) -> str:
    """The message of an OpenAI-style error body (vLLM `{"error": {...}}`, SGLang `{"object": "error", ...}`,
    FastAPI `{"detail": ...}`), else the body shortened."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:400]
        if isinstance(err, str):
            return err[:400]
        for key in ("message", "detail"):
            if body.get(key):
                return str(body[key])[:400]
    text = body if isinstance(body, str) else json.dumps(body)
    return (text or "(empty body)")[:400]


class StreamResult:
    """What one SSE request did, with times in seconds from sending the request."""

    def __init__(self) -> None:
        self.status = 0
        self.error: str | None = None  # transport error, or the error body's message on a non-200
        self.body: Any = None  # the error body on a non-200
        self.chunks: list[dict[str, Any]] = []  # parsed `data:` JSON events, in order
        self.bad_events: list[str] = []  # `data:` payloads that were not JSON
        self.first_chunk_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.done_s: float | None = None  # `data: [DONE]`
        self.closed_s: float | None = None  # the response ended (EOF)
        self.hung: dict[str, Any] | None = None  # {"phase", "waited_s", "limit_s"} when a deadline passed
        self.cancelled = False  # the caller stopped after the first chunk
        self.seconds = 0.0

    def as_dict(self) -> dict[str, Any]:
        keys = ("status", "error", "first_chunk_s", "first_token_s", "last_token_s", "done_s", "closed_s", "hung",
                "cancelled", "seconds")  # fmt: skip
        out = {k: getattr(self, k) for k in keys}
        out["chunks"] = len(self.chunks)
        return out


def _is_token(chunk: dict[str, Any]) -> bool:
    for ch in chunk.get("choices") or []:
        if not isinstance(ch, dict):
            continue
        delta = ch.get("delta") or {}
        if isinstance(delta, dict) and (any(delta.get(f) for f in TOKEN_FIELDS) or delta.get("tool_calls")):
            return True
        if ch.get("text"):
            return True
    return False


def _finish_reason(chunk: dict[str, Any]) -> str | None:
    for ch in chunk.get("choices") or []:
        if isinstance(ch, dict) and ch.get("finish_reason"):
            return str(ch["finish_reason"])
    return None


class Client:
    """Requests to one OpenAI-compatible API (base URL, API key, extra headers), each with a timeout."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60.0,
        ca_file: str | None = None,
    ) -> None:
        self.scheme, self.host, self.port, self.prefix = split_base(url)
        self.api_key, self.headers, self.timeout = api_key, dict(headers or {}), float(timeout)
        self.ca_file = ca_file

    @property
    def base(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.prefix}"

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self.scheme == "https":
            ctx = ssl.create_default_context(cafile=self.ca_file)
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=ctx)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def _headers(self, body: bytes | None, stream: bool = False) -> dict[str, str]:
        h = {"Accept": "text/event-stream" if stream else "application/json", **self.headers}
        if body is not None:
            h["Content-Type"] = "application/json"
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _send(
        self, box: dict[str, Any], method: str, path: str, data: bytes | None, timeout: float, *, stream: bool = False
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Connect, send and read the response's head; the socket goes into box["sock"] first, so the waiting
        thread can abort a request that hangs (_abort)."""
        conn = self._connection(timeout)
        conn.connect()
        box["sock"] = conn.sock
        conn.request(method, self.prefix + path, body=data, headers=self._headers(data, stream=stream))
        return conn, conn.getresponse()

    # -- plain requests ---------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Reply:
        """One request, answered within `timeout` seconds (connect, headers and body together) or not at all."""
        limit = self.timeout if timeout is None else float(timeout)
        data = json.dumps(body).encode() if body is not None else None
        box: dict[str, Any] = {}
        done = threading.Event()
        t0 = time.monotonic()

        def work() -> None:
            try:
                conn, resp = self._send(box, method, path, data, limit)
                raw = resp.read()
                box["status"], box["raw"] = resp.status, raw
                conn.close()
            except (OSError, http.client.HTTPException) as e:
                box["error"] = _transport_error(e)
                box["hung"] = isinstance(e, socket.timeout)
            finally:
                done.set()

        threading.Thread(target=work, daemon=True, name="accept-http").start()
        # The socket's own timeout (the same limit, per operation) may end the request first when this thread
        # wakes late on a loaded host: a hang reads the same whichever deadline noticed it.
        if not done.wait(limit) or box.get("hung"):
            _abort(box.get("sock"))
            waited = time.monotonic() - t0
            return Reply(0, None, f"no answer within {waited:.1f} s (the request hung; limit {limit:g} s)", waited)
        seconds = time.monotonic() - t0
        if "error" in box:
            return Reply(0, None, box["error"], seconds)
        return Reply(box["status"], _decode(box["raw"]), None, seconds)

    def get(self, path: str, timeout: float | None = None) -> Reply:
        return self.request("GET", path, None, timeout)

    def post(self, path: str, body: Any, timeout: float | None = None) -> Reply:
        return self.request("POST", path, body, timeout)

    # -- streams ----------------------------------------------------------------------------------

    def stream(  # noqa: PLR0912, PLR0915 (one loop over the stream's events and deadlines)
        self,
        path: str,
        body: dict[str, Any],
        *,
        first_token_s: float,
        idle_s: float,
        close_s: float,
        total_s: float,
        stop_after_first_chunk: bool = False,
    ) -> StreamResult:
        """POST `body` (with stream: true) and read the SSE answer under the deadlines (see the module doc)."""
        res = StreamResult()
        data = json.dumps(body).encode()
        q: queue.Queue = queue.Queue()
        box: dict[str, Any] = {}
        t0 = time.monotonic()

        def work() -> None:
            try:
                _, resp = self._send(box, "POST", path, data, total_s, stream=True)
                ctype = resp.getheader("Content-Type") or ""
                if resp.status != 200 or "event-stream" not in ctype:
                    q.put(("reply", resp.status, resp.read(), ctype))
                    return
                q.put(("status", resp.status))
                while True:
                    line = resp.readline(MAX_LINE)
                    if not line:
                        q.put(("eof", time.monotonic()))
                        return
                    q.put(("line", line, time.monotonic()))
            except (OSError, http.client.HTTPException, ValueError) as e:
                q.put(("error", _transport_error(e), time.monotonic(), isinstance(e, socket.timeout)))

        threading.Thread(target=work, daemon=True, name="accept-sse").start()
        pending: list[str] = []  # data lines of the event being read
        last_event = t0
        end_at: float | None = None  # when the stream said it was finished (the last token, else that event)
        while True:
            now = time.monotonic()
            if end_at is not None:  # finish_reason or [DONE] seen: only the close is left
                phase, limit, waited_from = "close", end_at + close_s, end_at
            elif res.first_token_s is None:
                phase, limit, waited_from = "first token", t0 + first_token_s, t0
            else:
                phase, limit = "between chunks", last_event + idle_s
                waited_from = last_event
            if t0 + total_s < limit:
                phase, limit, waited_from = "whole request", t0 + total_s, t0
            try:
                ev = q.get(timeout=max(0.0, limit - now))
            except queue.Empty:
                _abort(box.get("sock"))
                res.hung = {"phase": phase, "waited_s": round(time.monotonic() - waited_from, 2),
                            "limit_s": round(limit - waited_from, 2)}  # fmt: skip
                break
            kind = ev[0]
            if kind == "status":
                res.status = ev[1]
                continue
            if kind == "reply":
                res.status, res.body = ev[1], _decode(ev[2])
                res.error = error_message(res.body) if ev[1] != 200 else f"not an event stream (Content-Type {ev[3]!r})"
                break
            if kind == "error":
                if ev[3]:  # the socket's own timeout noticed the hang before this loop woke (a loaded host): the same
                    _abort(box.get("sock"))
                    res.hung = {"phase": phase, "waited_s": round(ev[2] - waited_from, 2),
                                "limit_s": round(limit - waited_from, 2)}  # fmt: skip
                else:
                    res.error = ev[1]
                break
            if kind == "eof":
                res.closed_s = round(ev[1] - t0, 3)
                break
            line, at = ev[1], ev[2]
            last_event = at
            text = line.decode("utf-8", errors="replace").rstrip("\r\n")
            if text.startswith("data:"):
                pending.append(text[5:].lstrip(" ") if text[5:6] == " " else text[5:])
                continue
            if text or not pending:
                continue  # a comment (`: ping`), another field, or a stray blank line
            payload, pending = "\n".join(pending), []
            rel = round(at - t0, 3)
            if res.first_chunk_s is None:
                res.first_chunk_s = rel
            if payload.strip() == "[DONE]":
                res.done_s = rel
                end_at = end_at or (t0 + res.last_token_s if res.last_token_s is not None else at)
                continue
            try:
                chunk = json.loads(payload)
            except ValueError:
                res.bad_events.append(payload[:200])
                continue
            if not isinstance(chunk, dict):
                res.bad_events.append(payload[:200])
                continue
            res.chunks.append(chunk)
            if _is_token(chunk):
                res.first_token_s = rel if res.first_token_s is None else res.first_token_s
                res.last_token_s = rel
            if end_at is None and _finish_reason(chunk):
                end_at = t0 + res.last_token_s if res.last_token_s is not None else at
            if stop_after_first_chunk:
                res.cancelled = True
                _abort(box.get("sock"))
                break
        res.seconds = round(time.monotonic() - t0, 3)
        return res


def _abort(sock: socket.socket | None) -> None:
    """End a request whose deadline passed: shutting the socket down wakes the worker's blocked read."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def _transport_error(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused (nothing listens on that port: is the engine up and the URL's port right?)"
    if isinstance(e, socket.timeout):
        return f"timed out ({e})"
    if isinstance(e, socket.gaierror):
        return f"cannot resolve the host ({e})"
    if isinstance(e, ssl.SSLError):
        return f"TLS error ({e})"
    return f"{type(e).__name__}: {e}"


def _decode(raw: bytes) -> Any:
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text[:2000]
