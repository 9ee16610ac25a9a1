"""Action plugin: wait for an async llmfleet_model_stage job, printing each node's progress as it runs
(bytes done / total, rate, source vs peer bytes) instead of one line at the end."""

from __future__ import annotations

import base64
import json
import time

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()

# Documented by the stub module library/llmfleet_model_stage_wait.py (ansible-doc reads modules there).


def argument_spec() -> dict:
    """The options (a fresh dict each call); tests compare them with the stub's DOCUMENTATION."""
    return {
        "jid": {"type": "str", "required": True},
        "progress_path": {"type": "path", "required": True},
        "timeout": {"type": "int", "default": 21600},
        "interval": {"type": "float", "default": 5},
    }


class ActionModule(ActionBase):
    _requires_connection = True

    def run(self, tmp=None, task_vars=None):
        # The package as the filter plugins load it (installed on the ops host, imported when used): the
        # progress line is formatted by the package's one function, which `llmfleet stage` uses too.
        from llmfleet.stage_progress import progress_line

        super().run(tmp, task_vars)
        _, args = self.validate_argument_spec(argument_spec=argument_spec())
        host = task_vars.get("inventory_hostname", "?")
        async_dir = self._remote_expand_user(self.get_shell_option("async_dir", default="~/.ansible_async"))
        deadline = time.monotonic() + args["timeout"]
        last = None
        while True:
            st = self._execute_module(
                module_name="ansible.legacy.async_status",
                module_args={"jid": args["jid"], "mode": "status", "_async_dir": async_dir},
                task_vars=task_vars,
            )
            if st.get("finished"):
                self._execute_module(
                    module_name="ansible.legacy.async_status",
                    module_args={"jid": args["jid"], "mode": "cleanup", "_async_dir": async_dir},
                    task_vars=task_vars,
                )
                for k in ("ansible_job_id", "results_file", "started", "finished", "erased"):
                    st.pop(k, None)
                return st
            got = self._execute_module(
                module_name="ansible.legacy.slurp", module_args={"src": args["progress_path"]}, task_vars=task_vars
            )
            if not got.get("failed") and got.get("content"):
                try:
                    last = json.loads(base64.b64decode(got["content"]))
                    display.display(progress_line(last, host))
                except ValueError:
                    pass
            if time.monotonic() > deadline:
                # The job goes on (until its async limit) and holds the model's staging lock: a rerun
                # waits for it (model_stage_lock_wait) or fails naming it, and resumes once it is gone.
                raise AnsibleActionFail(
                    f"{host}: staging still running after {args['timeout']} s (last progress: "
                    f"{progress_line(last, host) if last else 'none'}); the job goes on on the node (async job "
                    f"{args['jid']}, until its async limit) and keeps its verified files. A rerun while it runs "
                    "waits for it up to model_stage_lock_wait seconds or fails naming it; once it has ended, a "
                    "rerun resumes from its verified files"
                )
            time.sleep(args["interval"])
