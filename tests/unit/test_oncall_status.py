"""`llmfleet status` against fake nodes (the real probe, fake systemctl/nvidia-smi), and what all on-call
commands share: the parallel fan-out, bad input as exit 2, lazy imports."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest
from test_oncall_fakes import UNIT_AGE_S, Fakes, closed_port, listening_port, three_nodes

from llmfleet.fleet_inventory import Node, Ssh
from llmfleet.oncall import common as oncall
from llmfleet.oncall import status as oncall_status


@pytest.fixture
def fakes(tmp_path):
    return three_nodes(tmp_path)


def _status(f: Fakes, *argv: str, capsys=None) -> tuple[int, str]:
    p = argparse.ArgumentParser()
    oncall_status.add_arguments(p)
    rc = oncall_status.run(p.parse_args(["-i", str(f.inventory), *argv]), transport=f.transport())
    return rc, capsys.readouterr().out if capsys else ""


def _head_serves(f: Fakes, port: int) -> None:
    argv = ["/usr/local/bin/llmfleet", "exec", "--record", str(f.state_dir("node1") / "termination.json"),
            "--status", str(f.state_dir("node1") / "status.json"), "--", "/opt/sglang/bin/sglang", "serve",
            "--host", "0.0.0.0", "--port", str(port)]  # fmt: skip  # noqa: S104
    f.set_unit("node1", argv=argv)


def test_healthy(fakes, capsys):
    sock, port = listening_port()
    _head_serves(fakes, port)
    fakes.gpu_apps("node1", [(100, 5000), (101, 3000), (200, 7000)])
    fakes.proc("node1", 100, f"/system.slice/{fakes.unit}")
    fakes.proc("node1", 101, f"/system.slice/{fakes.unit}/rank1")
    fakes.proc("node1", 200, "/user.slice/user-0.slice/session-1.scope", comm="jupyter")
    rc, out = _status(fakes, capsys=capsys)
    sock.close()
    assert rc == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("llmfleet-demo.service on 3 node(s), head node1")
    row = next(ln for ln in lines if ln.startswith("node1 "))
    assert "active/running" in row and f"{port} open" in row and "8000 MiB" in row and "serving" in row
    assert "GPU memory held outside the unit: pid 200 jupyter 7000 MiB" in out
    assert lines[-2] == "healthy"
    node3 = next(ln for ln in lines if ln.startswith("node3 "))
    assert node3.split()[-1] == "-"  # no nvidia-smi there: GPU unknown, not 0


def test_json(fakes, capsys):
    sock, port = listening_port()
    _head_serves(fakes, port)
    rc, out = _status(fakes, "--json", capsys=capsys)
    sock.close()
    doc = json.loads(out)
    assert rc == 0 and doc["healthy"] is True and doc["problems"] == [] and doc["deployment"] == "demo"
    n1 = doc["nodes"][0]
    assert n1["node"] == "node1" and n1["head"] and n1["reachable"]
    (u,) = n1["units"]
    assert (u["unit"], u["active_state"], u["port"], u["port_open"], u["phase"]) == (
        "llmfleet-demo.service", "active", port, True, "serving")  # fmt: skip
    assert u["since"] == pytest.approx(time.time() - UNIT_AGE_S, abs=5)
    assert doc["nodes"][1]["units"][0]["port"] is None  # workers serve no API


def test_failed_worker_with_its_record(fakes, capsys):
    sock, port = listening_port()
    _head_serves(fakes, port)
    fakes.set_unit("node2", ActiveState="failed", SubState="failed", Result="exit-code", ExecMainCode=1,
                   ExecMainStatus=70, NRestarts=2)  # fmt: skip
    fakes.status_file("node2", running=False, phase="loaded")
    fakes.record(
        "node2",
        verdict="unrequested-exit-0",
        exit_code=70,
        failed_rank={"tp": 1, "pp": 1, "rank": 3, "line": "x", "at": 1},
        first_error={
            "line": "[2026-11-29 10:00:00 TP1 PP1] RuntimeError: CUDA error: an illegal memory access",
            "at": 1,
        },
    )
    rc, out = _status(fakes, capsys=capsys)
    sock.close()
    assert rc == 1
    row = next(ln for ln in out.splitlines() if ln.startswith("node2 "))
    assert "failed/failed" in row and " 70 " in row and "unrequested-exit-0" in row and "rank 3 (TP1 PP1)" in row
    assert "  - node2: llmfleet-demo.service is failed/failed" in out
    assert "node2: llmfleet-demo.service ended unrequested-exit-0 (exit 70): rank 3 (TP1 PP1): [2026-11-29" in out


def test_killed_by_signal_shows_the_signal(fakes, capsys):
    fakes.set_unit("node3", ActiveState="failed", SubState="failed", Result="signal", ExecMainCode=2, ExecMainStatus=9)
    _, out = _status(fakes, capsys=capsys)
    assert "SIGKILL" in next(ln for ln in out.splitlines() if ln.startswith("node3 "))


def test_port_closed_on_the_head(fakes, capsys):
    _head_serves(fakes, closed_port())
    rc, out = _status(fakes, capsys=capsys)
    assert rc == 1 and "CLOSED" in out and "is CLOSED on 127.0.0.1 although the unit is active" in out


def test_unreachable_node_is_a_row_not_a_traceback(tmp_path, capsys):
    f = Fakes(tmp_path, ["node1", "node2"], unreachable=("node2",))
    f.set_unit("node1")
    f.status_file("node1")
    rc, out = _status(f, "--json", capsys=capsys)
    doc = json.loads(out)
    assert rc == 1 and doc["nodes"][1]["reachable"] is False
    assert "connection refused" in doc["nodes"][1]["error"]
    assert any(p.startswith("node2: unreachable: ssh ") for p in doc["problems"])


def test_running_again_after_a_crash_is_healthy_with_a_note(fakes, capsys):
    sock, port = listening_port()
    _head_serves(fakes, port)
    fakes.set_unit("node2", NRestarts=1)
    fakes.record("node2", "termination.json.1", verdict="signal", failed_rank={"tp": 0, "pp": 1, "rank": 2})
    rc, out = _status(fakes, capsys=capsys)
    sock.close()
    assert rc == 0, out
    assert "previous run: signal rank 2 (TP0 PP1)" in next(ln for ln in out.splitlines() if ln.startswith("node2 "))


def test_starting_is_not_healthy_yet(fakes, capsys):
    fakes.set_unit("node2", ActiveState="activating", SubState="start")
    fakes.status_file("node2", phase="loading", ready=False)
    rc, out = _status(fakes, capsys=capsys)
    assert rc == 1 and "node2: llmfleet-demo.service is activating/start, phase loading" in out


def test_router_row_and_its_health(fakes, capsys):
    sock, port = listening_port()
    _head_serves(fakes, port)
    fakes.set_unit("node1", unit=fakes.router, ActiveState="failed", SubState="failed", Result="exit-code")
    rc, out = _status(fakes, capsys=capsys)
    sock.close()
    assert rc == 1
    router = [ln for ln in out.splitlines() if ln.startswith("node1 ") and " router " in ln]
    assert len(router) == 1 and "failed/failed" in router[0]
    assert "node1: llmfleet-demo-router.service is failed/failed" in out


def test_unknown_deployment_is_bad_input(fakes, capsys):
    rc = oncall_status.run(_args(fakes, "--deployment", "other"), transport=fakes.transport())
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("llmfleet status: no node has llmfleet-other.service")
    assert "deployments there: demo" in err and "Traceback" not in err


def _args(f: Fakes, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    oncall_status.add_arguments(p)
    return p.parse_args(["-i", str(f.inventory), *argv])


@pytest.mark.parametrize(
    ("argv", "msg"),
    [
        (["-i", "/nonexistent/inv"], "llmfleet status: inventory /nonexistent/inv: no such file or directory"),
        (["--deployment", "Bad_Name"], "llmfleet status: deployment 'Bad_Name': 1-42 lowercase letters"),
        (["-e", "oops"], "llmfleet status: -e 'oops': give KEY=VALUE"),
    ],
)
def test_bad_input_is_exit_2_with_one_line(fakes, capsys, argv, msg):
    p = argparse.ArgumentParser()
    oncall_status.add_arguments(p)
    args = p.parse_args(argv if argv[0] == "-i" else ["-i", str(fakes.inventory), *argv])
    assert oncall_status.run(args, transport=fakes.transport()) == 2
    err = capsys.readouterr().err
    assert err.startswith(msg) and err.count("\n") == 1


def test_system_without_systemd_is_a_problem_not_a_crash(fakes, capsys):
    fakes.set_unit("node3", show_fails=True)
    rc, out = _status(fakes, capsys=capsys)
    assert rc == 1 and "node3: llmfleet-demo.service: systemctl show failed: Failed to connect to bus" in out


# ---- shared ------------------------------------------------------------------------------------------------


def _node(name: str, rank: int = 0, **kw) -> Node:
    base = dict(name=name, rank=rank, head=rank == 0, ssh=Ssh(host=name), become=False, become_user="root",
                python=sys.executable, engine_dir="/x", fabric_env="/f", profile="sglang", engine_host="",
                engine_port=0, router_port=30000, ready_deadline=60.0)  # fmt: skip
    base.update(kw)
    return Node(**base)


def test_fan_out_is_parallel_and_in_node_order():
    nodes = [_node(f"n{i}", i) for i in range(16)]

    def slow(n):
        time.sleep(0.4)
        if n.name == "n3":
            raise oncall.TransportError("gone")
        if n.name == "n5":
            raise ValueError("odd answer")
        return {"name": n.name}

    t0 = time.monotonic()
    res = oncall.fan_out(nodes, slow)
    assert time.monotonic() - t0 < 1.5  # 16 x 0.4 s in parallel, not 6.4 s
    assert [r.node.name for r in res] == [n.name for n in nodes]
    assert res[3].error == "gone" and res[5].error == "ValueError: odd answer" and res[4].data == {"name": "n4"}


def test_api_port_defaults():
    assert oncall.api_port(_node("a")) == 30000
    assert oncall.api_port(_node("a", profile="vllm")) == 8000
    assert oncall.api_port(_node("a", profile="vllm", engine_port=9000)) == 9000
    assert oncall.api_port(_node("a", router_port=31000), router=True) == 31000
    assert oncall.serves_api(_node("w", 1, profile="vllm_pd")) and not oncall.serves_api(_node("w", 1))


def test_local_transport_timeout():
    t = oncall.LocalTransport()
    with pytest.raises(oncall.TransportError, match=r"no answer within 0.2 s"):
        t.run(_node("a"), [sys.executable, "-c", "import time; time.sleep(5)"], b"", 0.2, 100)


def test_on_call_modules_import_no_third_party_package_at_load():
    """Fabric, paramiko and ansible load only when a command runs (the package is imported on nodes too)."""
    mods = ["oncall.common", "oncall.ssh", "oncall.status", "oncall.logs", "oncall.bundle", "oncall.stop",
            "oncall.restart", "oncall.rdma", "fleet_inventory", "oncall.node_probe"]  # fmt: skip
    code = "import sys\n" + "".join(f"import llmfleet.{m}\n" for m in mods)
    code += "print([m for m in ('fabric', 'paramiko', 'ansible', 'invoke') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_node_the_link_stopped_with_an_operators_stop_is_no_failure():
    """Found on the lab: after `llmfleet stop`, node2's record `deployment-stopped` was listed as a problem."""
    from llmfleet.oncall.status import record_failed

    assert not record_failed({"verdict": "deployment-stopped", "stop_requested": False})
    assert record_failed({"verdict": "peer-failed", "stop_requested": False})


