#!/usr/bin/env python3
"""What a staging receiver costs per GiB on one many-core machine: the same copy (hash + write, transfer.copy_stream)
from a local file, from a peer over loopback HTTP as staging does it now, and two cheaper ways of taking the same
bytes (the response read until the 16 MiB buffer is full; recv_into with MSG_WAITALL on the raw socket). The peer
server (peer.make_server) runs in a process of its own, so the CPU figures are the receiver's alone.

    python3 tests/device/recv_cost.py OUT [--gb 2] [--repeat 3] [--base /dev/shm]
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import multiprocessing as mp
import os
import resource
import shutil
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "module_utils"))

from llmfleet.stage import peer, transfer  # noqa: E402

REV = "e" * 40
FABRIC_KEY = b"recv-cost-fabric-key-0123456789abcdef"  # every peer request proves it, as on nodes
NAME = "model-00001-of-00001.safetensors"
CHUNK = transfer.CHUNK


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Counting:
    """The response as copy_stream reads it, counting the reads that return data."""

    def __init__(self, src):
        self.src, self.reads = src, 0

    def readinto(self, b):
        n = self.src.readinto(b)
        self.reads += bool(n)
        return n


class Filling(Counting):
    """Each readinto fills the whole buffer (or ends the body): one hash update and one write per 16 MiB."""

    def readinto(self, b):
        view, got = memoryview(b), 0
        while got < len(view):
            n = self.src.readinto(view[got:])
            if not n:
                break
            got += n
        self.reads += bool(got)
        return got


def serve(mdir: str, manifest: dict, port: mp.Value) -> None:
    state = peer.PeerState(mdir, REV, manifest, "seed", key=FABRIC_KEY)
    state.done = True
    server = peer.make_server(state, "127.0.0.1", 0)
    port.value = server.server_address[1]
    server.serve_forever(poll_interval=0.05)


def raw_waitall(port: int, size: int, dst: str) -> tuple[str, int]:
    """The bytes straight off the socket: the request by hand, recv_into(MSG_WAITALL) into the 16 MiB buffer."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"GET /files/{NAME} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(4096)
    head, rest = head.split(b"\r\n\r\n", 1)
    h, buf, n_total, reads = hashlib.sha256(rest), bytearray(CHUNK), len(rest), 0
    view = memoryview(buf)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, rest)
    while n_total < size:
        n = s.recv_into(view, min(CHUNK, size - n_total), socket.MSG_WAITALL)
        if not n:
            break
        reads += 1
        h.update(view[:n])
        w = 0
        while w < n:
            w += os.write(fd, view[w:n])
        n_total += n
    os.close(fd)
    s.close()
    return h.hexdigest(), reads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--gb", type=float, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--base", type=Path, default=Path("/dev/shm"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.base / f"recv-cost-{os.getpid()}"
    rdir = work / "m" / REV
    rdir.mkdir(parents=True)
    size = int(a.gb * 1024**3) // CHUNK * CHUNK
    block = os.urandom(CHUNK)
    with open(rdir / NAME, "wb") as f:
        for i in range(size // CHUNK):
            f.write(block[i % 97 :] + block[: i % 97])
    sha = hashlib.sha256()
    with open(rdir / NAME, "rb") as f:
        while b := f.read(CHUNK):
            sha.update(b)
    want = {"path": NAME, "size": size, "sha256": sha.hexdigest()}
    manifest = {"files": [want]}
    port = mp.Value("i", 0)
    srv = mp.get_context("fork").Process(target=serve, args=(str(work / "m"), manifest, port), daemon=True)
    srv.start()
    while not port.value:
        time.sleep(0.01)
    dst = str(work / "dst")
    rows = []
    try:
        for rep in range(a.repeat):
            for how in ("local file", "peer, as staged now", "peer, buffer filled", "peer, recv_into WAITALL"):
                if os.path.exists(dst):
                    os.unlink(dst)
                c0, t0 = cpu(), time.monotonic()
                reads = None
                if how == "local file":
                    with transfer.LocalSource(str(rdir)).open(NAME) as src:
                        got = transfer.copy_stream(src, dst, want, None, from_peer=False)
                elif how == "peer, recv_into WAITALL":
                    got, reads = raw_waitall(port.value, size, dst)
                else:
                    wrap = Counting if how == "peer, as staged now" else Filling
                    seed = transfer.PeerSource(f"http://127.0.0.1:{port.value}", key=FABRIC_KEY, me="recv")
                    with seed.open(NAME) as resp:
                        src = wrap(resp)
                        got = transfer.copy_stream(src, dst, want, None, from_peer=True)
                        reads = src.reads
                wall, used = time.monotonic() - t0, cpu() - c0
                assert got == want["sha256"], how
                gib = size / 1024**3
                rows.append({"repeat": rep, "how": how, "wall_s": round(wall, 3), "cpu_s": round(used, 3),
                             "cpu_s_per_gib": round(used / gib, 3), "gib_per_s": round(gib / wall, 2),
                             "reads": reads})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    except (OSError, http.client.HTTPException, AssertionError) as e:
        print(f"failed: {e}", file=sys.stderr)
        return 1
    finally:
        srv.kill()
        shutil.rmtree(work, ignore_errors=True)
    (a.out / "recv-cost.json").write_text(json.dumps(rows, indent=1))
    print("\n| how | wall s | receiver CPU-s per GiB | GiB/s | reads |\n|---|---:|---:|---:|---:|")
    for how in dict.fromkeys(r["how"] for r in rows):
        rs = [r for r in rows if r["how"] == how]
        best = min(rs, key=lambda r: r["cpu_s"])
        print(f"| {how} | {best['wall_s']} | {best['cpu_s_per_gib']} | {best['gib_per_s']} | {best['reads']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
