"""Action plugin: wait for an async llmfleet job (staging, the NCCL check's worlds, the engine gate), printing
one progress line per node every few seconds instead of `until:` retries that print FAILED - RETRYING."""

from __future__ import annotations

import json
import shlex
import time

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display
from ansible.vars.clean import remove_internal_keys

display = Display()

# Documented by the stub module library/llmfleet_job_wait.py (ansible-doc reads modules there).
PROGRESS_FORMATS = ("none", "stage", "gate")
# async_wrapper's job file while the job runs: {"started": true, "finished": false, ...} (1/0 before ansible-core 2.17)
RUNNING = '"finished": (false|0)[,}]'


def argument_spec() -> dict:
    """The options (a fresh dict each call); tests compare them with the stub's DOCUMENTATION."""
    return {
        "jid": {"type": "str", "required": True},
        "results_file": {"type": "str"},
        "what": {"type": "str", "required": True},
        "progress_path": {"type": "path"},
        "progress": {"type": "str", "default": "none", "choices": list(PROGRESS_FORMATS)},
        "timeout": {"type": "int", "default": 21600},
        "interval": {"type": "float", "default": 5},
        "poll": {"type": "float", "default": 0.25},
        "timeout_hint": {"type": "str", "default": ""},
    }


def _line(fmt: str, progress: dict | None, host: str) -> str | None:
    # The package's own formatters (installed on the ops host, imported when used): `llmfleet stage` prints
    # the same staging line, the gate module the same readiness line.
    if not progress:
        return None
    if fmt == "stage":
        from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.progress import progress_line

        return progress_line(progress, host)
    if fmt == "gate":
        from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.gate import progress_line

        return progress_line(progress)
    return None


def _check(args: dict) -> None:
    """What the argument spec cannot say, refused before any node call."""
    if args["poll"] <= 0 or args["interval"] <= 0:
        raise AnsibleActionFail(f"poll={args['poll']} and interval={args['interval']} must be > 0 (seconds)")
    if args["progress"] != "none" and not args["progress_path"]:
        raise AnsibleActionFail(f"progress={args['progress']} reads a progress file: give progress_path")


