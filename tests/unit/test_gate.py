"""Readiness gate pieces that need no lab: unit-state judgement, probe parsing, the answer check
against a real local HTTP server, failure messages, ssh argv."""

import json
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmfleet import gate


def node(rank=0):
    return gate.Node({"name": f"node{rank + 1}", "rank": rank, "ssh": ["true"]}, "u.service", "/s", "/r")


def probe(active="activating", sub="start", restarts=0, result="success", code="0", status=None):
    return {"unit": {"ActiveState": active, "SubState": sub, "NRestarts": str(restarts), "Result": result,
                     "ExecMainCode": "1", "ExecMainStatus": code, "InvocationID": "abc"}, "status": status}  # fmt: skip


def test_judge_node_states():
    n = node()
    assert gate.judge_node(n, probe()) is None
    assert gate.judge_node(n, probe("active", "running")) is None
    assert "unit failed" in gate.judge_node(n, probe("failed", "failed", result="exit-code", code="70"))
    assert "systemd will restart it" in gate.judge_node(n, probe("activating", "auto-restart", result="signal"))
    # A restart between two polls is caught by the counter even when the unit looks fine again.
    assert "restarted 1 time" in gate.judge_node(n, probe("activating", "start", restarts=1))
    assert "nothing is running" in gate.judge_node(node(), probe("inactive", "dead"))
    assert gate.judge_node(node(), {"error": "ssh timed out"}) is None


def test_parse_probe_and_stale_status():
    out = (
        "ActiveState=active\nSubState=running\nInvocationID=abc\n@@status\n"
        + json.dumps({"invocation_id": "abc", "phase": "serving"})
        + "\n@@end\n"
    )
    p = gate.parse_probe(out)
    assert p["unit"]["ActiveState"] == "active" and p["status"]["phase"] == "serving"
    assert gate._status_for(node(), p)["phase"] == "serving"
    p["status"]["invocation_id"] = "old"
    assert gate._status_for(node(), p) is None  # a status file from an earlier run is ignored


