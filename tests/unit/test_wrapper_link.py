"""The deployment link (`llmfleet exec --link-listen/--link-head`): real wrapper processes on localhost, one
head and two workers around engines that serve until killed and, like ranks stuck in a collective after a
peer died, never exit by themselves. Every wait has a deadline."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmfleet.wrapper_link import EXIT_PEER_FAILED, parse_addr

PY = sys.executable
WRAP = [PY, "-m", "llmfleet", "exec"]
WAIT = 30
# Prints its pid, then serves "forever" (a stuck rank: only a signal ends it).
ENGINE = [PY, "-c", "import os, time\nprint('engine pid', os.getpid(), flush=True)\ntime.sleep(600)"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env():
    return {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "INVOCATION_ID", "LLMFLEET_CGROUP_ROOT")}


class Node:
    def __init__(self, tmp_path, name, link, cmd=ENGINE):
        self.name, self.record = name, tmp_path / f"{name}.json"
        self.log = (tmp_path / f"{name}.log").open("w+")
        argv = [*WRAP, "--record", str(self.record), "--link-node", name, "--link-timeout", "2", *link, "--", *cmd]
        self.p = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env())

    def output(self):
        self.log.flush()
        return Path(self.log.name).read_text()

    def engine_pid(self):
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            for line in self.output().splitlines():
                if line.startswith("engine pid "):
                    return int(line.split()[-1])
            assert self.p.poll() is None, f"{self.name} ended: {self.output()}"
            time.sleep(0.05)
        raise AssertionError(f"{self.name}'s engine never started: {self.output()}")

    def wait(self):
        return self.p.wait(timeout=WAIT)

    def rec(self):
        return json.loads(self.record.read_text())

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(timeout=WAIT)


@pytest.fixture
def fleet(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    nodes = []

    def start(names=("head", "w1", "w2")):
        for n in names:
            link = ["--link-listen", addr] if n == "head" else ["--link-head", addr, "--link-wait", "20"]
            nodes.append(Node(tmp_path, n, link))
            if n == "head":
                nodes[-1].engine_pid()  # listening before the workers come
        for node in nodes:
            node.engine_pid()
        return {n.name: n for n in nodes}

    yield start
    for n in nodes:
        n.kill()


def test_a_worker_engine_that_dies_stops_every_node_and_is_named_first(fleet):
    nodes = fleet()
    os.kill(nodes["w1"].engine_pid(), signal.SIGKILL)
    codes = {n: node.wait() for n, node in nodes.items()}
    assert codes == {"w1": 128 + signal.SIGKILL, "head": EXIT_PEER_FAILED, "w2": EXIT_PEER_FAILED}, codes
    assert nodes["w1"].rec()["verdict"] == "signal" and nodes["w1"].rec()["link"]["stopped_by"] is None
    for n in ("head", "w2"):
        rec = nodes[n].rec()
        assert rec["verdict"] == "peer-failed", rec
        assert rec["link"]["stopped_by"]["node"] == "w1" and rec["link"]["stopped_by"]["kind"] == "failed"
        assert "signal, exit 137" in rec["link"]["stopped_by"]["reason"]
        assert rec["reason"].startswith("stopped with the deployment: w1 failed first"), rec["reason"]


def test_the_head_engine_that_dies_stops_every_worker(fleet):
    nodes = fleet()
    os.kill(nodes["head"].engine_pid(), signal.SIGKILL)
    assert nodes["head"].wait() == 128 + signal.SIGKILL
    for n in ("w1", "w2"):
        assert nodes[n].wait() == EXIT_PEER_FAILED
        assert nodes[n].rec()["link"]["stopped_by"]["node"] == "head"


def test_a_stop_on_request_stops_the_deployment_without_a_restart(fleet):
    nodes = fleet()
    nodes["head"].p.send_signal(signal.SIGTERM)  # systemctl stop on the head (the ordered stop's first step)
    codes = {n: node.wait() for n, node in nodes.items()}
    assert codes == {"head": 0, "w1": 0, "w2": 0}, codes  # Restart=on-failure restarts none of them
    assert nodes["head"].rec()["verdict"] == "clean-stop"
    assert {nodes[n].rec()["verdict"] for n in ("w1", "w2")} == {"deployment-stopped"}


def test_a_worker_whose_wrapper_vanishes_is_detected_by_its_connection(fleet):
    """SIGKILL of the wrapper itself (or the node gone): no FAIL message, the head notices the lost peer."""
    nodes = fleet()
    engine = nodes["w1"].engine_pid()
    nodes["w1"].p.kill()
    os.kill(engine, signal.SIGKILL)  # its engine would be killed by systemd (KillMode=mixed)
    assert nodes["head"].wait() == EXIT_PEER_FAILED
    assert nodes["w2"].wait() == EXIT_PEER_FAILED
    by = nodes["head"].rec()["link"]["stopped_by"]
    assert by["node"] == "w1" and "lost contact with w1's wrapper" in by["reason"], by
    assert nodes["w2"].rec()["link"]["stopped_by"]["node"] == "w1"


def test_a_worker_waits_for_the_head_then_starts(tmp_path):
    """Restarted together, a worker's engine starts only once the head's wrapper welcomes it (rank order)."""
    addr = f"127.0.0.1:{free_port()}"
    worker = Node(tmp_path, "w1", ["--link-head", addr, "--link-wait", "20"])
    try:
        time.sleep(1.5)
        assert "engine pid" not in worker.output()
        head = Node(tmp_path, "head", ["--link-listen", addr])
        try:
            worker.engine_pid()
            head.p.send_signal(signal.SIGTERM)
            assert head.wait() == 0 and worker.wait() == 0
        finally:
            head.kill()
    finally:
        worker.kill()


def test_a_worker_with_no_head_gives_up_at_its_deadline_without_starting_the_engine(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    worker = Node(tmp_path, "w1", ["--link-head", addr, "--link-wait", "1"])
    try:
        assert worker.wait() == EXIT_PEER_FAILED
        rec = worker.rec()
        assert rec["verdict"] == "link-failed" and rec["child_pid"] is None
        assert f"the head's wrapper at {addr} did not welcome this node" in rec["reason"], rec["reason"]
        assert "the engine was not started" in rec["reason"]
    finally:
        worker.kill()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--link-listen", "127.0.0.1:1", "--link-head", "127.0.0.1:2"], "exclude each other"),
        (["--link-head", "nohost"], "--link-head: 'nohost' is not HOST:PORT"),
        (["--link-listen", "127.0.0.1:99999"], "--link-listen: '127.0.0.1:99999' is not HOST:PORT"),
        (
            ["--link-head", "127.0.0.1:5", "--link-timeout", "0"],
            "--link-timeout, --link-wait and --link-stop-timeout must be > 0",
        ),
    ],
)
def test_bad_link_flags_are_usage_errors(flags, message):
    cp = subprocess.run(
        [*WRAP, *flags, "--", "true"], capture_output=True, text=True, timeout=WAIT, env=env(), check=False
    )
    assert cp.returncode == 2 and message in cp.stderr, cp.stderr


def test_parse_addr():
    assert parse_addr("10.0.0.1:50082") == ("10.0.0.1", 50082)
    with pytest.raises(ValueError, match="not HOST:PORT"):
        parse_addr(":80")


def test_a_worker_whose_engine_exits_0_as_the_head_stops_is_not_a_failure(tmp_path):
    """SGLang's workers exit 0 when rank 0 tells them to shut down, which can beat the link's STOP: found on the
    lab as a worker record `unrequested-exit-0` (exit 70, so systemd restarted it) after an ordered stop."""
    addr = f"127.0.0.1:{free_port()}"
    flag = tmp_path / "shutdown"
    head_engine = [PY, "-c", "import os, signal, sys, time, pathlib\n"
                   "def stop(*a):\n"
                   f"    pathlib.Path({str(flag)!r}).touch()\n"
                   "    time.sleep(1)\n"  # like SGLang's rank 0: it tells the workers, then winds down itself
                   "    sys.exit(0)\n"
                   "signal.signal(signal.SIGTERM, stop)\n"
                   "print('engine pid', os.getpid(), flush=True)\ntime.sleep(600)"]  # fmt: skip
    worker_engine = [PY, "-c", "import os, time, pathlib\nprint('engine pid', os.getpid(), flush=True)\n"
                     f"while not pathlib.Path({str(flag)!r}).exists(): time.sleep(0.01)\n"]  # fmt: skip
    head = Node(tmp_path, "head", ["--link-listen", addr], head_engine)
    worker = None
    try:
        head.engine_pid()
        worker = Node(tmp_path, "w1", ["--link-head", addr, "--link-wait", "20"], worker_engine)
        worker.engine_pid()
        head.p.send_signal(signal.SIGTERM)
        assert head.wait() == 0 and worker.wait() == 0, worker.output()
        assert worker.rec()["verdict"] == "deployment-stopped", worker.rec()["reason"]
        assert worker.rec()["reason"].startswith("stopped with the deployment: head was stopped on request (stop")
        assert "without being asked" not in worker.rec()["reason"]
    finally:
        head.kill()
        if worker:
            worker.kill()


def test_a_stop_of_the_head_stops_the_workers_only_once_its_engine_is_down(tmp_path):
    """vLLM's head may need its remote workers' ranks to shut down cleanly: found on the lab, where telling the
    workers at the head's SIGTERM left the head's engine stuck until the wrapper killed it (stop-timeout)."""
    addr = f"127.0.0.1:{free_port()}"
    done, got = tmp_path / "head-done", tmp_path / "worker-sigterm"
    head_engine = [PY, "-c", "import os, signal, sys, time, pathlib\n"
                   "def stop(*a):\n    time.sleep(1.5)\n"
                   f"    pathlib.Path({str(done)!r}).write_text(repr(time.time()))\n    sys.exit(0)\n"
                   "signal.signal(signal.SIGTERM, stop)\nprint('engine pid', os.getpid(), flush=True)\ntime.sleep(600)"]  # fmt: skip
    worker_engine = [PY, "-c", "import os, signal, sys, time, pathlib\n"
                     f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(got)!r}).write_text(repr(time.time())), "
                     "sys.exit(0)))\nprint('engine pid', os.getpid(), flush=True)\ntime.sleep(600)"]  # fmt: skip
    head = Node(tmp_path, "head", ["--link-listen", addr], head_engine)
    worker = None
    try:
        head.engine_pid()
        worker = Node(tmp_path, "w1", ["--link-head", addr, "--link-wait", "20"], worker_engine)
        worker.engine_pid()
        head.p.send_signal(signal.SIGTERM)
        assert head.wait() == 0 and worker.wait() == 0
        assert float(got.read_text()) >= float(done.read_text())
        assert worker.rec()["verdict"] == "deployment-stopped"
    finally:
        head.kill()
        if worker:
            worker.kill()


def test_a_peer_that_ignores_sigterm_after_a_failure_is_killed_at_the_link_deadline(tmp_path):
    """Found on the lab: a head whose engine waited for its dead peers on SIGTERM was only down at its 10 s stop
    deadline; after a peer's failure the link gives it --link-stop-timeout."""
    addr = f"127.0.0.1:{free_port()}"
    stubborn = [PY, "-c", "import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('engine pid', os.getpid(), flush=True)\ntime.sleep(600)"]  # fmt: skip
    head = Node(tmp_path, "head", ["--link-listen", addr, "--stop-timeout", "60", "--link-stop-timeout", "1"], stubborn)
    worker = None
    try:
        head.engine_pid()
        worker = Node(tmp_path, "w1", ["--link-head", addr, "--link-wait", "20"])
        os.kill(worker.engine_pid(), signal.SIGKILL)
        assert head.wait() == EXIT_PEER_FAILED  # within WAIT (30 s), not the 60 s stop timeout
        assert head.rec()["killed_after_timeout"] and head.rec()["verdict"] == "peer-failed"
    finally:
        head.kill()
        if worker:
            worker.kill()


