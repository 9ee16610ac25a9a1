"""Readiness gate pieces that need no lab: unit-state judgement, probe parsing, the answer check
against a real local HTTP server, failure messages, ssh argv."""

import json
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

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["temperature"] == 0
        msg = {"role": "assistant", "content": f"<think>37x19 is 703</think>{Api.answer}"}
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


def test_chat_check_strips_thinking_and_compares_exactly(api):
    Api.answer = "703"
    assert gate.chat_check(api, "m", "37x19?", "703", api_key=None, timeout=5)["ok"]
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
