"""llmfleet_reserved_ports: the claims' ports in the kernel's reservation (a file standing in for /proc/sys), the
site's own entries kept, llmfleet's released when their claim goes; the wait on a real loopback connection."""

import json
import socket
import sys
import threading
import time

import pytest

import llmfleet_reserved_ports as mod
from llmfleet import reserved_ports as rp
from tests.unit.modules.util import fail, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A claims directory, a sysctl file holding the site's own reservation (9000-9001) and the sysctl.d file."""
    claims = tmp_path / "gpus"
    claims.mkdir()
    sysctl = tmp_path / "ip_local_reserved_ports"
    sysctl.write_text("9000-9001\n")
    # The module's own copy of the package (imported through the collection): never this machine's /proc/sys.
    for m in {rp, sys.modules[mod.converge.__module__]}:
        monkeypatch.setattr(m, "SYSCTL", str(sysctl))
    return claims, sysctl, tmp_path / "60-llmfleet-reserved-ports.conf"


def claim(claims, name, **ports):
    (claims / f"{name}.json").write_text(json.dumps({"deployment": name, "gpus": [], "ports": ports}))


def test_parse_and_format_round_trip():
    assert rp.parse_ranges("50080,50082, 60000-60002\n") == {50080, 50082, 60000, 60001, 60002}
    assert rp.format_ranges({50080, 50081, 50082, 8000, 60000}) == "8000,50080-50082,60000"
    assert rp.format_ranges(set()) == "" and rp.parse_ranges("") == set()
    for bad in ("x", "0", "70000", "5-3"):
        with pytest.raises(rp.PortsError, match="not a port"):
            rp.parse_ranges(bad)


def test_claims_reserved_site_entries_kept_then_released(node):
    claims, sysctl, conf = node
    claim(claims, "demo", api=8000, dist=50080, link=50082)
    claim(claims, "other", api=8001)
    res = run(mod, {"claim_dir": str(claims), "file": str(conf), "wait": 0})
    assert res["changed"] and res["ports"] == [8000, 8001, 50080, 50082]
    assert sysctl.read_text() == "8000-8001,9000-9001,50080,50082\n"
    assert res["added"] == [8000, 8001, 50080, 50082] and res["released"] == []
    text = conf.read_text()
    assert "# llmfleet's ports: 8000-8001,50080,50082\n" in text
    assert "net.ipv4.ip_local_reserved_ports = 8000-8001,9000-9001,50080,50082\n" in text
    assert res["claimed"]["50082"] == "demo link" and not undocumented(mod, res)
    # again: nothing to do
    assert not run(mod, {"claim_dir": str(claims), "file": str(conf), "wait": 0})["changed"]
    # demo's claim gone: its ports released, other's and the site's kept
    (claims / "demo.json").unlink()
    res = run(mod, {"claim_dir": str(claims), "file": str(conf), "wait": 0})
    assert res["released"] == [8000, 50080, 50082] and sysctl.read_text() == "8001,9000-9001\n"
    # no claim left: the file goes, the site's reservation stays
    (claims / "other.json").unlink()
    res = run(mod, {"claim_dir": str(claims), "file": str(conf), "wait": 0})
    assert res["changed"] and not conf.exists() and sysctl.read_text() == "9000-9001\n"


def test_check_mode_sees_the_role_ports_and_writes_nothing(node):
    claims, sysctl, conf = node
    res = run(mod, {"claim_dir": str(claims / "absent"), "file": str(conf), "ports": [50082]}, check=True)
    assert res["changed"] and res["added"] == [50082] and res["waited"] == 0
    assert sysctl.read_text() == "9000-9001\n" and not conf.exists()


def test_a_port_the_site_reserved_itself_stays_when_the_claim_goes(node):
    claims, sysctl, conf = node
    claim(claims, "demo", api=9000, link=50082)
    res = run(mod, {"claim_dir": str(claims), "file": str(conf), "wait": 0})
    assert res["added"] == [50082] and "# llmfleet's ports: 50082\n" in conf.read_text()
    (claims / "demo.json").unlink()
    res = run(mod, {"claim_dir": str(claims), "file": str(conf), "wait": 0})
    assert res["released"] == [50082] and sysctl.read_text() == "9000-9001\n"


def test_bad_claim_names_the_file(node):
    claims, _, conf = node
    (claims / "demo.json").write_text("{not json")
    msg = fail(mod, {"claim_dir": str(claims), "file": str(conf)})["msg"]
    assert f"{claims}/demo.json is not a deployment claim" in msg


def test_bad_port_option():
    assert "70000 is not a TCP port" in fail(mod, {"claim_dir": "/nonexistent", "ports": [70000]})["msg"]


def test_a_planted_symlink_as_the_file_is_not_followed(node, tmp_path):
    claims, _, conf = node
    target = tmp_path / "victim"
    target.write_text("keep\n")
    conf.symlink_to(target)
    msg = fail(mod, {"claim_dir": str(claims), "file": str(conf), "ports": [50082]})["msg"]
    assert str(conf) in msg and target.read_text() == "keep\n"


def _client_from(listener):
    """A real outgoing connection: its local port is what the kernel handed out."""
    c = socket.create_connection(listener.getsockname())
    a, _ = listener.accept()
    return c, a


def test_wait_until_the_connection_that_holds_a_port_ends():
    listener = socket.create_server(("127.0.0.1", 0))
    c, a = _client_from(listener)
    port = c.getsockname()[1]
    assert not rp.bindable(port)  # the failure the engine saw: an outgoing connection holds its port

    def end():  # the server side closes first: the client's port is free once it closes too (no TIME_WAIT there)
        time.sleep(1.5)
        a.close()
        time.sleep(0.2)
        c.close()

    t = threading.Thread(target=end)
    t.start()
    waited = rp.wait_released({port}, 20)
    t.join()
    listener.close()
    assert 1 <= waited < 20 and rp.bindable(port)


def test_wait_names_the_connection_at_the_deadline():
    listener = socket.create_server(("127.0.0.1", 0))
    c, a = _client_from(listener)
    port = c.getsockname()[1]
    try:
        with pytest.raises(rp.PortsError) as e:
            rp.wait_released({port}, 1)
        assert f"port {port} is reserved now" in str(e.value)
        assert f"{port}: ESTABLISHED to 127.0.0.1:{listener.getsockname()[1]}" in str(e.value)
    finally:
        a.close()
        c.close()
        listener.close()


def test_a_port_something_listens_on_is_not_waited_for():
    """The deployment's own engine, serving while llmfleet first reserves its ports (an upgrade of llmfleet)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        assert rp.wait_released({port}, 5) < 1
    finally:
        listener.close()
