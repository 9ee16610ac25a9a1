"""llmfleet_job_wait (an action plugin; library/ holds its doc stub): options -> what it reads on the node (the
job's status file and the progress file with `cat`; async_status only for a job file that holds no result), progress
lines while the job runs, the job's result at the end (read from its file, which `rm` then removes)."""

import importlib.util
import json
import re
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from ansible.errors import AnsibleActionFail

PATH = Path(__file__).parents[3] / "action_plugins" / "llmfleet_job_wait.py"
_spec = importlib.util.spec_from_file_location("llmfleet_job_wait_action", PATH)
action = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(action)

GiB = 1024**3
DONE = {"finished": 1, "ansible_job_id": "j1", "results_file": "/r", "started": 1, "erased": "/r",
        "changed": True, "path": "/nvme/models/qwen/rev", "bytes_copied": GiB}  # fmt: skip


BOOKKEEPING = ("finished", "ansible_job_id", "results_file", "started", "erased")


def job_file(st):
    """The job file as async_wrapper writes it: {"started": 1, "finished": 0, ...} while the job runs, then the
    module's own result (no "started")."""
    if st.get("finished"):
        return json.dumps({k: v for k, v in st.items() if k not in BOOKKEEPING})
    return json.dumps({"started": 1, **st})


def plugin(monkeypatch, args, statuses, progress=None, clock=time.monotonic):
    """The action with a fake node: each poll `cat`s the job file, which holds `statuses` in turn (a dict, or raw
    text); async_status answers with the status that ended the job; `cat` of the progress file reads `progress`."""
    task = SimpleNamespace(args=args, async_val=0, check_mode=False, action="llmfleet_job_wait")
    conn = SimpleNamespace(_shell=SimpleNamespace(tmpdir="/tmp/x"))
    am = action.ActionModule(task, conn, play_context=None, loader=None, templar=None)
    am._load_name = "llmfleet_job_wait"
    calls, lines = [], []
    answers = iter(statuses)
    seen = {}

    def execute(module_name, module_args, task_vars):
        calls.append((module_name, module_args))
        assert module_name == "ansible.legacy.async_status"
        return dict(seen["status"]) if module_args["mode"] == "status" else {"erased": "/r"}

    def shell(cmd, sudoable=False):
        calls.append(("cat", cmd))
        assert sudoable  # as the task's become user, like the modules it replaces
        if cmd.endswith("cat -- /home/ops/.ansible_async/j1") or cmd.endswith("cat -- /home/ops/.ansible_async/j9"):
            st = seen["status"] = next(answers)
            text = st if isinstance(st, str) else job_file(st)
            return {"rc": 0, "stdout": text}
        if cmd.startswith("rm -f -- "):
            return {"rc": 0, "stdout": ""}
        if progress is None:
            return {"rc": 1, "stdout": "", "stderr": "cat: no such file"}
        return {"rc": 0, "stdout": json.dumps(progress)}

    monkeypatch.setattr(am, "_execute_module", execute)
    monkeypatch.setattr(am, "_low_level_execute_command", shell)
    monkeypatch.setattr(am, "_remote_expand_user", lambda p: p.replace("~", "/home/ops"))
    monkeypatch.setattr(am, "get_shell_option", lambda name, default=None: default)
    # The plugin's own clock (not the time module everyone shares): sleeping is recorded, not done.
    monkeypatch.setattr(action, "time", SimpleNamespace(monotonic=clock, sleep=lambda s: calls.append(("sleep", s))))
    monkeypatch.setattr(action.display, "display", lines.append)
    return am, calls, lines


def test_options_become_the_node_calls_and_the_result_is_the_jobs(monkeypatch):
    progress = {"phase": "copying", "total_bytes": 4 * GiB, "done_bytes": GiB, "rate_bytes_per_s": 2**29,
                "source_bytes_read": GiB, "peer_bytes_read": 0}  # fmt: skip
    am, calls, lines = plugin(monkeypatch, {"jid": "j1", "what": "staging", "progress_path": "/var/lib/llmfleet/p.json",
                                         "progress": "stage", "interval": "2"},
                              [{"finished": 0}, DONE], progress)  # fmt: skip
    res = am.run(task_vars={"inventory_hostname": "node1"})
    assert calls[:2] == [
        ("cat", "cat -- /home/ops/.ansible_async/j1"),  # running: no module run on the node
        ("cat", "cat -- /var/lib/llmfleet/p.json"),
    ]
    # Then one wait on the node until the next line is due (2 s), looking at the job file every 0.25 s; it ended
    # finished: its result is read from that file, which is then removed (no async_status module run)
    assert re.fullmatch(
        r"i=0; while \[ \$i -lt [78] \] && grep -qE '\"finished\": \(false\|0\)\[,\}\]' /home/ops/.ansible_async/j1 "
        r"2>/dev/null; do sleep 0.25; i=\$\(\(i\+1\)\); done; cat -- /home/ops/.ansible_async/j1",
        calls[2][1],
    )
    assert calls[3:] == [("cat", "rm -f -- /home/ops/.ansible_async/j1 /home/ops/.ansible_async/j1.progress")]
    assert lines == [
        "node1: copying 1.00/4.00 GiB (25%) at 512 MiB/s; from shared storage 1.00 GiB, from peers 0.00 GiB"
    ]
    assert res == {"changed": True, "path": "/nvme/models/qwen/rev", "bytes_copied": GiB}  # async bookkeeping dropped


