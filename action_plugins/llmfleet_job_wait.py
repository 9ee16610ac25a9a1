"""Action plugin: wait for an async llmfleet job (staging, the NCCL check's worlds, the engine gate), printing
one progress line per node every few seconds instead of `until:` retries that print FAILED - RETRYING."""

from __future__ import annotations

import base64
import json
import time

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()

# Documented by the stub module library/llmfleet_job_wait.py (ansible-doc reads modules there).
PROGRESS_FORMATS = ("none", "stage", "gate")


def argument_spec() -> dict:
    """The options (a fresh dict each call); tests compare them with the stub's DOCUMENTATION."""
    return {
        "jid": {"type": "str", "required": True},
        "what": {"type": "str", "required": True},
        "progress_path": {"type": "path"},
        "progress": {"type": "str", "default": "none", "choices": list(PROGRESS_FORMATS)},
        "timeout": {"type": "int", "default": 21600},
        "interval": {"type": "float", "default": 5},
        "poll": {"type": "float", "default": 2},
        "timeout_hint": {"type": "str", "default": ""},
    }


def _line(fmt: str, progress: dict | None, host: str) -> str | None:
    # The package's own formatters (installed on the ops host, imported when used): `llmfleet stage` prints
    # the same staging line, the gate module the same readiness line.
    if not progress:
        return None
    if fmt == "stage":
        from llmfleet.stage_progress import progress_line

        return progress_line(progress, host)
    if fmt == "gate":
        from llmfleet.gate import progress_line

        return progress_line(progress)
    return None


class ActionModule(ActionBase):
    _requires_connection = True

    def run(self, tmp=None, task_vars=None):
        super().run(tmp, task_vars)
        _, args = self.validate_argument_spec(argument_spec=argument_spec())
        if args["progress"] != "none" and not args["progress_path"]:
            raise AnsibleActionFail(f"progress={args['progress']} reads a progress file: give progress_path")
        host = task_vars.get("inventory_hostname", "?")
        async_dir = self._remote_expand_user(self.get_shell_option("async_dir", default="~/.ansible_async"))
        start = time.monotonic()
        deadline = start + args["timeout"]
        # Poll often (a finished job is seen within `poll`), speak every `interval`: a job with a progress file
        # at once, one without only once it has run a whole interval (a quick job prints nothing).
        next_line = start if args["progress_path"] else start + args["interval"]
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
            now = time.monotonic()
            line = None
            if now >= next_line and args["progress_path"]:
                got = self._execute_module(
                    module_name="ansible.legacy.slurp", module_args={"src": args["progress_path"]}, task_vars=task_vars
                )
                if not got.get("failed") and got.get("content"):
                    try:
                        last = json.loads(base64.b64decode(got["content"]))
                    except ValueError:
                        pass
            if now >= next_line:
                next_line = now + args["interval"]
                line = _line(args["progress"], last, host)
                if line:
                    display.display(line)
                else:
                    running = f"running for {now - start:.0f} s (at most {args['timeout']} s)"
                    display.display(f"{host}: {args['what']}: {running}")
            if now > deadline:
                seen = _line(args["progress"], last, host) or "none"
                hint = f" {args['timeout_hint']}" if args["timeout_hint"] else ""
                raise AnsibleActionFail(
                    f"{host}: {args['what']} still running after {args['timeout']} s (last progress: {seen}); the job "
                    f"goes on on the node (async job {args['jid']}, until its async limit).{hint}"
                )
            # Quick jobs are common (a gate against units already serving, a world of one node): poll
            # every half second for the first few seconds, then every `poll`.
            time.sleep(min(args["poll"], args["interval"], 0.5 if now - start < 5 else args["poll"]))
