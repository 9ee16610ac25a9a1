"""llmfleet_preflight_info: options -> preflight.measure; read-only, returns measurements (no facts)."""

import pytest

import llmfleet_preflight_info as mod
from tests.unit.modules.util import Recorder, fail, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")


@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_options_become_the_measure_call(monkeypatch, tmp_path, check):
    measure = Recorder({"gpu_count": 8})
    monkeypatch.setattr(mod, "measure", measure)
    res = run(mod, {"sys_root": str(tmp_path), "driver_version_file": str(tmp_path / "version"), "nvme_path": "/data",
                    "peers": {"node2": "10.0.0.12"}, "engine_python": "/opt/e/bin/python",
                    "engine_env": "/opt/e/bin/python", "engine_user": "llmfleet",
                    "clock_source": str(tmp_path / "chrony.txt")}, check=check)  # fmt: skip
    assert measure.kwargs == {"sys_root": str(tmp_path), "driver_version_file": str(tmp_path / "version"),
                              "nvme_path": "/data", "peers": {"node2": "10.0.0.12"}, "engine_python": "/opt/e/bin/python",
                              "clock_source": str(tmp_path / "chrony.txt"), "engine_env": "/opt/e/bin/python",
                              "engine_user": "llmfleet"}  # fmt: skip
    assert res == {"changed": False, "measurements": {"gpu_count": 8}}
    assert "ansible_facts" not in res and not undocumented(mod, res)


def test_defaults(monkeypatch):
    measure = Recorder({})
    monkeypatch.setattr(mod, "measure", measure)
    run(mod, {})
    assert measure.kwargs == {"sys_root": "/sys", "driver_version_file": "/proc/driver/nvidia/version",
                              "nvme_path": "/mnt/nvme", "peers": {}, "engine_python": None, "clock_source": None,
                              "engine_env": None, "engine_user": None}  # fmt: skip


def test_measures_a_fake_node_for_real(tmp_path):
    """Through the real package: an empty sysfs and no tools give nulls, never an error."""
    res = run(
        mod, {"sys_root": str(tmp_path), "driver_version_file": str(tmp_path / "none"), "nvme_path": str(tmp_path)}
    )
    assert res["changed"] is False and isinstance(res["measurements"], dict)
    assert res["measurements"]["nvme_free_bytes"] > 0


@pytest.mark.parametrize(
    ("args", "text"),
    [
        ({"peers": ["node2"]}, "argument 'peers' is of type list and we were unable to convert to dict"),
        ({"nvme": "/data"}, "Unsupported parameters for (basic.py) module: nvme"),
    ],
)
def test_bad_options_fail_naming_them(monkeypatch, args, text):
    measure = Recorder({})
    monkeypatch.setattr(mod, "measure", measure)
    assert text in fail(mod, args)["msg"]
    assert measure.calls == []
