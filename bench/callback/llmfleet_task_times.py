"""Callback plugin for bench/site_bench.py: each task's wall time (from its start to the next task's start:
the linear strategy runs one task at a time across all hosts), with its play, role and action, written as
JSON lines to the file named by LLMFLEET_TASK_TIMES. Loaded only by that benchmark, never by operators' runs."""

from __future__ import annotations

import json
import os
import time

from ansible.plugins.callback import CallbackBase


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "llmfleet_task_times"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self.path = os.environ.get("LLMFLEET_TASK_TIMES", "")
        self.play = ""
        self.cur: dict | None = None
        self.rows: list[dict] = []
        self.t0 = time.monotonic()

    def _close(self) -> None:
        if self.cur is not None:
            self.cur["seconds"] = round(time.monotonic() - self.cur.pop("t"), 3)
            self.rows.append(self.cur)
            self.cur = None

    def v2_playbook_on_play_start(self, play) -> None:
        self._close()
        self.play = play.get_name()

    def v2_playbook_on_task_start(self, task, is_conditional) -> None:
        self._close()
        role = task._role.get_name(include_role_fqcn=False) if task._role else ""  # no public API for a task's role
        self.cur = {"play": self.play, "role": role, "action": task.action, "task": task.get_name(),
                    "t": time.monotonic()}  # fmt: skip

    def v2_playbook_on_handler_task_start(self, task) -> None:
        self.v2_playbook_on_task_start(task, False)

    def v2_playbook_on_stats(self, stats) -> None:
        self._close()
        if self.path:
            with open(self.path, "w", encoding="utf-8") as f:
                f.write(json.dumps({"total_in_plays": round(time.monotonic() - self.t0, 3)}) + "\n")
                for r in self.rows:
                    f.write(json.dumps(r) + "\n")