def test_timeout_fails_naming_the_last_progress(monkeypatch):
    ticks = iter([0.0, 0.0, 11.0])
    am, _calls, _lines = plugin(monkeypatch, {"jid": "j1", "what": "staging", "progress_path": "/p.json",
                                                  "progress": "stage", "timeout": 10, "timeout_hint": "It keeps its files."},
                                [{"finished": 0}, {"finished": 0}], clock=lambda: next(ticks))  # fmt: skip
    with pytest.raises(AnsibleActionFail, match=r"^node1: staging still running after 10 s \(last progress: none\); "
                                                r"the job goes on on the node \(async job j1, until its async limit\)\. "
                                                r"It keeps its files\.$"):  # fmt: skip
        am.run(task_vars={"inventory_hostname": "node1"})


@pytest.mark.parametrize(
    ("args", "text"),
    [
        ({"what": "x", "progress_path": "/p.json"}, "missing required arguments: jid"),
        ({"jid": "j1", "what": "x", "timeout": "a day"}, "argument 'timeout' is of type str and we were unable to convert to int"),
        ({"jid": "j1", "what": "x", "retries": 5}, "Unsupported parameters for (llmfleet_job_wait) module: retries"),
        ({"jid": "j1", "what": "x", "progress": "percent"}, "value of progress must be one of: none, stage, gate"),
        ({"jid": "j1", "what": "x", "progress": "stage"}, "progress=stage reads a progress file: give progress_path"),
        ({"jid": "j1", "what": "x", "poll": 0}, "poll=0.0 and interval=5.0 must be > 0 (seconds)"),
    ],
)  # fmt: skip
def test_bad_options_fail_before_any_node_call(monkeypatch, args, text):
    am, calls, _lines = plugin(monkeypatch, args, [])
    with pytest.raises(AnsibleActionFail) as e:
        am.run(task_vars={"inventory_hostname": "node1"})
    assert text in str(e.value) and calls == []


def test_a_job_without_progress_file_says_how_long_it_runs_and_never_reads_a_file(monkeypatch):
    ticks = iter([0.0, 0.0, 3.0, 3.0, 12.0, 12.0])  # start, then each look's start and end
    am, calls, lines = plugin(monkeypatch, {"jid": "j9", "what": "the full NCCL world", "interval": 10, "timeout": 660},
                              [{"finished": 0}, {"finished": 0}, {"finished": 1, "ok": True}],
                              clock=lambda: next(ticks))  # fmt: skip
    res = am.run(task_vars={"inventory_hostname": "node2"})
    # The first poll (3 s) is inside the first interval: quiet. The second (12 s) says it runs.
    assert lines == ["node2: the full NCCL world: running for 12 s (at most 660 s)"]
    assert not [c for c in calls if c[0] == "cat" and "ansible_async" not in c[1]]
    assert res == {"ok": True}


def test_gate_progress_becomes_one_line_per_poll(monkeypatch):
    progress = {"elapsed_s": 42.0, "deadline_s": 3600, "api": "connection refused",
                "units": [{"name": "node1", "unit": "active", "phase": "serving", "failed": None},
                          {"name": "node2", "unit": "activating", "phase": "loading", "failed": None}]}  # fmt: skip
    am, _calls, lines = plugin(monkeypatch, {"jid": "j1", "what": "engine readiness gate", "progress": "gate",
                                             "progress_path": "/tmp/g/gate-0.json"},
                               [{"finished": 0}, {"finished": 1, "ready": True}], progress)  # fmt: skip
    assert am.run(task_vars={"inventory_hostname": "node1"}) == {"ready": True}
    assert lines == [
        "engine gate 42/3600 s: node1 active (serving), node2 activating (loading); API: connection refused"
    ]


