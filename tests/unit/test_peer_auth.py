"""The staging peer server serves the deployment's nodes only: every request proves the deployment's fabric key
(fabric_key.PEER_HEADER); anything else gets 403 and no bytes, and is counted. Real servers on localhost."""

import http.client
import json
import socket
import threading
import time

import pytest

from llmfleet import fabric_key
from llmfleet.stage import peer, store, swarm, transfer
from llmfleet.stage.errors import StageError
from llmfleet.stage.manifest import build_manifest
from llmfleet.stage.staging import StageRequest

REV = "b" * 40
KEY = b"the-deployments-fabric-key-0123456789abcdef"


@pytest.fixture
def server(tmp_path):
    """A node that has published its revision (one file, 'weights.bin') and serves it."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"W" * 4096)
    manifest = build_manifest(str(src), revision=REV)
    rdir = tmp_path / "m" / f".partial-{REV}"
    rdir.mkdir(parents=True)
    (rdir / "weights.bin").write_bytes(b"W" * 4096)
    store.Journal(str(rdir)).add({**manifest["files"][0], "mtime_ns": (rdir / "weights.bin").stat().st_mtime_ns})
    state = peer.PeerState(str(tmp_path / "m"), REV, manifest, "n1", key=KEY)
    srv = peer.serve_in_background(state, "127.0.0.1", 0)
    yield state, srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def get(port, target, header=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", target, headers={fabric_key.PEER_HEADER: header} if header else {})
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, body


@pytest.mark.parametrize("target", ["/status", "/status?seen=x&wait=0&from=n2", "/files/weights.bin"])
@pytest.mark.parametrize(
    "proof",
    [
        None,
        "v1 n2 1 00000000000000000000000000000000 " + "0" * 64,
        fabric_key.sign_request(b"another-deployments-key-0123456789abcdef", "n2", "GET", "/status"),
    ],
    ids=["no-proof", "garbage", "other-key"],
)
def test_a_stranger_gets_403_and_no_bytes(server, target, proof):
    """Before: any host on the fabric got the file list from /status and the weights from /files/."""
    state, port = server
    status, body = get(port, target, proof)
    assert status == 403
    assert b"weights" not in body and b"W" * 64 not in body
    assert state.refused == 1 and state.refused_from[0].startswith("127.0.0.1:"), state.refused_from
    assert state.served_bytes == 0 and not state.seen_done


def test_a_node_with_the_key_is_served(server):
    state, port = server
    src = transfer.PeerSource(f"http://127.0.0.1:{port}", key=KEY, me="n2")
    assert src.status()["have"] == ["weights.bin"]
    with src.open("weights.bin") as r:
        assert r.read() == b"W" * 4096
    assert state.refused == 0


def test_a_recorded_request_cannot_be_replayed_nor_reused_for_another_path(server):
    state, port = server
    proof = fabric_key.sign_request(KEY, "n2", "GET", "/status")
    assert get(port, "/status", proof)[0] == 200
    assert get(port, "/status", proof)[0] == 403  # the same request again
    assert get(port, "/files/weights.bin", proof)[0] == 403  # its proof is for /status only
    stale = fabric_key.sign_request(KEY, "n2", "GET", "/status", now=time.time() - 2 * fabric_key.FRESH_S)
    assert get(port, "/status", stale)[0] == 403
    assert state.refused == 3
    assert any("behind this node's clock" in r for r in state.refused_from), state.refused_from


def test_who_asks_is_the_node_its_proof_names_not_from(server):
    """`from=` let anyone mark any node as having seen this one done (so it stopped serving before that node
    had its files); now the asker is the node the proof names, and only a node with the key is one."""
    state, port = server
    state.done = True
    assert get(port, "/status?from=n3")[0] == 403
    target = "/status?from=n3"
    assert get(port, target, fabric_key.sign_request(KEY, "n2", "GET", target))[0] == 200
    assert state.seen_done == {"n2"}


def test_staging_with_peers_needs_the_key(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"a")
    req = StageRequest(root=str(tmp_path / "n"), model="m", revision=REV, manifest=build_manifest(str(src)))
    cfg = swarm.SwarmConfig(me="n1", source_dir=str(src), lease_dir=str(tmp_path / "l"),
                            peers={"n2": "http://127.0.0.1:9"}, finish_wait=0)  # fmt: skip
    with pytest.raises(StageError, match="needs the deployment's fabric key"):
        swarm.run_node(req, cfg)


def test_the_status_answer_of_a_refused_request_is_not_json(server):
    _, port = server
    status, body = get(port, "/status")
    assert status == 403
    with pytest.raises(ValueError):
        json.loads(body)


def test_key_file_must_be_private(tmp_path):
    f = tmp_path / "dep.fabric-key"
    f.write_text("k" * 40)
    f.chmod(0o644)
    with pytest.raises(fabric_key.FabricKeyError, match="another account can read or replace it"):
        fabric_key.load_key_file(str(f))
    f.chmod(0o600)
    assert fabric_key.load_key_file(str(f)) == b"k" * 40
    (tmp_path / "link").symlink_to(f)
    with pytest.raises(fabric_key.FabricKeyError, match="cannot open it"):
        fabric_key.load_key_file(str(tmp_path / "link"))
    f.write_text("short")
    with pytest.raises(fabric_key.FabricKeyError, match="at least 32"):
        fabric_key.load_key_file(str(f))


def test_the_replay_cache_holds_only_the_freshness_window():
    """A long staging run signs many requests: the cache keeps each nonce for 2 x FRESH_S, then forgets it."""
    guard = fabric_key.RequestGuard(KEY)
    t0 = time.time()
    for i in range(3000):
        now = t0 + i * 0.5  # a request every half second for 25 min
        guard.check(fabric_key.sign_request(KEY, "n2", "GET", "/status", now=now), "GET", "/status", now=now)
    assert len(guard._seen) <= 2 * fabric_key.FRESH_S / 0.5 + 1


def test_silent_connections_are_bounded_per_address_and_closed_after_the_request_timeout(tmp_path, monkeypatch):
    """A connection that sent nothing held a server thread until the staging run ended. Now it must send its request
    within REQUEST_TIMEOUT_S, and an address may hold MAX_UNVERIFIED_PER_ADDR connections whose proof is not checked
    yet: past that a new one is closed at once and counted as refused; a node from another address is served."""
    monkeypatch.setattr(peer, "REQUEST_TIMEOUT_S", 1.0)
    monkeypatch.setattr(peer, "MAX_UNVERIFIED_PER_ADDR", 3)
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"W" * 4096)
    manifest = build_manifest(str(src), revision=REV)
    state = peer.PeerState(str(tmp_path / "m"), REV, manifest, "n1", key=KEY)
    srv = peer.make_server(state, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    port = srv.server_address[1]
    try:
        silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        t0 = time.monotonic()
        assert extra.recv(1) == b"" and time.monotonic() - t0 < 0.9  # closed at once
        assert state.refused == 1 and "have not sent their request yet" in state.refused_from[0]
        # a node on another address is served meanwhile
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=("127.0.0.2", 0))
        c.request(
            "GET", "/status", headers={fabric_key.PEER_HEADER: fabric_key.sign_request(KEY, "n2", "GET", "/status")}
        )
        assert c.getresponse().status == 200
        c.close()
        # the silent ones are closed by the server once their request timeout passes
        t0 = time.monotonic()
        for s in silent:
            assert s.recv(1) == b""
        assert time.monotonic() - t0 < 3
        assert get(port, "/status", fabric_key.sign_request(KEY, "n2", "GET", "/status"))[0] == 200  # room again
    finally:
        srv.shutdown()
        srv.server_close()
