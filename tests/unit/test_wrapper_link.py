"""The deployment link (`llmfleet exec --link-listen/--link-head`): real wrapper processes on localhost, one
head and two workers around engines that serve until killed and, like ranks stuck in a collective after a
peer died, never exit by themselves. Every wait has a deadline."""

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmfleet.wrapper.link import EXIT_PEER_FAILED, parse_addr

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


KEY = "k" * 8 + secrets.token_hex(24)  # the deployment's fabric key (a credential, as the unit hands it over)


class Node:
    def __init__(self, tmp_path, name, link, cmd=ENGINE, key=KEY, creds=None, extra_env=None):
        self.name, self.record = name, tmp_path / f"{name}.json"
        self.log = (tmp_path / f"{name}.log").open("w+")
        cdir = tmp_path / f"creds-{name}"
        cdir.mkdir(exist_ok=True)
        for cred, value in {"fabric-key": key, **(creds or {})}.items():
            (cdir / cred).write_text(value)
        argv = [*WRAP, "--record", str(self.record), "--link-node", name, "--link-timeout", "2", "--link-key",
                "fabric-key", *link, "--", *cmd]  # fmt: skip
        e = {**env(), "CREDENTIALS_DIRECTORY": str(cdir), **(extra_env or {})}
        self.p = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=e)

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
        # Its engine too, as systemd would with the unit's cgroup: a SIGKILLed wrapper leaves it running.
        for line in self.output().splitlines():
            if line.startswith("engine pid "):
                try:
                    os.kill(int(line.split()[-1]), signal.SIGKILL)
                except ProcessLookupError:
                    pass


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
        [*WRAP, "--link-key", "fabric-key", *flags, "--", "true"],
        capture_output=True,
        text=True,
        timeout=WAIT,
        env=env(),
        check=False,
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
    failing = [PY, "-c", "import os, sys, time\nprint('engine pid', os.getpid(), flush=True)\ntime.sleep(1)\n"
               "print('RuntimeError: boom with key ' + os.environ['VLLM_API_KEY'], flush=True)\nsys.exit(3)"]  # fmt: skip
    head = Node(tmp_path, "head", ["--link-listen", addr])
    worker = None
    try:
        head.engine_pid()
        worker = Node(tmp_path, "w1", ["--link-head", addr, "--secret-env", "VLLM_API_KEY=api-key"], failing,
                      creds={"api-key": "sk-link-secret-0123456789"})  # fmt: skip
        assert worker.wait() == 3 and head.wait() == EXIT_PEER_FAILED
        reason = head.rec()["link"]["stopped_by"]["reason"]
        assert reason.startswith("exit-code, exit 3: RuntimeError: boom with key ") and "{" not in reason, reason
        assert "sk-link-secret" not in reason and "sk-link-secret" not in head.output()
    finally:
        head.kill()
        if worker:
            worker.kill()


# ---- only the deployment's nodes take part (the fabric key)


def raw(addr, *lines, read=True):
    """A TCP peer on the fabric that is not a wrapper: sends lines, returns what it got back (up to 1 s of it)."""
    host, port = parse_addr(addr)
    with socket.create_connection((host, port), timeout=5) as s:
        for line in lines:
            s.sendall((line + "\n").encode())
        if not read:
            return ""
        s.settimeout(1)
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except OSError:
            pass
        return got.decode()


def stays_up(node, seconds=2.5):
    time.sleep(seconds)
    assert node.p.poll() is None, node.output()


def test_a_strangers_bye_and_fail_do_not_stop_or_restart_the_head(tmp_path):
    """Before the key, one `HELLO x` + `BYE head ...` from any host on the fabric stopped the head (exit 0,
    nothing restarts, the record blaming a node), `FAIL` or a dropped connection restarted the deployment."""
    addr = f"127.0.0.1:{free_port()}"
    head = Node(tmp_path, "head", ["--link-listen", addr])
    try:
        pid = head.engine_pid()
        raw(addr, "HELLO w1", "BYE w1 stop requested (SIGTERM)")
        raw(addr, f"HELLO w2 {secrets.token_hex(16)}", "FAIL w2 exit 1")
        raw(addr, f"HELLO w3 {secrets.token_hex(16)}", read=False)  # then gone: no node lost
        raw(addr, "STOP requested w1 x")
        stays_up(head)
        os.kill(pid, 0)  # the engine too
        out = head.output()
        assert out.count("link: refused a connection from 127.0.0.1:") == 4, out
        assert "did not answer the challenge" in out and "no valid HELLO" in out
    finally:
        head.kill()