def test_the_last_serving_health_probe_is_shown_and_a_failing_one_is_a_problem(fakes, capsys):
    sock, port = listening_port()
    _head_serves(fakes, port)
    now = time.time()
    good = {"ok": True, "error": None, "at": now - 12, "latency_s": 0.31}
    fakes.status_file("node1", health={"last": good, "failures_in_row": 0, "failures_allowed": 3})
    rc, out = _status(fakes, capsys=capsys)
    row = next(ln for ln in out.splitlines() if ln.startswith("node1 "))
    assert rc == 0 and "ok 0m1" in row and "0.31s" in row, out  # 12 s (or 13 s) ago
    bad = {"ok": False, "error": "no complete answer within 20 s", "at": now - 4, "latency_s": 20.0}
    fakes.status_file("node1", health={"last": bad, "failures_in_row": 2, "failures_allowed": 3})
    rc, out = _status(fakes, capsys=capsys)
    sock.close()
    row = next(ln for ln in out.splitlines() if ln.startswith("node1 "))
    assert rc == 1 and "FAILED 2/3 0m0" in row, out
    assert (
        "node1: llmfleet-demo.service: serving health probe failed 2/3 in a row: no complete answer within 20 s" in out
    )


def test_a_failure_the_wrapper_ended_by_stopping_the_engine_is_still_a_failure():
    """rank-died and unhealthy-while-serving: the wrapper stops the engine itself (stop_requested in the record)."""
    from llmfleet.oncall.status import record_failed

    for verdict in ("rank-died", "unhealthy-while-serving"):
        assert record_failed({"verdict": verdict, "exit_code": 70, "stop_requested": True}), verdict
    assert not record_failed({"verdict": "clean-stop", "exit_code": 0, "stop_requested": True})
    assert not record_failed({"verdict": "signal", "exit_code": 143, "stop_requested": True})
