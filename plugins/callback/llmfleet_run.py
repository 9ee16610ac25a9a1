"""Callback: where a run stopped, kept in its run record, for the deployment report.

A playbook of playbooks/ that starts a run writes <report dir>/run-<deployment>.json first (run_start.yml,
through the llmfleet_record action). This callback notes that write, remembers each failure that was not
ignored (role, task, node, message), and when the playbook ends adds to the record how it ended: `outcome`
`completed` or `failed`, and `stopped` - the first failure on a node the play counted as failed (a failure
a `rescue` handled is not a stop). The report then says "not run in this run (it stopped at <step> on <node>)"
for every step after it. It does nothing in a playbook that wrote no run record.

In the checkout it loads without configuration (CALLBACK_NEEDS_ENABLED false): playbooks/callback_plugins/ links
here, and Ansible loads the plugins next to a playbook it runs by path. Ansible loads a collection's callback only when
enabled, so runs of the installed collection (ansible-playbook llmfleet.fleet.site) name it: callbacks_enabled =
llmfleet.fleet.llmfleet_run in ansible.cfg, or ANSIBLE_CALLBACKS_ENABLED (docs/install.md).
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: llmfleet_run
type: aggregate
short_description: Keep where a run stopped in its run record (run-<deployment>.json)
description:
  - After a playbook that wrote a run record, adds how the run ended (outcome, the first failed task's role,
    node, task and message) to that record, for the deployment report.
  - Runs of the installed collection enable it (C(callbacks_enabled = llmfleet.fleet.llmfleet_run));
    in the llmfleet checkout it loads from playbooks/callback_plugins/ without configuration.
"""

# Imports below DOCUMENTATION, as Ansible's plugin documentation convention wants (ansible-test validate-modules).
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402

from ansible.plugins.callback import CallbackBase  # noqa: E402

MSG_CHARS = 600


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _message(result: dict) -> str:
    """A failed task's message (a failed loop's: its first failed item's), at most MSG_CHARS long."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.failures import failed_message

    return failed_message(result, MSG_CHARS)


def update_record(path: str, ending: dict) -> None:
    """Add `ending` to the JSON record at path: a private temporary file in its directory, then rename (a
    reader never sees half a record). A record that is gone or not a JSON object is left alone."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        mode = os.stat(path).st_mode & 0o7777
    except (OSError, ValueError):
        return
    if not isinstance(data, dict):
        return
    data.update(ending)
    fd, tmp = tempfile.mkstemp(prefix=".run.", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=4, sort_keys=True) + "\n")
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "llmfleet_run"
    CALLBACK_NEEDS_ENABLED = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.record: str | None = None
        self.failures: list[dict] = []

    def v2_runner_on_ok(self, result):
        task = result._task
        path = result._result.get("path")
        if (
            getattr(task, "action", "").rsplit(".", 1)[-1] == "llmfleet_record"
            and isinstance(path, str)
            and os.path.basename(path).startswith("run-")
        ):
            self.record = path

    def _failed(self, result, why: str = "") -> None:
        if self.record is None:
            return
        task = result._task
        role_obj = getattr(task, "_role", None)
        role = role_obj.get_name() if role_obj else ""
        # A dependency's task (the fleet contract, roles/llmfleet) stops the step of the role that pulled it in.
        parents = getattr(role_obj, "_parents", None) or []
        within = parents[0].get_name() if parents else ""
        self.failures.append({
            "node": result._host.get_name(),
            "role": role,
            "within": within,
            "task": task.get_name(),
            "message": why or _message(result._result),
            "at": _now(),
        })  # fmt: skip

    def v2_runner_on_failed(self, result, ignore_errors=False):
        if not ignore_errors:
            self._failed(result)

    def v2_runner_on_unreachable(self, result):
        self._failed(result, "unreachable: " + _message(result._result))

    def v2_playbook_on_stats(self, stats):
        if self.record is None:
            return
        bad = {h for h in stats.processed if stats.failures.get(h) or stats.dark.get(h)}
        stopped = next((f for f in self.failures if f["node"] in bad), None)
        ending: dict = {"finished_at": _now(), "outcome": "failed" if bad else "completed", "stopped": stopped}
        try:
            update_record(self.record, ending)
        except OSError as e:
            self._display.warning(f"llmfleet_run: cannot add the run's end to {self.record}: {e}")
