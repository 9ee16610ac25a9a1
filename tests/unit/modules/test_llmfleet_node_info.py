"""llmfleet_node_info run in-process, importing ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet: options -> nodeinfo.gather."""

import pytest

import llmfleet
import llmfleet_node_info as mod
from tests.unit.modules.util import Recorder, fail, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")


def test_reports_node_and_changes_nothing(tmp_path):
    res = run(mod, {"nvme_path": str(tmp_path), "shared_path": "/nonexistent-shared"})
    assert res["changed"] is False
    node = res["node"]
    assert node["llmfleet_version"] == llmfleet.__version__
    assert node["nvme"]["path"] == str(tmp_path) and node["nvme"]["present"]
    assert node["shared"] == {"path": "/nonexistent-shared", "mounted": False, "read_only": False}
    assert not undocumented(mod, res)


def test_module_uses_the_module_utils_name():
    assert mod.gather.__module__ == "ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.nodeinfo"


@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_options_become_the_gather_call(monkeypatch, check):
    gather = Recorder({"hostname": "node1"})
    monkeypatch.setattr(mod, "gather", gather)
    res = run(mod, {"nvme_path": "/data/nvme", "shared_path": "/data/shared"}, check=check)
    assert gather.kwargs == {"nvme": "/data/nvme", "shared": "/data/shared"}
    assert res == {"changed": False, "node": {"hostname": "node1"}}


def test_defaults(monkeypatch):
    gather = Recorder({})
    monkeypatch.setattr(mod, "gather", gather)
    run(mod, {})
    assert gather.kwargs == {"nvme": "/mnt/nvme", "shared": "/mnt/shared"}


@pytest.mark.parametrize(
    ("args", "text"),
    [
        ({"nvme": "/data/nvme"}, "Unsupported parameters for (basic.py) module: nvme. Supported parameters include: nvme_path, shared_path"),
        ({"nvme_path": "/data/nvme", "sharedpath": "/data/shared"}, "Unsupported parameters for (basic.py) module: sharedpath"),
    ],
)  # fmt: skip
def test_bad_options_fail_naming_them(monkeypatch, args, text):
    gather = Recorder({})
    monkeypatch.setattr(mod, "gather", gather)
    assert text in fail(mod, args)["msg"]
    assert gather.calls == []
