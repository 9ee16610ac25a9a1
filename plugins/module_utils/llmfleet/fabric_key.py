"""The deployment's fabric key: a secret only root on the deployment's nodes can read (the play writes it,
root-only, to <config dir>/credentials/<deployment>.fabric-key). Every listener of the deployment on the fabric
(the wrappers' deployment link, the staging peer servers) takes a peer as one of the deployment's nodes only
when it proves it holds the key; docs/security.md has the threat model.

- The link (wrapper_link.py): an HMAC-SHA256 challenge-response both ways on HELLO, with a fresh nonce from
  each side, then a per-connection session key that tags every later line with its direction and sequence
  number (a recorded exchange cannot be replayed; a line injected into the TCP stream is refused).
- The peer server (peer.py): every request carries ``X-Llmfleet-Peer: v1 <node> <ms> <nonce> <mac>``, an HMAC
  over the method, the path with its query, the node, the time and the nonce; the server checks the MAC, the
  time against its own clock (FRESH_S either way) and that the nonce was not seen in that window.

Stdlib only, Python >= 3.8 (copied to nodes).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import re
import secrets
import stat
import threading
import time

MIN_KEY_CHARS = 32
PEER_HEADER = "X-Llmfleet-Peer"
# A signed peer request is accepted this long either side of the server's clock: the nodes' clocks must agree
# within it (NTP/chrony); a request is signed just before it is sent, so network time hardly counts.
FRESH_S = 120.0
_TOKEN = re.compile(r"[A-Za-z0-9_.@:-]{1,253}")
_HEX = re.compile(r"[0-9a-f]{32,128}")


class FabricKeyError(Exception):
    """The key file is missing, unsafe or malformed (the message names the file and the fix)."""


def load_key_file(path: str) -> bytes:
    """The key in a root-only file: a regular file (a link is not followed, a FIFO not waited on), owned by this
    process's user (root on a node) and readable by nobody else, holding at least MIN_KEY_CHARS characters."""
    fix = "rerun the play (the llmfleet role writes it, owner root, mode 0600)"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise FabricKeyError(f"fabric key {path}: cannot open it ({e.strerror}): {fix}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FabricKeyError(f"fabric key {path}: not a regular file: {fix}")
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise FabricKeyError(
                f"fabric key {path}: owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}: another account "
                f"can read or replace it; it must be owned by uid {os.geteuid()} with mode 0600: {fix}"
            )
        data = os.read(fd, 65536)
    finally:
        os.close(fd)
    return parse_key(data.decode("utf-8", "replace"), path)


def parse_key(text: str, where: str) -> bytes:
    value = text.strip()
    if len(value) < MIN_KEY_CHARS or any(c.isspace() for c in value):
        raise FabricKeyError(
            f"fabric key {where}: {len(value)} characters; at least {MIN_KEY_CHARS} without spaces expected: rerun "
            "the play with llmfleet_fabric_key_rotate=true to make a new one"
        )
    return value.encode("utf-8")


def nonce() -> str:
    return secrets.token_hex(16)


def mac(key: bytes, *parts: str) -> str:
    """HMAC-SHA256 over the parts, each length-prefixed (no two part lists sign the same bytes)."""
    msg = b"".join(len(p.encode()).to_bytes(4, "big") + p.encode() for p in parts)
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode("ascii", "replace"), b.encode("ascii", "replace"))


# ---- the peer server's requests


def sign_request(key: bytes, node: str, method: str, target: str, now: float | None = None) -> str:
    """The PEER_HEADER value for one request (target: the path with its query, as sent)."""
    ms = str(int((time.time() if now is None else now) * 1000))
    n = nonce()
    return f"v1 {node} {ms} {n} {mac(key, 'llmfleet-peer v1', method, target, node, ms, n)}"


class Refused(Exception):
    """A peer request without valid proof of the key (the message says why, without the key)."""


class RequestGuard:
    """Checks PEER_HEADER on the server side: MAC, freshness, replay (a nonce is accepted once in its window)."""

    def __init__(self, key: bytes, fresh_s: float = FRESH_S) -> None:
        if not key:
            raise ValueError("a peer server needs the deployment's fabric key")
        self.key = key
        self.fresh_s = fresh_s
        self._seen: set[str] = set()  # nonces accepted in the last 2 * fresh_s ...
        self._expiry: collections.deque = collections.deque()  # ... and when each leaves it, oldest first
        self._lock = threading.Lock()

    def check(self, header: str | None, method: str, target: str, now: float | None = None) -> str:
        """The node the request proves it comes from (one of the deployment's, holding the key); Refused otherwise."""
        if not header:
            raise Refused(f"no {PEER_HEADER} header (not a node of this deployment, or an older llmfleet)")
        parts = header.split(" ")
        if len(parts) != 5 or parts[0] != "v1":
            raise Refused(f"malformed {PEER_HEADER} header")
        _, node, ms, n, got = parts
        if not _TOKEN.fullmatch(node) or not ms.isdigit() or not _HEX.fullmatch(n) or not _HEX.fullmatch(got):
            raise Refused(f"malformed {PEER_HEADER} header")
        if not same(got, mac(self.key, "llmfleet-peer v1", method, target, node, ms, n)):
            raise Refused("wrong proof of the fabric key (another deployment's key, a rotated key, or a forgery)")
        t = time.time() if now is None else now
        skew = int(ms) / 1000.0 - t
        if abs(skew) > self.fresh_s:
            raise Refused(
                f"signed {abs(skew):.0f} s {'ahead of' if skew > 0 else 'behind'} this node's clock (more than "
                f"{self.fresh_s:g} s): a replayed request, or the nodes' clocks disagree (sync them with NTP)"
            )
        with self._lock:
            while self._expiry and self._expiry[0][0] <= t:  # only requests with the key get here: no flood
                self._seen.discard(self._expiry.popleft()[1])
            if n in self._seen:
                raise Refused("a nonce seen before (a replayed request)")
            self._seen.add(n)
            self._expiry.append((t + 2 * self.fresh_s, n))
        return node


# ---- the deployment link's handshake


def head_proof(key: bytes, node: str, worker_nonce: str, head_nonce: str) -> str:
    return mac(key, "llmfleet-link head", node, worker_nonce, head_nonce)


def worker_proof(key: bytes, node: str, worker_nonce: str, head_nonce: str) -> str:
    return mac(key, "llmfleet-link worker", node, worker_nonce, head_nonce)


def session_key(key: bytes, node: str, worker_nonce: str, head_nonce: str) -> bytes:
    return bytes.fromhex(mac(key, "llmfleet-link session", node, worker_nonce, head_nonce))


def line_tag(session: bytes, sender: str, seq: int, line: str) -> str:
    return mac(session, sender, str(seq), line)[:32]


def is_token(text: str) -> bool:
    return bool(_TOKEN.fullmatch(text))


def is_nonce(text: str) -> bool:
    return bool(_HEX.fullmatch(text))
