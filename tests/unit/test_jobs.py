"""llmfleet.jobs: a module's work detached as a job in async_wrapper's file protocol (really forked here)."""

import json
import os
import time

from llmfleet import jobs
from tests.unit.modules.util import job_result


def test_the_work_runs_detached_and_its_result_replaces_the_running_file(tmp_path):
    def work():
        with open(f"/proc/{os.getpid()}/comm") as f:
            comm = f.read().strip()
        return {"changed": False, "ok": True, "pid": os.getpid(), "sid": os.getsid(0), "comm": comm}

    started = jobs.start(work, 30, str(tmp_path / "async"), name="llmfleet-stage")
    path = started["results_file"]
    assert started == {"ansible_job_id": os.path.basename(path), "results_file": path, "started": True,
                       "finished": False}  # fmt: skip
    assert os.stat(tmp_path / "async").st_mode & 0o777 == 0o700 and os.stat(path).st_mode & 0o777 == 0o600
    res = job_result(path)
    assert res["ok"] is True and res["pid"] != os.getpid()
    assert res["comm"] == "llmfleet-stage"  # what ps, top and `pkill -x llmfleet-stage` see
    assert res["sid"] != os.getsid(0)  # a session of its own: no terminal or SSH session holds it


def test_a_failing_work_leaves_a_failure_naming_it(tmp_path):
    def work():
        raise OSError("numactl: not found")

    res = job_result(jobs.start(work, 30, str(tmp_path))["results_file"])
    assert res == {"failed": True, "msg": "the job failed: OSError: numactl: not found"}


def test_a_work_past_its_limit_is_killed_and_says_so(tmp_path):
    started = jobs.start(lambda: time.sleep(60) or {"ok": True}, 1, str(tmp_path))
    res = job_result(started["results_file"])
    assert res == {"failed": True, "msg": "the job ran past its limit of 1 s and was killed",
                   "ansible_job_id": started["ansible_job_id"]}  # fmt: skip


def test_a_job_that_cannot_fork_leaves_that_failure_for_the_wait(tmp_path, monkeypatch):
    def no_fork():
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(jobs.os, "fork", no_fork)
    started = jobs.start(lambda: {"ok": True}, 30, str(tmp_path))
    assert json.loads(open(started["results_file"]).read()) == {
        "failed": True, "msg": "the job could not start: [Errno 11] Resource temporarily unavailable",
        "ansible_job_id": started["ansible_job_id"]}  # fmt: skip


def test_a_result_json_cannot_hold_is_a_failure_not_a_job_running_forever(tmp_path):
    res = job_result(jobs.start(lambda: {"ok": object()}, 30, str(tmp_path))["results_file"])
    assert res["failed"] is True and res["msg"].startswith("the job's result could not be written: Object of type")
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
