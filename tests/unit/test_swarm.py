"""Fan-out: seeds read shared storage once, peers serve verified files, receivers verify."""

import http.server
import json
import os
import socket
import threading

import pytest

from llmfleet import checkpoint, stage, swarm
from llmfleet.manifest import build_manifest
from tests.helpers.ckpt import make_checkpoint

REV = "a" * 40


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def src(tmp_path):
    return make_checkpoint(tmp_path / "shared" / "m", shards=6, tensors_per_shard=2, shape=(128, 64))


def run_fleet(tmp_path, src, hosts, seeds, **cfg_kw):
    manifest = build_manifest(str(src))
    ports = {h: free_port() for h in hosts}
    peers = {h: f"http://127.0.0.1:{ports[h]}" for h in hosts}
    results, errors = {}, {}

    def node(h):
        req = stage.StageRequest(root=str(tmp_path / h), model="m", revision=REV, manifest=manifest, threads=2)
        cfg = swarm.SwarmConfig(
            me=h,
            source_dir=str(src),
            lease_dir=str(tmp_path / "leases"),
            peers=peers,
            seeds=seeds,
            serve_bind="127.0.0.1",
            serve_port=ports[h],
            finish_wait=30,
            **cfg_kw,
        )
        try:
            results[h] = swarm.run_node(req, cfg)
        except Exception as e:  # surfaced by the assertion below
            errors[h] = e

    ts = [threading.Thread(target=node, args=(h,)) for h in hosts]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    return manifest, results


def test_four_nodes_read_shared_storage_once(tmp_path, src):
    hosts = ["n1", "n2", "n3", "n4"]
    manifest, res = run_fleet(tmp_path, src, hosts, seeds=["n1", "n2"])
    total = manifest["total_bytes"]
    assert sum(r["source_bytes_read"] for r in res.values()) == total  # 1.0x, not 4.0x
    assert res["n3"]["source_bytes_read"] == res["n4"]["source_bytes_read"] == 0
    assert res["n1"]["source_bytes_read"] > 0 and res["n2"]["source_bytes_read"] > 0  # both seeds read their share
    for h in hosts:
        assert res[h]["bytes_copied"] == total and res[h]["source_fallback_files"] == []
        assert checkpoint.verify(str(tmp_path / h / "m" / REV), None).ok
    assert sum(r["served_bytes"] for r in res.values()) == 3 * total  # every node got what it lacked from peers


def test_already_published_node_serves_everything(tmp_path, src):
    manifest = build_manifest(str(src))
    stage.stage(
        stage.StageRequest(root=str(tmp_path / "n1"), model="m", revision=REV, manifest=manifest),
        lambda rel: [stage.LocalSource(str(src))],
    )
    _, res = run_fleet(tmp_path, src, ["n1", "n2", "n3"], seeds=[])
    assert res["n1"]["bytes_copied"] == 0
    assert res["n2"]["source_bytes_read"] == res["n3"]["source_bytes_read"] == 0
    assert res["n2"]["peer_bytes_read"] == res["n3"]["peer_bytes_read"] == manifest["total_bytes"]


def test_a_lying_peer_is_not_trusted(tmp_path, src):
    manifest = build_manifest(str(src))
    names = [e["path"] for e in manifest["files"]]

    class Liar(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path == "/status":
                body = json.dumps({"have": names, "done": False, "failed": None}).encode()
            else:
                rel = self.path[len("/files/") :]
                body = bytearray((src / rel).read_bytes())
                body[len(body) // 2] ^= 0xFF  # same size, wrong content
                body = bytes(body)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    liar = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Liar)
    threading.Thread(target=liar.serve_forever, daemon=True).start()
    req = stage.StageRequest(root=str(tmp_path / "n2"), model="m", revision=REV, manifest=manifest, threads=2)
    cfg = swarm.SwarmConfig(
        me="n2",
        source_dir=str(src),
        lease_dir=str(tmp_path / "leases"),
        peers={"liar": f"http://127.0.0.1:{liar.server_port}"},
        seeds=[],
        finish_wait=0,
    )
    try:
        r = swarm.run_node(req, cfg)
    finally:
        liar.shutdown()
    assert r["peer_bytes_read"] > 0  # it did try the peer ...
    assert r["source_bytes_read"] == manifest["total_bytes"]  # ... and re-read every file from the source
    rdir = tmp_path / "n2" / "m" / REV
    assert all((rdir / n).read_bytes() == (src / n).read_bytes() for n in names)


def test_dead_seed_falls_back_to_source(tmp_path, src):
    manifest = build_manifest(str(src))
    req = stage.StageRequest(root=str(tmp_path / "n2"), model="m", revision=REV, manifest=manifest)
    cfg = swarm.SwarmConfig(
        me="n2",
        source_dir=str(src),
        lease_dir=str(tmp_path / "leases"),
        peers={"n1": f"http://127.0.0.1:{free_port()}"},
        seeds=["n1"],
        peer_dead_after=0.5,
        finish_wait=1,
    )
    r = swarm.run_node(req, cfg)
    assert r["source_bytes_read"] == manifest["total_bytes"]
    assert sorted(r["source_fallback_files"]) == sorted(e["path"] for e in manifest["files"])
    assert os.path.isdir(tmp_path / "n2" / "m" / REV)
