"""llmfleet_port_check: probe options -> preflight.probe_ports; listen binds real loopback ports."""

import socket

import pytest

import llmfleet_port_check as mod
from tests.unit.modules.util import Recorder, fail, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")


@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_probe_options_become_the_probe_call(monkeypatch, check):
    probe = Recorder({"node2": {"50080": "open"}})
    monkeypatch.setattr(mod, "probe_ports", probe)
    res = run(
        mod, {"mode": "probe", "ports": ["50080"], "targets": {"node2": "10.0.0.12"}, "timeout": "1.5"}, check=check
    )
    assert probe.args == ({"node2": "10.0.0.12"}, [50080], 1.5)
    assert res == {"changed": False, "reachability": {"node2": {"50080": "open"}}}
    assert not undocumented(mod, res)


def test_probe_defaults(monkeypatch):
    probe = Recorder({})
    monkeypatch.setattr(mod, "probe_ports", probe)
    run(mod, {"mode": "probe", "ports": [1]})
    assert probe.args == ({}, [1], 3.0)


def test_listen_binds_reports_and_removes_the_ready_file(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    taken = busy.getsockname()[1]
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    ready = tmp_path / "ready"
    try:
        res = run(mod, {"mode": "listen", "bind": "127.0.0.1", "ports": [port, taken], "duration": 0.2,
                        "ready_file": str(ready)})  # fmt: skip
    finally:
        busy.close()
    assert res["listening"] == [{"port": port, "state": "listening"}, {"port": taken, "state": "in use"}]
    assert not ready.exists() and res["changed"] is False
    assert not undocumented(mod, res)


@pytest.mark.parametrize(
    ("args", "text"),
    [
        ({"ports": [1]}, "missing required arguments: mode"),
        ({"mode": "scan", "ports": [1]}, "value of mode must be one of: listen, probe, got: scan"),
        ({"mode": "probe", "ports": ["http"]}, "Elements value for option 'ports' is of type str and we were unable to convert to int"),
        ({"mode": "probe", "ports": [1], "targets": ["node2"]}, "argument 'targets' is of type list and we were unable to convert to dict"),
    ],
)  # fmt: skip
def test_bad_options_fail_naming_them(monkeypatch, args, text):
    probe = Recorder({})
    monkeypatch.setattr(mod, "probe_ports", probe)
    assert text in fail(mod, args)["msg"]
    assert probe.calls == []
