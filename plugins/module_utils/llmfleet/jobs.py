"""A module's long work as a detached job that llmfleet_job_wait waits for, as Ansible's async does, started in the
module's own run: one round trip per node instead of async's six (home lookup, temp dir, two sftp copies of the
module and async_wrapper, chmod, then the run), about 1.1 s and 2 CPU-s per start on four lab nodes.

The job's file follows async_wrapper's protocol, which llmfleet_job_wait (and async_status) read: the JSON
{"started": true, "finished": false, "ansible_job_id": ...} while it runs, replaced atomically by the work's result.
Stdlib only. The detached process must not import from the module's AnsiballZ payload: Ansible deletes it when the
module returns, so the work's code is imported before the fork.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any


def job_dir() -> str:
    """Where async_wrapper keeps job files for this user (the default of the shell option async_dir)."""
    return os.path.expanduser(os.environ.get("ANSIBLE_ASYNC_DIR", "~/.ansible_async"))


def _write(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # the job and its limit thread may both write
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def set_name(name: str) -> None:
    """The process name `ps`, `top` and `pkill NAME` show (15 bytes; Linux): a detached module run's command line
    is only the node's python3 (Ansible pipes the module in), so this is what names it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: nameless, nothing else changes
        pass


def new_jid() -> str:
    """A job id, unique on this host (random, with the starting process's pid)."""
    return f"j{secrets.randbelow(10**12):012d}.{os.getpid()}"


def progress_file(results_file: str) -> str:
    """Where a job keeps its progress file, beside its job file in the private job directory:
    llmfleet_job_wait removes both when the job has ended."""
    return results_file + ".progress"


def start(
    work: Callable[[], dict[str, Any]],
    limit_s: float,
    directory: str | None = None,
    name: str = "llmfleet-job",
    jid: str | None = None,
) -> dict[str, Any]:
    """Run work() detached (a session of its own, stdio on /dev/null, process name `name`) and return at once what
    an async task registers: ansible_job_id, results_file, started, finished. The job file says running (with the
    job's pid) until it gets work()'s result, or a failure naming the exception, or - past limit_s - a failure
    saying so (the job's process group is killed then). `jid` (new_jid()) when work() needs to know its file's
    path, e.g. for progress_file()."""
    directory = directory or job_dir()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    jid = jid or new_jid()
    path = os.path.join(directory, jid)
    _write(path, {"started": True, "finished": False, "ansible_job_id": jid})
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as e:  # no process left to start (a limit): the job file says so, the wait reports it
        _write(path, {"failed": True, "msg": f"the job could not start: {e}", "ansible_job_id": jid})
        return {"ansible_job_id": jid, "results_file": path, "started": True, "finished": False}
    if pid == 0:  # the child: a new session, then a grandchild that no terminal or SSH session holds
        try:
            os.setsid()
            if os.fork():
                os._exit(0)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            set_name(name)
            _write(path, {"started": True, "finished": False, "ansible_job_id": jid, "pid": os.getpid()})
            _run(work, limit_s, path, jid)
        except BaseException as e:  # never a job file that says running with nobody running it
            try:
                _write(path, {"failed": True, "msg": f"the job could not start: {e}", "ansible_job_id": jid})
            except BaseException:  # noqa: S110 (nothing left to tell it to; the wait's timeout ends the wait)
                pass
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return {"ansible_job_id": jid, "results_file": path, "started": True, "finished": False}


def _run(work: Callable[[], dict[str, Any]], limit_s: float, path: str, jid: str) -> None:
    done = threading.Event()

    def limit() -> None:
        if not done.wait(limit_s):
            _write(path, {"failed": True, "msg": f"the job ran past its limit of {limit_s:g} s and was killed",
                          "ansible_job_id": jid})  # fmt: skip
            os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=limit, daemon=True).start()
    try:
        result = work()
    except BaseException as e:
        result = {"failed": True, "msg": f"the job failed: {type(e).__name__}: {str(e)[:500]}"}
    done.set()
    try:
        _write(path, result)
    except (TypeError, ValueError) as e:  # a result JSON cannot hold: say that instead
        _write(path, {"failed": True, "msg": f"the job's result could not be written: {e}"})