def test_a_worker_with_another_key_is_refused_and_the_head_stays_up(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    head = Node(tmp_path, "head", ["--link-listen", addr])
    worker = None
    try:
        head.engine_pid()
        worker = Node(tmp_path, "w1", ["--link-head", addr, "--link-wait", "2"], key="x" * 48)
        assert worker.wait() == EXIT_PEER_FAILED
        assert "engine pid" not in worker.output()
        assert "did not prove the deployment's fabric key" in worker.rec()["reason"], worker.rec()["reason"]
        stays_up(head, 0.5)
    finally:
        head.kill()
        if worker:
            worker.kill()


@pytest.mark.parametrize(
    ("says", "logged"),
    [
        ("", "no challenge from the head's wrapper"),
        (f"CHALLENGE {secrets.token_hex(16)} {'0' * 64}\n", "the listener did not prove the deployment's fabric key"),
    ],
    ids=["no-challenge", "forged-proof"],
)
def test_a_fake_head_cannot_start_or_stop_a_worker(tmp_path, says, logged):
    """The worker checks the head's proof first: a listener without the key (before: any listener on the head's
    address) that says WELCOME then STOP neither starts the worker's engine nor stops it."""
    srv = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{srv.getsockname()[1]}"
    srv.settimeout(WAIT)
    worker = Node(tmp_path, "w1", ["--link-head", addr, "--link-wait", "2"])
    try:
        conn, _ = srv.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(f"{says}WELCOME\nSTOP requested head x\n".encode())
            assert worker.wait() == EXIT_PEER_FAILED
        assert "engine pid" not in worker.output()
        assert logged in worker.output()
    finally:
        srv.close()
        worker.kill()


def _join(addr, key, name="w1"):
    """A client that holds the key and does the worker's half of the handshake: (socket, session)."""
    from llmfleet import fabric_key as fk

    host, port = parse_addr(addr)
    s = socket.create_connection((host, port), timeout=5)
    f = s.makefile("rb")
    mine = fk.nonce()
    hello = f"HELLO {name} {mine}"
    s.sendall((hello + "\n").encode())
    _, theirs, proof = f.readline().decode().split()
    assert fk.same(proof, fk.head_proof(key, name, mine, theirs))
    auth = f"AUTH {fk.worker_proof(key, name, mine, theirs)}"
    s.sendall((auth + "\n").encode())
    session = fk.session_key(key, name, mine, theirs)
    welcome = f.readline().decode().split()
    assert welcome[0] == "WELCOME" and fk.same(welcome[1], fk.line_tag(session, "h", 0, "WELCOME"))
    return s, f, session, (hello, auth)


def test_a_recorded_handshake_cannot_be_replayed(tmp_path):
    """A stranger that recorded a worker's HELLO and AUTH gets a fresh challenge its recorded proof does not answer."""
    from llmfleet import fabric_key as fk

    addr = f"127.0.0.1:{free_port()}"
    head = Node(tmp_path, "head", ["--link-listen", addr])
    try:
        head.engine_pid()
        s, _f, session, recorded = _join(addr, KEY.encode(), "w1")
        tagged = "BYE w1 done"
        s.sendall(f"{tagged} {fk.line_tag(session, 'w', 0, tagged)}\n".encode())  # a real worker's BYE...
        assert head.wait() == 0  # ... stops the deployment on request
    finally:
        head.kill()
    head = Node(tmp_path, "head2", ["--link-listen", addr])
    try:
        head.engine_pid()
        got = raw(addr, *recorded, f"{tagged} {fk.line_tag(session, 'w', 0, tagged)}")
        assert got.startswith("CHALLENGE ") and "WELCOME" not in got
        stays_up(head)
        assert "'w1' did not prove the deployment's fabric key" in head.output()
    finally:
        head.kill()


def test_a_line_injected_into_a_nodes_connection_is_not_obeyed(tmp_path):
    """After the handshake every line carries its tag: an untagged BYE (injected on the way) is not a stop on
    request; the head counts the connection as broken (what an on-path attacker can do anyway by cutting it)."""
    addr = f"127.0.0.1:{free_port()}"
    head = Node(tmp_path, "head", ["--link-listen", addr])
    try:
        head.engine_pid()
        s, _f, _session, _ = _join(addr, KEY.encode(), "w1")
        with s:
            s.sendall(b"BYE w1 stop requested\n")
            assert head.wait() == EXIT_PEER_FAILED  # not 0: nobody asked for a stop
        by = head.rec()["link"]["stopped_by"]
        assert by["kind"] == "failed" and "failed its authentication" in by["reason"], by
    finally:
        head.kill()


def test_the_link_needs_the_key():
    cp = subprocess.run([*WRAP, "--link-head", "127.0.0.1:5", "--", "true"], capture_output=True, text=True,
                        timeout=WAIT, env=env(), check=False)  # fmt: skip
    assert cp.returncode == 2 and "--link-listen/--link-head need --link-key CRED" in cp.stderr, cp.stderr


# ---- the barrier: after a failure the nodes meet at the link before any engine starts ---------------------------


def _started(node):
    return "engine pid" in node.output()


def _until(what, check, seconds=WAIT):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"never: {what}")


