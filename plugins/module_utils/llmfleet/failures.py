"""A failed task's message, in one line of reasonable length (the run record's `stopped.message`, the rollout
record's `error`).

A failed loop says only "One or more items failed"; what went wrong is in its first failed item (the readiness
gate loops over its node groups): that item's message is the task's.
"""

from __future__ import annotations

from typing import Any

LOOP_MSG = "One or more items failed"
MSG_CHARS = 600


def failed_message(result: Any, limit: int = MSG_CHARS) -> str:
    """msg, else stderr's last line, else reason, else the return code; a failed loop's first failed item's. A
    no_log task's result comes censored (no msg): the message says why there is none."""
    if not isinstance(result, dict):
        return "failed"
    if result.get("_ansible_no_log"):
        return "the task's output is hidden (no_log)"
    items = [r for r in result.get("results") or [] if isinstance(r, dict) and r.get("failed")]
    if items and result.get("msg") in (None, "", LOOP_MSG):
        return failed_message(items[0], limit)
    for key in ("msg", "stderr", "reason"):
        text = result.get(key)
        if isinstance(text, str) and text.strip():
            text = text.strip() if key != "stderr" else text.strip().splitlines()[-1]
            return text if len(text) <= limit else text[: limit - 3] + "..."
    return f"exit {result['rc']}" if "rc" in result else "failed"