def test_waits_on_the_node_until_the_next_line_and_never_loops_tightly(monkeypatch):
    # The first look is at once; the next waits on the node (every `poll`) until the next line is due. That wait
    # came back at once (the job file not written yet): the plugin sleeps `poll` before the next, not a tight loop.
    ticks = iter([0.0, 0.0, 1.0, 1.0, 1.1, 2.0])
    am, calls, _lines = plugin(monkeypatch, {"jid": "j1", "what": "x", "interval": 30, "poll": 0.5},
                               [{"finished": 0}, "", {"finished": 1}], clock=lambda: next(ticks))  # fmt: skip
    am.run(task_vars={"inventory_hostname": "node1"})
    looks = [c[1] for c in calls if c[0] == "cat"]
    assert looks[0] == "cat -- /home/ops/.ansible_async/j1"
    assert "while [ $i -lt 58 ]" in looks[1] and "do sleep 0.5;" in looks[1]  # 29 s until the line is due
    assert [c[1] for c in calls if c[0] == "sleep"] == [0.5]


@pytest.mark.parametrize(
    ("text", "running"),
    [
        ("", True),  # the job file exists but is not written yet
        ('{"started": 1, "fini', True),  # half-written
        ('{"started": 1, "finished": 0, "ansible_job_id": "j1"}', True),
        ('{"started": 1, "finished": 1, "rc": 0}', False),
        ('{"changed": true, "rc": 0}', False),  # the module's result without the bookkeeping keys
        (None, False),  # no such job file: async_status says why
    ],
)
def test_the_job_file_is_read_as_async_status_reads_it(text, running):
    assert action.ActionModule._still_running(text) is running


def test_a_missing_job_file_is_async_statuss_failure(monkeypatch):
    am, calls, _lines = plugin(monkeypatch, {"jid": "j1", "what": "x"}, [{"finished": 1, "failed": True,
                                                                        "msg": "could not find job"}])  # fmt: skip
    # No job file: `cat` fails, async_status explains (its failure is the result), the cleanup `rm -f` is harmless.
    monkeypatch.setattr(
        am,
        "_low_level_execute_command",
        lambda cmd, sudoable=False: (
            calls.append(("sh", cmd))
            or {"rc": 0 if cmd.startswith("rm ") else 1, "stdout": "", "stderr": "cat: no such file"}
        ),
    )
    monkeypatch.setattr(
        am,
        "_execute_module",
        lambda module_name, module_args, task_vars: (
            calls.append((module_name, module_args)) or {"finished": 1, "failed": True, "msg": "could not find job"}
        ),
    )
    res = am.run(task_vars={"inventory_hostname": "node1"})
    assert res["failed"] and res["msg"] == "could not find job"
    assert [c[0] for c in calls] == ["sh", "ansible.legacy.async_status", "sh"]


def test_a_paths_shell_characters_are_quoted(monkeypatch):
    am, calls, _lines = plugin(monkeypatch, {"jid": "j1", "what": "x", "progress": "gate",
                                             "progress_path": "/tmp/a b;rm -rf x/gate.json"},
                               [{"finished": 0}, {"finished": 1}], {"elapsed_s": 1})  # fmt: skip
    am.run(task_vars={"inventory_hostname": "node1"})
    assert ("cat", "cat -- '/tmp/a b;rm -rf x/gate.json'") in calls


GATE = {"elapsed_s": 0.4, "deadline_s": 260, "api": None,
        "units": [{"name": "node1", "unit": "active", "phase": "serving", "failed": None},
                  {"name": "node2", "unit": "active", "phase": "warm", "failed": None}]}  # fmt: skip


def test_a_progress_file_not_there_yet_is_awaited_not_replaced_by_running_for_0_s(monkeypatch):
    # CI 2026-12-02: the first poll came before the gate's first progress write and printed "running for 0 s";
    # the next line was due an interval later, after the gate had ended: no progress line at all.
    reads = iter([None, GATE])
    ticks = iter([0.0, 0.0, 0.0, 0.5, 1.0, 1.0])
    am, calls, lines = plugin(monkeypatch, {"jid": "j1", "what": "engine readiness gate", "progress": "gate",
                                             "progress_path": "/tmp/g/gate-0.json", "interval": 5},
                              [{"finished": 0}, {"finished": 0}, {"finished": 1, "ready": True}], GATE,
                              clock=lambda: next(ticks))  # fmt: skip
    shell = am._low_level_execute_command

    def first_missing(cmd, sudoable=False):
        if "gate-0.json" in cmd:
            calls.append(("cat", cmd))
            text = next(reads)
            return {"rc": 1, "stdout": ""} if text is None else {"rc": 0, "stdout": json.dumps(text)}
        return shell(cmd, sudoable)

    monkeypatch.setattr(am, "_low_level_execute_command", first_missing)
    assert am.run(task_vars={"inventory_hostname": "node1"}) == {"ready": True}
    assert lines == ["engine gate 0/260 s: node1 active (serving), node2 active (warm)"]