def test_the_failed_nodes_error_line_reaches_the_head_as_text_and_redacted(tmp_path):
    """The FAIL message carried the first-error dict's repr, and an engine's error line unredacted into the head's
    journal and record."""
    addr = f"127.0.0.1:{free_port()}"
    cred = tmp_path / "creds"
    cred.mkdir()
    (cred / "api-key").write_text("sk-link-secret-0123456789")
    failing = [PY, "-c", "import os, sys, time\nprint('engine pid', os.getpid(), flush=True)\ntime.sleep(1)\n"
               "print('RuntimeError: boom with key ' + os.environ['VLLM_API_KEY'], flush=True)\nsys.exit(3)"]  # fmt: skip
    head = Node(tmp_path, "head", ["--link-listen", addr])
    worker = None
    try:
        head.engine_pid()
        os.environ["CREDENTIALS_DIRECTORY"] = str(cred)
        try:
            worker = Node(tmp_path, "w1", ["--link-head", addr, "--secret-env", "VLLM_API_KEY=api-key"], failing)
        finally:
            del os.environ["CREDENTIALS_DIRECTORY"]
        assert worker.wait() == 3 and head.wait() == EXIT_PEER_FAILED
        reason = head.rec()["link"]["stopped_by"]["reason"]
        assert reason.startswith("exit-code, exit 3: RuntimeError: boom with key ") and "{" not in reason, reason
        assert "sk-link-secret" not in reason and "sk-link-secret" not in head.output()
    finally:
        head.kill()
        if worker:
            worker.kill()
