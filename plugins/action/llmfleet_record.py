"""Action plugin: write one JSON record of this run into the report directory on the ops host, in the controller's
own process. The `file` + `copy` pair it replaces ran three modules (file, stat, copy) as Python start-ups on the
ops host for every record, in every role, on every run."""

from __future__ import annotations

import datetime
import os
import re
import tempfile

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.plugins.filter.core import to_nice_json

# Documented by the stub module library/llmfleet_record.py (ansible-doc reads modules there).

# The run's id (playbooks/run_start.yml makes it once per run: UTC start stamp and a random suffix).
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")


def argument_spec() -> dict:
    """The options (a fresh dict each call); tests compare them with the stub's DOCUMENTATION."""
    return {
        "dir": {"type": "path", "required": True},
        "name": {"type": "str", "required": True},
        "content": {"type": "raw", "required": True},
        "stamp": {"type": "bool", "default": False},
        "mode": {"type": "raw", "default": "0644"},
    }


def render(content, stamp: bool, now: datetime.datetime | None = None, run_id: str | None = None) -> str:
    """The file's text: JSON as to_nice_json writes it (sorted keys, indent 4) plus a newline; with stamp, the
    record carries `generated_at` (UTC, seconds) - the one place that formats it. A mapping written during a
    run carries that run's `run_id` (the report reads only the newest run's records)."""
    if stamp:
        if not isinstance(content, dict):
            raise AnsibleActionFail("stamp=true adds generated_at to a record: give content as a mapping")
        when = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
        content = {**content, "generated_at": when}
    if run_id and isinstance(content, dict):
        content = {**content, "run_id": run_id}
    return to_nice_json(content) + "\n"


def run_id_of(task_vars: dict | None) -> str | None:
    """This run's id (llmfleet_run_id, set once at the start of the play), None outside a run."""
    rid = (task_vars or {}).get("llmfleet_run_id")
    if rid in (None, ""):
        return None
    if not isinstance(rid, str) or not RUN_ID_RE.match(rid):
        raise AnsibleActionFail(f"llmfleet_run_id {rid!r}: not a run id (playbooks/run_start.yml makes it; do not set "
                                "it in the inventory or with -e)")  # fmt: skip
    return rid


def write(directory: str, name: str, text: str, mode: int, check: bool) -> bool:
    """Create the directory (0755, like `file: state=directory`) and swap the file in atomically when its text
    differs. True when it changed (or, in check mode, would)."""
    path = os.path.join(directory, name)
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text and (os.stat(path).st_mode & 0o7777) == mode:
                return False
    except (FileNotFoundError, NotADirectoryError):
        pass
    if check:
        return True
    os.makedirs(directory, mode=0o755, exist_ok=True)
    # A private temporary name in the same directory (mkstemp: O_EXCL, 0600), then chmod and rename: a reader
    # never sees half a record, and no predictable name can be planted first.
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return True


class ActionModule(ActionBase):
    _requires_connection = False
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        _, args = self.validate_argument_spec(argument_spec=argument_spec())
        name = args["name"]
        if not name or "/" in name or name in (".", ".."):
            raise AnsibleActionFail(f"name {name!r}: give a file name without a directory (dir holds the directory)")
        try:
            mode = int(str(args["mode"]), 8)
        except ValueError:
            raise AnsibleActionFail(f"mode {args['mode']!r}: give an octal file mode such as '0644'") from None
        text = render(args["content"], args["stamp"], run_id=run_id_of(task_vars))
        path = os.path.join(args["dir"], name)
        try:
            changed = write(args["dir"], name, text, mode, bool(self._task.check_mode))
        except OSError as e:
            raise AnsibleActionFail(f"cannot write {path} on the ops host: {e.strerror or e}") from None
        result.update(changed=changed, path=path)
        return result