def _barrier_head(tmp_path, addr, *extra, name="head"):
    status, metrics = tmp_path / f"{name}-status.json", tmp_path / f"{name}-metrics"
    metrics.mkdir(exist_ok=True)
    link = ["--link-listen", addr, "--link-peers", "w1,w2", "--status", str(status), "--metrics-dir", str(metrics),
            "--deployment", "demo", *extra]  # fmt: skip
    return Node(tmp_path, name, link), status, metrics


def _worker(tmp_path, addr, name, wait="20"):
    status = tmp_path / f"{name}-status.json"
    return Node(tmp_path, name, ["--link-head", addr, "--link-wait", wait, "--status", str(status)]), status


def _missing(status):
    try:
        return ((json.loads(status.read_text()).get("link") or {}).get("barrier") or {}).get("missing")
    except (OSError, ValueError):
        return None


def test_no_engine_starts_until_every_node_joined_and_the_missing_one_is_named(tmp_path):
    """A partition that heals: the head and one worker wait for w2 (journal, status file, gauge) and start no
    engine (before, each started its engine and died in the rendezvous); w2 joins and every engine starts."""
    addr = f"127.0.0.1:{free_port()}"
    head, hstatus, metrics = _barrier_head(tmp_path, addr)
    w1, w1status = _worker(tmp_path, addr, "w1")
    w2 = None
    try:
        _until(
            "the head waits for w2", lambda: "link: barrier: waiting for w2 to join (here: head, w1)" in head.output()
        )
        assert _until("the head's status names w2", lambda: _missing(hstatus)) == ["w2"]
        assert _until("w1's status names w2", lambda: _missing(w1status)) == ["w2"]
        assert "waits for w2 to join" in w1.output()
        prom = (metrics / "llmfleet_link_demo.prom").read_text()
        assert 'llmfleet_engine_link_missing_seconds{deployment="demo",node="head",unit="",missing="w2"}' in prom, prom
        assert not _started(head) and not _started(w1)
        w2, _ = _worker(tmp_path, addr, "w2")
        for n in (head, w1, w2):
            n.engine_pid()
        assert "link: barrier: every node joined (head, w1, w2): starting" in head.output()
        prom = (metrics / "llmfleet_link_demo.prom").read_text()
        assert 'missing=""} 0' in prom and 'missing="w2"' not in prom, prom
        assert _missing(hstatus) is None
        # A welcomed worker's status no longer says it waits (status listed it as waiting while it served).
        assert _until("w1's status cleared", lambda: _missing(w1status) is None and json.loads(w1status.read_text()))
        head.p.send_signal(signal.SIGTERM)
        assert head.wait() == 0 and w1.wait() == 0 and w2.wait() == 0
    finally:
        for n in (head, w1, w2):
            if n:
                n.kill()


