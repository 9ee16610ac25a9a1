"""bench/rollout_bench.py's hung-replica scenario stops the process that answers the replica's API. Under the
replica's unit the wrapper runs the engine's node main process, and the API is served by its rank 0 (a grandchild
of the unit's main process): stopping the node main process hangs nothing that a client or the router sees. Here a
real process tree of that shape (a node main process that spawns a rank that listens) is asked with `ss`, as the
bench asks a lab node."""

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("rollout_bench", ROOT / "bench/rollout_bench.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

# The simulator's shape: `engine_sim.py vllm serve` (node main) spawns `engine_sim.py _rank -` (rank 0, the API).
SIM = """
import socket, subprocess, sys, time
if sys.argv[1] == "serve":
    rank = subprocess.Popen([sys.executable, __file__, "_rank", sys.argv[2]])
    rank.wait()
else:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    open(sys.argv[2], "w").write(str(s.getsockname()[1]))
    time.sleep(60)
"""


def local(cmd):
    return subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=False, timeout=30).stdout


@pytest.fixture
def tree(tmp_path):
    script, portfile = tmp_path / "engine_sim.py", tmp_path / "port"
    script.write_text(SIM)
    node = subprocess.Popen([sys.executable, str(script), "serve", str(portfile)])
    try:
        for _ in range(100):
            if portfile.exists() and portfile.read_text():
                break
            time.sleep(0.05)
        rank = int(local(f"pgrep -P {node.pid}").split()[0])
        yield node.pid, rank, int(portfile.read_text())
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(node.pid)], check=False)
        node.kill()
        node.wait()


def test_the_hang_stops_the_process_that_listens_on_the_api_port_not_the_node_main_process(tree):
    node, rank, port = tree
    got = bench.listener_pid(local, port)
    assert got == rank and got != node, (got, node, rank)
    assert got != os.getpid()


def test_no_listener_is_a_clear_error(tree):
    with pytest.raises(SystemExit, match="want the one process listening on port 1,"):
        bench.listener_pid(local, 1)


def test_a_unit_without_the_serving_health_probe_is_named():
    def show(_cmd):
        return "{ path=/opt/llmfleet/bin/llmfleet ; argv[]=llmfleet exec --record r --status s -- vllm serve m ; }"

    with pytest.raises(SystemExit, match="carries no serving health probe"):
        bench.health_probe(show)
    probed = "{ argv[]=llmfleet exec --health-url http://127.0.0.1:8000 --health-interval 5 -- vllm serve m ; }"
    assert bench.health_probe(lambda _cmd: probed) == "its unit probes http://127.0.0.1:8000"
