"""llmfleet_topology_facts: options -> topology.report; its result -> ansible_facts.llmfleet_topology."""

import pytest

import llmfleet_topology_facts as mod
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.checks.topology import (
    OverrideError,
    TopologyError,
)
from tests.unit.modules.util import Recorder, fail, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")

REPORT = {
    "topology": {"gpus": [{"bdf": "0000:18:00.0", "numa": 0}], "hcas": [{"name": "mlx5_0"}], "netdevs": {"eth1": {}},
                 "numa": {0: {"cpus": "0-31"}}, "rails": ["mlx5_0"], "non_rail_hcas": [], "rail_rule": "pcie-affinity"},
    "env": {"NCCL_SOCKET_IFNAME": "=eth1", "NCCL_IB_HCA": "=mlx5_0:1"},
    "socket_ifname": "eth1",
    "ib_ports": ["mlx5_0:1"],
    "warnings": [],
}  # fmt: skip


@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_options_become_the_report_call_and_the_facts(monkeypatch, tmp_path, check):
    report = Recorder(REPORT)
    monkeypatch.setattr(mod, "report", report)
    res = run(mod, {"node_ip": "10.0.0.11", "sysfs_root": str(tmp_path), "use_nvml": "no",
                    "overrides": {"NCCL_IB_GID_INDEX": 3}, "extra_env": {"NCCL_NVLS_ENABLE": 0}}, check=check)  # fmt: skip
    assert report.args == (str(tmp_path),)
    assert report.kwargs == {"node_ip": "10.0.0.11", "overrides": {"NCCL_IB_GID_INDEX": "3"}, "use_nvml": False,
                             "extra_env": {"NCCL_NVLS_ENABLE": 0}}  # fmt: skip
    assert res["changed"] is False and res["env"] == REPORT["env"] and res["warnings_list"] == []
    assert res["ansible_facts"] == {"llmfleet_topology": {
        "gpus": REPORT["topology"]["gpus"], "hcas": REPORT["topology"]["hcas"], "netdevs": {"eth1": {}},
        "numa": {"0": {"cpus": "0-31"}},  # string keys, as facts come back from JSON
        "env": REPORT["env"], "socket_ifname": "eth1", "ib_ports": ["mlx5_0:1"], "warnings": [],
        "rails": ["mlx5_0"], "non_rail_hcas": [], "rail_rule": "pcie-affinity"}}  # fmt: skip
    assert not undocumented(mod, res)


def test_defaults(monkeypatch):
    report = Recorder({**REPORT, "warnings": ["no usable HCA: NCCL_IB_DISABLE=1"]})
    monkeypatch.setattr(mod, "report", report)
    res = run(mod, {})
    assert report.args == ("/sys",)
    assert report.kwargs == {"node_ip": None, "overrides": {}, "use_nvml": True, "extra_env": {}}
    assert res["warnings_list"] == ["no usable HCA: NCCL_IB_DISABLE=1"]


@pytest.mark.parametrize(
    ("error", "text"),
    [
        (OverrideError("override NCCL_IB_HCA=mlx5_9: does not exist here"), ": override NCCL_IB_HCA=mlx5_9: does not exist here (fix topology_overrides)"),
        (OverrideError("extra variable X: not a name", source="extra_env"), "(fix topology_extra_env)"),
        (TopologyError("/sys/bus/pci/devices is not readable"), ": /sys/bus/pci/devices is not readable"),
    ],
)  # fmt: skip
def test_report_errors_are_failures_naming_the_variable(monkeypatch, error, text):
    monkeypatch.setattr(mod, "report", Recorder(raises=error))
    assert text in fail(mod, {"sysfs_root": "/sys"})["msg"]


BAD = [
    ({"overrides": ["NCCL_IB_HCA=mlx5_0"]}, "argument 'overrides' is of type list and we were unable to convert to dict"),
    ({"use_nvml": "perhaps"}, "argument 'use_nvml' is of type str and we were unable to convert to bool"),
    ({"node_ips": "10.0.0.11"}, "Unsupported parameters for (basic.py) module: node_ips"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "text"), BAD)
def test_bad_options_fail_naming_them(monkeypatch, args, text):
    report = Recorder(REPORT)
    monkeypatch.setattr(mod, "report", report)
    assert text in fail(mod, args)["msg"]
    assert report.calls == []


def test_the_fabric_env_as_it_is_now_lets_the_role_skip_what_is_right(monkeypatch, tmp_path):
    import hashlib
    import os

    monkeypatch.setattr(mod, "report", Recorder(REPORT))
    conf = tmp_path / "llmfleet"
    env = conf / "fabric.env"
    root = os.getuid() == 0  # owner root: only a root test run can make the file right
    assert run(mod, {"fabric_env": str(env)})["fabric_env_now"] == {"sha1": None, "file_ok": False, "dir_ok": False}
    conf.mkdir(mode=0o755)
    conf.chmod(0o755)
    env.write_text("A=1\n")
    env.chmod(0o644)
    res = run(mod, {"fabric_env": str(env)})
    want = hashlib.sha1(b"A=1\n").hexdigest()  # noqa: S324 (the fingerprint the module computes)
    assert res["fabric_env_now"] == {"sha1": want, "file_ok": root, "dir_ok": root}
    assert not undocumented(mod, res)
    env.chmod(0o600)
    assert run(mod, {"fabric_env": str(env)})["fabric_env_now"]["file_ok"] is False
    env.unlink()
    (tmp_path / "elsewhere").write_text("A=1\n")
    env.symlink_to(tmp_path / "elsewhere")  # never read through: the role's template replaces the link
    assert run(mod, {"fabric_env": str(env)})["fabric_env_now"] == {"sha1": None, "file_ok": False, "dir_ok": root}
    assert "fabric_env_now" not in run(mod, {})