class Api(BaseHTTPRequestHandler):
    answer = "703"
    think = False

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["temperature"] == 0
        think = "<think>37x19 is 703</think>" if Api.think else ""
        msg = {"role": "assistant", "content": f"{think}{Api.answer}", "reasoning_content": "37x19 is 703"}
        data = json.dumps({"choices": [{"message": msg}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def api():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_chat_check_compares_exactly_and_fails_on_leaked_reasoning(api):
    Api.think = False
    Api.answer = "703"
    assert gate.chat_check(api, "m", "37x19?", "703", api_key=None, timeout=5)["ok"]
    Api.think = True  # a <think> block left in content is a failure, not stripped away
    res = gate.chat_check(api, "m", "37x19?", "703", api_key=None, timeout=5)
    assert not res["ok"] and "reasoning leaked" in res["why"] and "--reasoning-parser" in res["why"]
    Api.think = False
    Api.answer = "The answer is 703"
    res = gate.chat_check(api, "m", "37x19?", "703", api_key=None, timeout=5)
    assert not res["ok"] and "expected '703'" in res["why"]
    assert not gate.chat_check("http://127.0.0.1:1", "m", "q", "703", api_key=None, timeout=2)["ok"]


def test_failure_message_names_node_rank_and_stop():
    res = {
        "first_failed": {
            "node": "node2", "node_rank": 1, "why": "unit failed (Result=signal)",
            "rank": {"tp": 1, "pp": 1, "rank": None, "line": "[.. TP1 PP1] RuntimeError: boom"},
            "record": {"verdict": "signal", "exit_code": 137, "reason": "killed by SIGKILL"},
            "journal_tail": ["a", "b"],
        },
        "stop": [{"node": "node1", "state": "inactive", "stopped": True, "killed": []},
                 {"node": "node2", "state": "failed", "stopped": True, "killed": ["the wrapper killed it"]}],
    }  # fmt: skip
    msg = gate.failure_message(res)
    assert "first failed node node2 (node rank 1) (TP1 PP1)" in msg
    assert "verdict signal, exit 137" in msg and "RuntimeError: boom" in msg
    assert "node1 inactive, node2 failed (killed)" in msg and "NOT stopped" not in msg


def test_ssh_argv_follows_the_inventory():
    argv = gate.ssh_argv({"inventory_hostname": "n1", "ansible_host": "10.0.0.1", "ansible_user": "ops",
                          "ansible_port": 2222, "ansible_ssh_common_args": "-F /x/ssh_config"})  # fmt: skip
    assert argv[0] == "ssh" and argv[-1] == "10.0.0.1"
    assert ["-F", "/x/ssh_config"] == argv[argv.index("-F") : argv.index("-F") + 2]
    assert ["-p", "2222"] == argv[argv.index("-p") : argv.index("-p") + 2] and "BatchMode=yes" in argv


def test_ssh_argv_has_no_shared_control_path():
    # The control socket is per gate run, in a private directory (not a fixed path in /tmp).
    argv = gate.ssh_argv({"inventory_hostname": "n1", "ansible_host": "10.0.0.1"}, connect_timeout=4)
    assert not any("ControlPath" in a for a in argv) and "ConnectTimeout=4" in argv


def test_gate_control_dir_is_private_and_removed(tmp_path):
    g = gate.Gate([{"name": "node1", "rank": 0, "ssh": ["true"]}], "u.service", status_file="/s", record_file="/r",
                  api_base="http://127.0.0.1:1", model="m")  # fmt: skip
    d = g.control_dir
    assert (os.stat(d).st_mode & 0o777) == 0o700 and not d.startswith("/tmp/llmfleet-ansible")
    assert any("ControlPath=" + d in a for a in g.nodes[0].remote.control)
    g.close()
    assert not os.path.exists(d)


def fake_ssh(tmp_path, script_body):
    """An `ssh` stand-in: runs the remote command line with sh locally (records what it was given)."""
    fake = tmp_path / "ssh"
    fake.write_text("#!/bin/sh\n" + script_body)
    fake.chmod(0o755)
    return str(fake)


def test_remote_scripts_run_as_root_or_through_sudo(tmp_path):
    # The remote side gets one shell line: as root it runs the script directly, otherwise `sudo -n`.
    r = gate.Remote("node1", [fake_ssh(tmp_path, 'for a; do last="$a"; done; printf %s "$last" > "$0.line"\n'), "h"])
    r.run("echo hi")
    line = (tmp_path / "ssh.line").read_text()
    assert line.startswith("sh -c ") and "sudo -n -- sh -c" in line and line.endswith("'echo hi'")
    # Run that line as the shell would: as root here, so the script runs directly.
    assert subprocess.run(["sh", "-c", line], check=True, capture_output=True, text=True).stdout == "hi\n"


def test_sudo_asking_for_a_password_is_said_at_once(tmp_path):
    r = gate.Remote("node2", [fake_ssh(tmp_path, 'echo "sudo: a password is required" >&2; exit 1\n'), "h"])
    with pytest.raises(gate.PrivilegeError, match=r"node2: sudo: a password is required.*passwordless sudo"):
        r.run("systemctl stop x")


def test_an_unreachable_node_fails_after_the_bound_not_the_deadline(monkeypatch):
    n = node(1)
    err = {"error": "ssh: connect to host 10.0.0.2 port 22: Connection refused"}
    now = [1000.0]
    monkeypatch.setattr(gate.time, "time", lambda: now[0])
    assert gate.judge_node(n, dict(err, since=now[0]), unreachable_after=30) is None
    now[0] += 29
    assert gate.judge_node(n, dict(err, since=1000.0), unreachable_after=30) is None and not n.unreachable
    now[0] += 2
    why = gate.judge_node(n, dict(err, since=1000.0), unreachable_after=30)
    assert why.startswith("unreachable over SSH for 31 s") and "Connection refused" in why and n.unreachable


def test_probe_tracks_the_first_failed_poll(tmp_path):
    n = gate.Node({"name": "node2", "rank": 1, "ssh": [fake_ssh(tmp_path, "echo 'ssh: no route' >&2; exit 255\n"), "h"]},
                  "u.service", "/s", "/r")  # fmt: skip
    p1 = n.probe()
    p2 = n.probe()
    assert "no route" in p1["error"] and p1["since"] == p2["since"]


@pytest.fixture
def open_tmp():
    """A scratch directory other users can traverse (pytest's tmp_path lives under a 0700 root dir)."""
    import shutil
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp(dir="/var/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def test_engine_files_are_read_as_the_engine_user_not_root(open_tmp):
    """The engine's user owns its state directory: a status.json it turned into a symlink to a
    root-only file must give the gate (which runs as root on the node) nothing."""
    tmp_path = open_tmp
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$secret\n")
    secret.chmod(0o600)
    state = tmp_path / "state"
    state.mkdir()
    os.chown(state, 65534, 65534)
    (state / "status.json").symlink_to(secret)
    path = str(state / "status.json")
    as_root = subprocess.run(["sh", "-c", gate.read_cmd(path, None)], check=False, capture_output=True, text=True)
    assert "secret" in as_root.stdout  # what the plain `cat` the gate used before did (as root)
    safe = subprocess.run(["sh", "-c", gate.read_cmd(path, "nobody")], check=False, capture_output=True, text=True)
    assert safe.stdout == ""
    (state / "ok.json").write_text('{"phase": "serving"}')
    ok = gate.read_cmd(str(state / "ok.json"), "nobody")
    assert subprocess.run(["sh", "-c", ok], check=True, capture_output=True, text=True).stdout == '{"phase": "serving"}'


class Refusing(BaseHTTPRequestHandler):
    """An engine that is up but refuses the question (e.g. max_tokens above max_model_len)."""

    def log_message(self, *a):
        pass

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, {"data": [{"id": "m"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(400, {"error": {"message": "max_tokens=1024 cannot be greater than max_model_len=256."}})


def test_a_refused_question_fails_the_gate_at_once_not_at_the_deadline(tmp_path, monkeypatch):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    active = "ActiveState=active\nSubState=running\nNRestarts=0\nInvocationID=abc\n@@status\n{}\n@@end\n"
    fake = fake_ssh(tmp_path, f"printf '{active}'\n")
    g = gate.Gate([{"name": "node1", "rank": 0, "ssh": [fake, "h"]}], "u.service", status_file="/s", record_file="/r",
                  api_base=f"http://127.0.0.1:{srv.server_address[1]}", model="m", deadline=600, poll=0.05)  # fmt: skip
    monkeypatch.setattr(gate, "ordered_stop", lambda *a, **k: [])
    res = g.wait()
    srv.shutdown()
    assert not res["ready"] and res["first_failed"]["node"] == "node1"
    assert "asking again cannot help" in res["first_failed"]["why"] and "max_model_len" in res["first_failed"]["why"]
    assert res["kind"] == "bad answer"  # not "deadline" (600 s)
