"""`llmfleet stop` and `llmfleet restart` against fake nodes: order, bounds, what had to be killed."""

from __future__ import annotations

import argparse
import json
import subprocess
import threading
import time

import pytest
from test_oncall_fakes import Fakes, three_nodes

from llmfleet.oncall import restart as oncall_restart
from llmfleet.oncall import stop as oncall_stop


@pytest.fixture
def fakes(tmp_path):
    return three_nodes(tmp_path)


def _run(mod, f: Fakes, capsys, *argv: str) -> tuple[int, str]:
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    rc = mod.run(p.parse_args(["-i", str(f.inventory), *argv]), transport=f.transport())
    return rc, capsys.readouterr().out


def _verbs(f: Fakes, *verbs: str) -> list[tuple[str, str, str]]:
    """(node, verb, unit) of the systemctl calls that change state, in time order."""
    calls = sorted(c for c in f.calls() if c[2] == "systemctl" and c[3] in verbs)
    return [(c[1], c[3], c[-1]) for c in calls]


def test_stop_in_order_router_head_then_workers(fakes, capsys):
    fakes.set_unit("node1", unit=fakes.router)
    fakes.record("node1", verdict="clean-stop", exit_code=0, stop_requested=True)
    rc, out = _run(oncall_stop, fakes, capsys)
    assert rc == 0, out
    order = _verbs(fakes, "stop")
    assert order[:2] == [("node1", "stop", fakes.router), ("node1", "stop", fakes.unit)]
    assert sorted(order[2:]) == [("node2", "stop", fakes.unit), ("node3", "stop", fakes.unit)]
    assert "node1 llmfleet-demo.service: systemctl stop -> inactive/dead in" in out
    assert "record: clean-stop (exit 0)" in out and out.rstrip().endswith("stopped cleanly")
    assert all(fakes.unit_state(n)["ActiveState"] == "inactive" for n in fakes.names)


def test_stop_is_bounded_and_says_what_it_killed(fakes, capsys):
    fakes.set_unit("node2", stop="hang")  # ignores the stop: SIGKILL after --timeout
    leftover = subprocess.Popen(["sleep", "300"])  # a rank left behind in node3's unit cgroup
    threading.Thread(target=leftover.wait, daemon=True).start()
    fakes.proc("node3", leftover.pid, f"/system.slice/{fakes.unit}/rank7", comm="sleep")
    try:
        rc, out = _run(oncall_stop, fakes, capsys, "--timeout", "0.5", "--json")
    finally:
        leftover.kill()
    doc = json.loads(out)
    assert rc == 1 and doc["stopped"] is True and doc["clean"] is False
    assert leftover.wait(5) == -9  # SIGKILLed by the probe
    assert f"node2: {fakes.unit}: did not stop within the timeout: the unit was SIGKILLed" in doc["killed"]
    assert any(k.startswith(f"node3: {fakes.unit}: KILLED leftover pid {leftover.pid} sleep") for k in doc["killed"])
    assert ("node2", "kill", fakes.unit) in _verbs(fakes, "kill")
    node2 = doc["nodes"][1]["units"][0]
    assert node2["after"]["ActiveState"] == "failed" and node2["sigkill_unit"] is True


def test_stop_refused_by_systemd_does_not_wait_out_the_timeout(fakes, capsys):
    fakes.set_unit("node3", stop="denied")  # e.g. ansible_become missing: systemctl says Access denied
    t0 = time.monotonic()
    rc, out = _run(oncall_stop, fakes, capsys, "--timeout", "30")
    assert time.monotonic() - t0 < 25 and rc == 1
    assert (
        "node3 llmfleet-demo.service: systemctl stop failed: Failed to stop llmfleet-demo.service: Access denied" in out
    )
    assert "NOT STOPPED: node3: llmfleet-demo.service is still active after SIGKILL" not in out
    assert "NOT STOPPED: node3: llmfleet-demo.service is still active" in out
    assert _verbs(fakes, "kill") == []


def test_dead_pids_left_in_proc_are_not_reported(fakes, capsys):
    gone = subprocess.Popen(["true"])
    gone.wait()
    fakes.proc("node2", gone.pid, f"/system.slice/{fakes.unit}")
    rc, out = _run(oncall_stop, fakes, capsys)
    assert rc == 0 and "KILLED" not in out


def test_wrapper_kill_after_its_stop_timeout_is_reported(fakes, capsys):
    fakes.record("node3", verdict="stop-timeout", killed_after_timeout=True, stop_requested=True,
                 reason="child ignored SIGTERM for 110 s; killed the process group with SIGKILL")  # fmt: skip
    rc, out = _run(oncall_stop, fakes, capsys)
    assert rc == 1 and "node3: llmfleet-demo.service: the engine ignored SIGTERM; the wrapper SIGKILLed it" in out


def test_stop_with_an_unreachable_node_still_stops_the_others(tmp_path, capsys):
    f = Fakes(tmp_path, ["node1", "node2", "node3"], unreachable=("node3",))
    for n in ("node1", "node2"):
        f.set_unit(n)
    rc, out = _run(oncall_stop, f, capsys)
    assert rc == 1 and "NOT STOPPED: node3: unreachable, not stopped: ssh" in out
    assert [v[0] for v in _verbs(f, "stop")] == ["node1", "node2"]


def test_stop_unknown_deployment(fakes, capsys):
    p = argparse.ArgumentParser()
    oncall_stop.add_arguments(p)
    assert oncall_stop.run(p.parse_args(["-i", str(fakes.inventory), "nope"]), transport=fakes.transport()) == 2
    assert "no node has llmfleet-nope.service" in capsys.readouterr().err
    assert _verbs(fakes, "stop") == []


def test_restart_starts_in_rank_order_and_waits_for_ready(fakes, capsys):
    fakes.set_unit("node1", unit=fakes.router)
    rc, out = _run(oncall_restart, fakes, capsys, "--ready-timeout", "20")
    assert rc == 0, out
    starts = _verbs(fakes, "start")
    assert starts == [("node1", "start", fakes.unit), ("node2", "start", fakes.unit), ("node3", "start", fakes.unit),
                      ("node1", "start", fakes.router)]  # fmt: skip
    assert max(c[0] for c in fakes.calls() if c[3] == "stop") < min(c[0] for c in fakes.calls() if c[3] == "start")
    assert "READY: every unit active" in out


def test_restart_stops_waiting_when_a_unit_fails(fakes, capsys):
    fakes.set_unit("node2", start="fail")
    rc, out = _run(oncall_restart, fakes, capsys, "--ready-timeout", "60", "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["ok"] is False
    assert doc["states"][0].startswith("FAILED: node2 llmfleet-demo.service: failed/failed")
    assert doc["ready_s"] < 30  # did not wait for the deadline


def test_restart_deadline(fakes, capsys):
    fakes.set_unit("node3", start="slow")
    rc, out = _run(oncall_restart, fakes, capsys, "--ready-timeout", "1")
    assert rc == 1 and "not READY after 1 s: node3 llmfleet-demo.service: activating/start" in out
    assert "next: llmfleet logs --first-failed" in out


def test_restart_does_not_start_what_it_could_not_stop(tmp_path, capsys):
    f = Fakes(tmp_path, ["node1", "node2"], unreachable=("node2",))
    f.set_unit("node1")
    rc, out = _run(oncall_restart, f, capsys)
    assert rc == 1 and "NOT RESTARTED, not all stopped: node2: unreachable" in out
    assert _verbs(f, "start") == []
