#!/usr/bin/env python3
"""One lab node's side of the libtorrent fan-out benchmark (bench/stage_fanout.py starts it on every node).

A benchmark-only backend, never shipped to nodes: it runs under the bench's own venv (libtorrent's wheel,
`bench/stage_fanout.py` creates it), not under the nodes' Python.

    stage_torrent_node.py make SRC OUT.torrent            # a v2 (SHA-256) torrent of the revision directory
    stage_torrent_node.py node --torrent T --save DIR --me IP --peers IP,IP --manifest M --done DIR --nodes N [--seed]

`node` joins the swarm (TCP only, no tracker/DHT/LSD: every other node's address is given), downloads (or, with
--seed, serves the source in place), then checks every landed file against the llmfleet manifest's sha256 and
fsyncs it (the same verification and durability as llmfleet's staging), marks itself done, and keeps serving
until every node is done. It prints one JSON line: timings, payload bytes, bytes this process read from
storage (/proc/self/io), CPU-seconds (user + system, every libtorrent thread included).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import libtorrent as lt

PORT = 6881


def make(src: Path, out: Path) -> dict:
    t0 = time.monotonic()
    # Run from the revision's parent, so the torrent's paths are `<revision dir>/<file>` (list_files is relative).
    os.chdir(src.parent)
    ct = lt.create_torrent(lt.list_files(src.name), 0, lt.create_torrent.v2_only)
    ct.set_creator("llmfleet bench")
    lt.set_piece_hashes(ct, str(src.parent))
    out.write_bytes(lt.bencode(ct.generate()))
    return {"make_s": round(time.monotonic() - t0, 2), "piece_size": ct.piece_length(), "pieces": ct.num_pieces()}


def proc_io() -> dict:
    with open("/proc/self/io", encoding="ascii") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
        os.fsync(f.fileno())  # durable, as llmfleet's fdatasync before its rename
    return h.hexdigest()


def verify(a: argparse.Namespace, ses: lt.session, h: lt.torrent_handle, root: Path, deadline: float) -> None:
    """The same check as llmfleet's staging: every landed file's sha256 against the manifest, then durable."""
    # Complete means every piece passed libtorrent's own hash, which can read blocks still queued for the
    # disk: flush them before reading the files back.
    h.flush_cache()
    while not any(isinstance(al, lt.cache_flushed_alert) for al in ses.pop_alerts()):
        if time.monotonic() > deadline:
            raise SystemExit(f"{a.me}: the disk cache was not flushed within {a.timeout} s")
        ses.wait_for_alert(100)
    manifest = json.loads(Path(a.manifest).read_text())
    bad = [e["path"] for e in manifest["files"] if sha256_file(root / e["path"]) != e["sha256"]]
    if bad:
        raise SystemExit(f"{a.me}: sha256 differs from the manifest: {', '.join(bad)}")


def node(a: argparse.Namespace) -> dict:
    t0, io0 = time.monotonic(), proc_io()
    ses = lt.session(
        {
            "listen_interfaces": f"{a.me}:{PORT}",
            "enable_dht": False,
            "enable_lsd": False,
            "enable_upnp": False,
            "enable_natpmp": False,
            "enable_incoming_utp": False,  # TCP, as llmfleet's peers: uTP costs CPU a LAN does not need
            "enable_outgoing_utp": False,
            "allow_multiple_connections_per_ip": True,
            "alert_mask": lt.alert_category.error | lt.alert_category.storage,
            "min_reconnect_time": 1,
        }
    )
    atp = lt.add_torrent_params()
    atp.ti = lt.torrent_info(a.torrent)
    atp.save_path = a.save
    if a.seed:
        atp.flags |= lt.torrent_flags.seed_mode  # the source is whole: pieces are hashed when first sent
    h = ses.add_torrent(atp)
    done_dir = Path(a.done)
    peers = [ip for ip in a.peers.split(",") if ip and ip != a.me]
    deadline = t0 + a.timeout
    # No tracker: every node dials every other. A dial to a node that is not listening yet is retried after a
    # back-off of a minute, so every node first says it listens and waits for the others (as a tracker would).
    (done_dir / f"ready-{a.me}").write_text("listening\n")
    while len(list(done_dir.glob("ready-*"))) < a.nodes and time.monotonic() < deadline:
        time.sleep(0.02)
    for ip in peers:
        h.connect_peer((ip, PORT))
    while not h.status().is_seeding:
        if time.monotonic() > deadline:
            raise SystemExit(f"{a.me}: not complete after {a.timeout} s: {h.status().progress:.1%}")
        for al in ses.pop_alerts():
            if al.category() & lt.alert_category.error:
                print(f"{a.me}: {al.message()}", file=sys.stderr)
        time.sleep(0.05)
    got = time.monotonic()
    verify_s = 0.0
    if not a.seed:
        verify(a, ses, h, Path(a.save) / atp.ti.name(), deadline)
        verify_s = time.monotonic() - got
    (done_dir / f"done-{a.me}").write_text("done\n")
    done_at = time.monotonic()
    while len(list(done_dir.glob("done-*"))) < a.nodes:  # serve until every node has its copy
        if time.monotonic() > deadline:
            raise SystemExit(f"{a.me}: peers not done after {a.timeout} s")
        time.sleep(0.05)
    st = h.status()
    ses.pause()
    cpu = os.times()
    return {
        "node": a.me,
        "seed": a.seed,
        "complete_s": round(got - t0, 2),
        "verify_s": round(verify_s, 2),
        "done_s": round(done_at - t0, 2),
        "exit_s": round(time.monotonic() - t0, 2),
        "uploaded": st.total_payload_upload,
        "downloaded": st.total_payload_download,
        "cpu_s": round(cpu.user + cpu.system, 2),
        # what this process read (rchar: every read call, page cache or not; read_bytes: from the disk) and wrote
        **{k: v - io0[k] for k, v in proc_io().items() if k in ("rchar", "read_bytes", "write_bytes")},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("src", type=Path)
    m.add_argument("out", type=Path)
    n = sub.add_parser("node")
    for flag in ("--torrent", "--save", "--me", "--peers", "--manifest", "--done"):
        n.add_argument(flag, required=True)
    n.add_argument("--nodes", type=int, required=True)
    n.add_argument("--seed", action="store_true")
    n.add_argument("--timeout", type=float, default=240)
    a = ap.parse_args()
    print(json.dumps(make(a.src, a.out) if a.cmd == "make" else node(a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
