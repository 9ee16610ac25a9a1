"""What the readiness gate leaves for people: the progress file and line while it waits, the timeline table,
and engine-<deployment>.json (the report's record, the first failure up front)."""

import json

from llmfleet.engine import gate

TIMELINE = {
    "t0": 1796102800.0,
    "nodes": {
        "node2": {"rank": 1, "unit": "active", "phase": "serving", "unit_start": 0.4, "weights_loaded": 11.25,
                  "node_ready": 14.0},
        "node1": {"rank": 0, "unit": "active", "phase": "serving", "unit_start": 0.0, "weights_loaded": 10.5,
                  "node_ready": 13.96},
    },
    "head": {"all_units_active": 14.1, "port_open": 14.2, "models_listed": 14.3, "first_correct_answer": 15.04},
}  # fmt: skip


def test_timeline_table_is_seconds_in_rank_order():
    lines = gate.timeline_table(TIMELINE)
    assert lines[0].split() == ["node", "rank", "unit", "start", "weights", "loaded", "ready", "phase"]
    assert lines[1].split() == ["node1", "0", "0.0", "10.5", "14.0", "serving"]
    assert lines[2].split() == ["node2", "1", "0.4", "11.2", "14.0", "serving"]
    assert lines[3] == ("deployment: all units active 14.1 s, port open 14.2 s, models listed 14.3 s, "
                        "first correct answer 15.0 s")  # fmt: skip


def test_timeline_table_of_a_start_that_got_nowhere():
    lines = gate.timeline_table({"nodes": {"node1": {"rank": 0, "phase": None}}, "head": {}})
    assert lines[1].split() == ["node1", "0", "-", "-", "-", "-"]
    assert lines[2] == "deployment: no API event reached"


def test_progress_line_names_a_failed_unit():
    line = gate.progress_line({"elapsed_s": 7.4, "deadline_s": 600, "api": "",
                               "units": [{"name": "node1", "unit": "failed", "phase": "loading",
                                          "failed": "unit failed (exit 1)"}]})  # fmt: skip
    assert line == "engine gate 7/600 s: node1 FAILED (unit failed (exit 1)) (loading)"


def test_the_gate_writes_its_progress_file_atomically(tmp_path):
    g = gate.Gate([{"name": "node1", "rank": 0, "ssh": ["ssh", "node1"]}], "llmfleet-main.service",
                  status_file="/s", record_file="/r", api_base="http://x:1", model="m",
                  progress_path=str(tmp_path / "gate-0.json"))  # fmt: skip
    try:
        g.nodes[0].state = {"unit": {"ActiveState": "activating"}}
        g.last_problem = "connection refused"
        g._write_progress(0.0)
    finally:
        g.close()
    got = json.loads((tmp_path / "gate-0.json").read_text())
    assert got["units"] == [{"name": "node1", "unit": "activating", "phase": None, "failed": None}]
    assert got["api"] == "connection refused" and got["deadline_s"] == 3600
    assert [p.name for p in tmp_path.iterdir()] == ["gate-0.json"]  # no .tmp left


def test_deployment_record_of_a_ready_run():
    rec = gate.deployment_record([{"ready": True, "failed": False, "timeline": TIMELINE, "invocation": {"x": 1},
                                   "item": [{"name": "node1"}], "changed": False}],
                                 deployment="main", generated_at="2026-12-01T07:00:00Z")  # fmt: skip
    assert rec["ok"] is True and rec["failure"] is None and rec["deployment"] == "main"
    assert rec["gates"] == [{"ready": True, "failed": False, "timeline": TIMELINE}]  # Ansible's keys dropped


def test_deployment_record_puts_the_first_failure_up_front():
    failed = {
        "ready": False, "failed": True, "kind": "a unit failed", "msg": "node2 failed first",
        "first_failed": {"node": "node2", "node_rank": 1, "rank": 3, "why": "unit failed",
                         "record": {"verdict": "engine-crashed", "first_error": "RuntimeError: CUDA error", "failed_rank": 3},
                         "journal_tail": ["line 1", "RuntimeError: CUDA error"]},
    }  # fmt: skip
    rec = gate.deployment_record([failed], deployment="main")
    assert rec["ok"] is False
    assert rec["failure"] == {"verdict": "engine-crashed", "kind": "a unit failed", "message": "node2 failed first",
                              "node": "node2", "rank": 3, "why": "unit failed",
                              "first_error": "RuntimeError: CUDA error",
                              "log_tail": ["line 1", "RuntimeError: CUDA error"]}  # fmt: skip


def test_deployment_record_without_any_gate_result_is_not_ok():
    assert gate.deployment_record([], deployment="main")["ok"] is False
