"""llmfleet_preflight_evaluate: options -> preflight.evaluate(measurements, settings); a failing row ->
fail_json with the table."""

import pytest

import llmfleet_preflight_evaluate as mod
from tests.unit.modules.util import Recorder, fail, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")

M = {"node1": {"gpu_count": 8}, "node2": {"gpu_count": 7}}
OK_ROWS = [{"check": "gpu_count", "node": n, "value": 8, "status": "pass", "message": ""} for n in ("node1", "node2")]
BAD_ROWS = [OK_ROWS[0], {"check": "gpu_count", "node": "node2", "value": 7, "status": "fail", "message": "expected 8"}]


@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_options_become_the_evaluate_call(monkeypatch, check):
    evaluate = Recorder(OK_ROWS)
    monkeypatch.setattr(mod, "evaluate", evaluate)
    res = run(mod, {"measurements": M, "ports": {"node1": {"node2": {"29500": "open"}}}, "fabric_ips": {"node1": "10.0.0.11"},
                    "expect_gpus": "no", "gpus_per_node": "8", "expect_rdma": True, "engine_python": "/opt/e/bin/python",
                    "min_free_bytes": 2**40, "max_clock_offset_s": "0.5"}, check=check)  # fmt: skip
    measurements, settings = evaluate.args
    assert measurements == M
    assert settings == {"ports": {"node1": {"node2": {"29500": "open"}}}, "fabric_ips": {"node1": "10.0.0.11"},
                        "expect_gpus": False, "gpus_per_node": 8, "expect_rdma": True, "engine_python": "/opt/e/bin/python",
                        "min_free_bytes": 2**40, "max_clock_offset_s": 0.5}  # fmt: skip
    assert res["status"] == "pass" and res["rows"] == OK_ROWS and res["failed_nodes"] == [] and res["changed"] is False
    assert res["table"].splitlines()[0].split() == ["check", "node", "status", "value", "note"]
    assert not undocumented(mod, res)


def test_defaults(monkeypatch):
    evaluate = Recorder([])
    monkeypatch.setattr(mod, "evaluate", evaluate)
    res = run(mod, {"measurements": {}})
    assert evaluate.args[1] == {"ports": {}, "fabric_ips": {}, "expect_gpus": True, "gpus_per_node": 0,
                                "expect_rdma": False, "engine_python": None, "min_free_bytes": 0, "max_clock_offset_s": 0.1}  # fmt: skip
    assert res["status"] == "pass"


def test_a_failing_check_fails_with_the_table(monkeypatch):
    monkeypatch.setattr(mod, "evaluate", Recorder(BAD_ROWS))
    res = fail(mod, {"measurements": M})
    assert res["msg"].startswith("preflight failed on node2 (gpu_count):\ncheck")
    assert "expected 8" in res["msg"] and res["failed_nodes"] == ["node2"] and res["failed_checks"] == ["gpu_count"]
    assert res["status"] == "fail" and res["rows"] == BAD_ROWS
    assert not undocumented(mod, res)


@pytest.mark.parametrize(
    ("args", "text"),
    [
        ({}, "missing required arguments: measurements"),
        ({"measurements": M, "gpus_per_node": "eight"}, "argument 'gpus_per_node' is of type str and we were unable to convert to int"),
        ({"measurements": M, "max_clock_offset_s": "fast"}, "argument 'max_clock_offset_s' is of type str and we were unable to convert to float"),
    ],
)  # fmt: skip
def test_bad_options_fail_naming_them(monkeypatch, args, text):
    evaluate = Recorder([])
    monkeypatch.setattr(mod, "evaluate", evaluate)
    assert text in fail(mod, args)["msg"]
    assert evaluate.calls == []