def test_the_barrier_deadline_names_the_missing_node_and_starts_no_engine(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    head, _, _ = _barrier_head(tmp_path, addr, "--link-wait", "3")
    w1, _ = _worker(tmp_path, addr, "w1")
    try:
        assert head.wait() == EXIT_PEER_FAILED
        rec = head.rec()
        assert rec["verdict"] == "link-failed" and rec["child_pid"] is None, rec
        assert re.search(
            r"w2 did not join the deployment link in \d+ s \(here: head, w1\): down, or cut off from head",
            rec["reason"],
        ), rec["reason"]
        assert rec["link"]["barrier"]["missing"] == ["w2"], rec["link"]
        assert not _started(head) and not _started(w1)
        stays_up(w1, 1.5)  # it waits for the head's next run (its own deadline), not a failure of its own
    finally:
        head.kill()
        w1.kill()


def _hello(addr, key, name):
    """The worker's half of the handshake with the key: the head's first answer after it."""
    from llmfleet import fabric_key as fk

    host, port = parse_addr(addr)
    with socket.create_connection((host, port), timeout=5) as s:
        f = s.makefile("rb")
        mine = fk.nonce()
        s.sendall(f"HELLO {name} {mine}\n".encode())
        _, theirs, _proof = f.readline().decode().split()
        s.sendall(f"AUTH {fk.worker_proof(key, name, mine, theirs)}\n".encode())
        return (f.readline().decode().split() or [""])[0]


def test_a_node_the_head_does_not_expect_cannot_join_or_complete_the_barrier(tmp_path):
    """Even with the key (another deployment sharing it, a stale node): not one of --link-peers, refused."""
    addr = f"127.0.0.1:{free_port()}"
    head, hstatus, _ = _barrier_head(tmp_path, addr)
    w1, _ = _worker(tmp_path, addr, "w1")
    try:
        _until("w1 joined", lambda: "link: w1 joined; still missing: w2" in head.output())
        assert _hello(addr, KEY.encode(), "w9") == "UNKNOWN"
        raw(addr, f"HELLO w2 {secrets.token_hex(16)}", "AUTH " + "0" * 64)  # w2's name without the key
        stays_up(head, 1.5)
        out = head.output()
        assert "link: refused 'w9' from 127.0.0.1:" in out and "not a node of this deployment (expected: w1, w2)" in out
        assert "'w2' did not prove the deployment's fabric key" in out
        assert not _started(head) and _missing(hstatus) == ["w2"]
    finally:
        head.kill()
        w1.kill()


def test_a_worker_gone_while_the_nodes_wait_is_missing_again_and_a_restarted_head_is_joined(tmp_path):
    """No engine runs yet, so a node that goes away at the barrier is waited for again, not a failure; a worker
    that loses the head while it waits joins the head's next run (systemd restarted it)."""
    addr = f"127.0.0.1:{free_port()}"
    head, _, _ = _barrier_head(tmp_path, addr)
    w2, _ = _worker(tmp_path, addr, "w2")
    head2 = w1 = None
    try:
        _until("w2 waits", lambda: "link: w2 joined; still missing: w1" in head.output())
        head.kill()  # SIGKILL: w2 keeps waiting and joins the head's next run
        head2, _, _ = _barrier_head(tmp_path, addr, name="head2")
        _until("w2 joined the new head", lambda: "link: w2 joined; still missing: w1" in head2.output())
        assert w2.p.poll() is None and not _started(w2)
        w1, _ = _worker(tmp_path, addr, "w1")
        for n in (head2, w1, w2):
            n.engine_pid()
    finally:
        for n in (head, head2, w1, w2):
            if n:
                n.kill()


def test_a_joined_worker_that_goes_away_before_the_start_is_waited_for_again(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    head, hstatus, _ = _barrier_head(tmp_path, addr)
    w1, _ = _worker(tmp_path, addr, "w1")
    try:
        _until("w1 joined", lambda: "link: w1 joined; still missing: w2" in head.output())
        w1.kill()
        _until("w1 missing again", lambda: "link: barrier: w1 left before the engines started" in head.output())
        assert _until("both missing", lambda: _missing(hstatus) == ["w1", "w2"] or None, 10)
        assert head.p.poll() is None and not _started(head)
    finally:
        head.kill()
        w1.kill()


def test_a_stop_on_request_while_the_nodes_wait_stops_the_deployment(tmp_path):
    """Before, a worker waiting for the head's welcome ignored SIGTERM until its --link-wait ran out."""
    addr = f"127.0.0.1:{free_port()}"
    head, _, _ = _barrier_head(tmp_path, addr)
    w1, _ = _worker(tmp_path, addr, "w1", wait="600")
    try:
        _until("w1 joined", lambda: "link: w1 joined; still missing: w2" in head.output())
        w1.p.send_signal(signal.SIGTERM)
        assert w1.wait() == 0 and head.wait() == 0
        assert head.rec()["verdict"] == "deployment-stopped", head.rec()
        assert w1.rec()["verdict"] == "clean-stop" and not _started(head) and not _started(w1)
    finally:
        head.kill()
        w1.kill()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--link-head", "127.0.0.1:5", "--link-peers", "w1"], "--link-peers names the nodes the head waits for"),
        (["--link-listen", "127.0.0.1:5", "--link-node", "h", "--link-peers", "w1,h"], "not this node's own"),
        (["--link-listen", "127.0.0.1:5", "--link-peers", "w1,,w2"], "comma-separated"),
        (["--link-listen", "127.0.0.1:5", "--link-peers", "w/1"], "comma-separated"),
    ],
)
def test_bad_link_peers_are_usage_errors(flags, message):
    cp = subprocess.run([*WRAP, "--link-key", "fabric-key", *flags, "--", "true"], capture_output=True, text=True,
                        timeout=WAIT, env=env(), check=False)  # fmt: skip
    assert cp.returncode == 2 and message in cp.stderr, cp.stderr