def test_a_job_that_ends_before_its_progress_was_shown_prints_its_last_progress(monkeypatch):
    am, calls, lines = plugin(monkeypatch, {"jid": "j1", "what": "engine readiness gate", "progress": "gate",
                                             "progress_path": "/tmp/g/gate-0.json"},
                              [{"finished": 1, "ready": True}], GATE)  # fmt: skip
    assert am.run(task_vars={"inventory_hostname": "node1"}) == {"ready": True}
    assert lines == ["engine gate 0/260 s: node1 active (serving), node2 active (warm)"]
    assert ("cat", "cat -- /tmp/g/gate-0.json") in calls


def test_the_wait_on_the_node_is_a_real_shell_loop(monkeypatch, tmp_path):
    """The command the plugin sends, run by /bin/sh: it returns the finished job file within a look of the job
    ending, and a running one after its looks."""
    am, _calls, _lines = plugin(monkeypatch, {"jid": "j1", "what": "x"}, [])

    def sh(cmd, sudoable=False):
        cp = subprocess.run(["/bin/sh", "-c", cmd], capture_output=True, text=True, check=False)
        return {"rc": cp.returncode, "stdout": cp.stdout}

    monkeypatch.setattr(am, "_low_level_execute_command", sh)
    job = tmp_path / "j1"
    job.write_text(json.dumps({"started": True, "finished": False, "ansible_job_id": "j1"}))
    assert action.ActionModule._still_running(am._wait_read(str(job), 0.3, 0.1))  # still running after its looks

    def finish():
        time.sleep(0.3)
        tmp = tmp_path / "j1.tmp"
        tmp.write_text(json.dumps({"changed": False, "rc": 0}))
        tmp.rename(job)  # as async_wrapper writes it

    threading.Thread(target=finish).start()
    text = am._wait_read(str(job), 30, 0.1)
    assert json.loads(text) == {"changed": False, "rc": 0}
    assert am._wait_read(str(tmp_path / "none"), 1, 0.1) is None  # no such job file: async_status says why


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ('{"changed": false, "ok": true}', {"changed": False, "ok": True}),
        # async_wrapper keeps a module's stderr; the module runner splits it into lines
        ('{"ok": true, "stderr": "a\\nb\\n"}', {"ok": True, "stderr": "a\nb\n", "stderr_lines": ["a", "b"]}),
        ('{"failed": true, "msg": "rank 3 never arrived"}', {"failed": True, "msg": "rank 3 never arrived"}),
        ('{"ok": true, "_ansible_suppress_tmpdir_delete": true}', {"ok": True}),  # internal keys dropped
    ],
)  # fmt: skip
def test_a_finished_jobs_result_is_read_from_its_file_without_a_module_run(monkeypatch, text, want):
    am, calls, _lines = plugin(monkeypatch, {"jid": "j1", "what": "x"}, [text])
    res = am.run(task_vars={"inventory_hostname": "node1"})
    # A failure also gets the error summary the module runner adds to every failed module result
    assert "exception" in res if res.get("failed") else "exception" not in res
    assert {k: v for k, v in res.items() if k != "exception"} == want
    assert calls == [
        ("cat", "cat -- /home/ops/.ansible_async/j1"),
        ("cat", "rm -f -- /home/ops/.ansible_async/j1 /home/ops/.ansible_async/j1.progress"),
    ]


@pytest.mark.parametrize("text", ['{"started": 1, "finished": 1}', "[1, 2]", "null"])
def test_a_job_file_that_holds_no_result_is_left_to_async_status(monkeypatch, text):
    am, _calls, _lines = plugin(monkeypatch, {"jid": "j1", "what": "x"}, [text])
    assert am._result(text, "j1") is None


def test_a_detached_jobs_own_results_file_is_the_one_read(monkeypatch):
    am, _calls, _lines = plugin(monkeypatch, {"jid": "j1", "what": "x", "results_file": "/var/tmp/jobs/j1"},
                               [{"finished": 1, "ok": True}])  # fmt: skip
    shell, sent = am._low_level_execute_command, []

    def elsewhere(cmd, sudoable=False):  # the fake node keeps job files in one place: map the path there
        sent.append(cmd)
        return shell(cmd.replace("/var/tmp/jobs/", "/home/ops/.ansible_async/"), sudoable)

    monkeypatch.setattr(am, "_low_level_execute_command", elsewhere)
    assert am.run(task_vars={"inventory_hostname": "node1"}) == {"ok": True}
    assert sent == ["cat -- /var/tmp/jobs/j1", "rm -f -- /var/tmp/jobs/j1 /var/tmp/jobs/j1.progress"]