class ActionModule(ActionBase):
    _requires_connection = True

    def run(self, tmp=None, task_vars=None):
        super().run(tmp, task_vars)
        _, args = self.validate_argument_spec(argument_spec=argument_spec())
        _check(args)
        host = task_vars.get("inventory_hostname", "?")
        async_dir = self._remote_expand_user(self.get_shell_option("async_dir", default="~/.ansible_async"))
        start = time.monotonic()
        deadline = start + args["timeout"]
        # Wait on the node (it looks at the job file every `poll` seconds: a finished job is seen within that), speak
        # every `interval`: one SSH round trip per progress line, not one per look. A job with a progress file
        # speaks as soon as that file exists (read every half second until then), a job without one only once it
        # has run a whole interval (a quick job prints nothing). A job that ends before its progress was ever shown
        # gets its last progress line: the person always sees where each node ended, however quick the job.
        next_line = start + args["interval"]
        last, shown, wait = None, False, 0.0
        # A job a module detached itself says where its file is (llmfleet.jobs); an async task's is in async_dir.
        job_file = args["results_file"] or f"{async_dir.rstrip('/')}/{args['jid']}"
        while True:
            # A shell loop and `cat` of the job's status file, not an async_status module run: a module costs a Python
            # start-up and ansible's imports on the node (or on the ops host for a delegated gate), 0.3-0.5 s of CPU
            # per look on 2 cores, taken from the very start it waits for. The result comes from the same file.
            t0 = time.monotonic()
            text = self._wait_read(job_file, wait, args["poll"])
            if self._still_running(text):
                st = {"finished": False}
            else:
                # The job's result as the file holds it; async_status (a module run) only for what it must explain:
                # no file, or one that is not a result.
                st = self._result(text, args["jid"]) or self._execute_module(
                    module_name="ansible.legacy.async_status",
                    module_args={"jid": args["jid"], "mode": "status", "_async_dir": async_dir},
                    task_vars=task_vars,
                )
            if st.get("finished"):
                if args["progress_path"] and not shown:
                    line = _line(args["progress"], self._progress(args["progress_path"], last), host)
                    if line:
                        display.display(line)
                return self._cleaned_up(st, job_file)
            now = time.monotonic()
            if args["progress_path"] and (now >= next_line or not shown):
                last = self._progress(args["progress_path"], last)
            line = _line(args["progress"], last, host)
            if line and (now >= next_line or not shown):
                display.display(line)
                shown, next_line = True, now + args["interval"]
            elif now >= next_line:
                running = f"running for {now - start:.0f} s (at most {args['timeout']} s)"
                display.display(f"{host}: {args['what']}: {running}")
                next_line = now + args["interval"]
            if now > deadline:
                seen = _line(args["progress"], last, host) or "none"
                hint = f" {args['timeout_hint']}" if args["timeout_hint"] else ""
                raise AnsibleActionFail(
                    f"{host}: {args['what']} still running after {args['timeout']} s (last progress: {seen}); the job "
                    f"goes on on the node (async job {args['jid']}, until its async limit).{hint}"
                )
            if wait > 0 and now - t0 < wait / 2:
                time.sleep(args["poll"])  # the node's wait ended early (the job file not written yet): no tight loop
            # The next wait on the node: until the next line is due (a progress file not there yet: half a second)
            # or the deadline, at least one look.
            wait = max(args["poll"], min(next_line, deadline + 1) - now)
            wait = min(wait, 0.5) if args["progress_path"] and not shown else wait

    def _result(self, text: str | None, jid: str) -> dict | None:
        """A finished job's result from its file as async_status and the module runner would make it (parsed with
        the legacy profile async_status's output is parsed with, internal keys dropped), or None: the file is
        missing or holds no result. Saves the two module runs (status, cleanup) a finished job cost on each node:
        0.2 CPU-s each, and a third of a second of every wait."""
        try:
            data = json.loads(text) if text else None
        except ValueError:
            return None
        if not isinstance(data, dict) or "started" in data:
            return None
        data = self._parse_returned_data({"rc": 0, "stdout": text, "stderr": ""}, "legacy")
        if not data.get("_ansible_parsed"):
            return None
        data.pop("_ansible_suppress_tmpdir_delete", None)
        remove_internal_keys(data)
        for k in ("stdout", "stderr"):  # as the module runner splits them (async_wrapper keeps a module's stderr)
            if k in data and f"{k}_lines" not in data:
                data[f"{k}_lines"] = (data[k] or "").splitlines()
        return {**data, "finished": True, "ansible_job_id": jid}

    def _cleaned_up(self, st: dict, job_file: str) -> dict:
        """The job's own result, its async status file removed (`rm`, as the task's become user, as async_status's
        cleanup would), with the progress file a detached job may keep beside it (llmfleet.jobs.progress_file)."""
        from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.jobs import (
            progress_file,  # the package on the ops host, as for the progress lines
        )

        files = f"{shlex.quote(job_file)} {shlex.quote(progress_file(job_file))}"
        self._low_level_execute_command(f"rm -f -- {files}", sudoable=True)
        for k in ("ansible_job_id", "results_file", "started", "finished", "erased", "_ansible_parsed"):
            st.pop(k, None)
        return st

    def _wait_read(self, path: str, seconds: float, every: float) -> str | None:
        """The job file once it no longer says running, or after `seconds` (at once when 0): the looking is a
        shell loop on the node, as the task's become user. None when the file cannot be read."""
        q = shlex.quote(path)
        looks = int(seconds / every) if seconds > 0 else 0
        if looks <= 0:
            return self._read(path)
        cmd = (
            f"i=0; while [ $i -lt {looks} ] && grep -qE {shlex.quote(RUNNING)} {q} 2>/dev/null; "
            f"do sleep {every:g}; i=$((i+1)); done; cat -- {q}"
        )
        res = self._low_level_execute_command(cmd, sudoable=True)
        return res.get("stdout") if res.get("rc") == 0 else None

    def _read(self, path: str) -> str | None:
        """A small text file on the target (as the task's become user), or None when it cannot be read."""
        res = self._low_level_execute_command(f"cat -- {shlex.quote(path)}", sudoable=True)
        return res.get("stdout") if res.get("rc") == 0 else None

    def _progress(self, path: str, last: dict | None) -> dict | None:
        """The job's progress file, or what was read before when it is missing or half-written."""
        try:
            return json.loads(self._read(path) or "") or last
        except ValueError:
            return last

    @staticmethod
    def _still_running(text: str | None) -> bool:
        """async_status's own rule on the job file: absent = ask the module (it fails naming the job); empty or
        not yet JSON = running; JSON without 'started' = the module's result; started and not finished = running."""
        if text is None:
            return False
        try:
            data = json.loads(text)
        except ValueError:
            return True
        if not isinstance(data, dict) or "started" not in data:
            return False
        return not data.get("finished")