def test_the_wait_at_the_barrier_is_no_failed_start_for_systemd(tmp_path):
    """The wait keeps pushing systemd's start timeout out (no timeout, no restart counted) and says who it waits for."""
    sock_path = tmp_path / "notify.sock"
    addr = f"127.0.0.1:{free_port()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(sock_path))
        sock.settimeout(15)
        head = Node(tmp_path, "head", ["--link-listen", addr, "--link-peers", "w1", "--extend-timeout", "42"],
                    extra_env={"NOTIFY_SOCKET": str(sock_path)})  # fmt: skip
        try:
            fields = []
            while fields.count("EXTEND_TIMEOUT_USEC=42000000") < 2:  # one now, one REPORT_S (5 s) later
                fields += sock.recv(4096).decode().split("\n")
            assert "STATUS=deployment link: waiting for w1 to join (here: head)" in fields, fields
            assert head.p.poll() is None and not _started(head)
        finally:
            head.kill()


def test_a_flood_of_silent_connections_costs_a_bounded_number_of_threads_and_a_node_still_joins():
    """Every connection got a thread until its handshake timed out: a stranger's flood of silent connections could
    hold any number. Now an address may hold MAX_PENDING_PER_ADDR connections in their handshake; past that a new
    one is closed at once, counted and said (once per FLOOD_LOG_S); a node from another address joins meanwhile."""
    from llmfleet import fabric_key as fk
    from llmfleet.wrapper import link as lk

    logs = []
    port = free_port()
    head = lk.DeploymentLink("head", listen=("127.0.0.1", port), key=b"k" * 32, on_stop=lambda *_: None,
                             log=logs.append, timeout=5.0)  # fmt: skip
    head.start(time.monotonic() + 5)
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(lk.MAX_PENDING_PER_ADDR)]
    try:
        _until(
            "the silent connections are pending",
            lambda: head.pending.counts.get("127.0.0.1") == lk.MAX_PENDING_PER_ADDR,
        )
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        t0 = time.monotonic()
        assert extra.recv(1) == b"" and time.monotonic() - t0 < 2  # closed at once, not after the handshake timeout
        extra.close()
        assert head.refused == 1
        _until("the refusal is said", lambda: any("refused connections from 127.0.0.1: 4 of its" in x for x in logs))
        # a node on another address (127.0.0.2 is loopback too) proves the key and is welcomed
        s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.2", 0))
        f = s.makefile("rb")
        mine = fk.nonce()
        s.sendall(f"HELLO w1 {mine}\n".encode())
        _, theirs, _ = f.readline().decode().split()
        s.sendall(f"AUTH {fk.worker_proof(b'k' * 32, 'w1', mine, theirs)}\n".encode())
        assert f.readline().decode().startswith("WELCOME")
        s.close()
    finally:
        for c in silent:
            c.close()
        head.close()
    _until("the pending count drains", lambda: not head.pending.counts)
