"""The test suites' Ansible runs load tests/ansible_plugins/callback/llmfleet_ansiballz_cache.py (its docstring
says what it keeps and why). Operators' runs, `make demo` and the benchmarks never do."""

from __future__ import annotations

import os
from pathlib import Path

CALLBACK_DIR = str(Path(__file__).resolve().parents[1] / "ansible_plugins" / "callback")
CALLBACK = "llmfleet_ansiballz_cache"


def enable(env=os.environ) -> None:
    """Add the callback to an environment's ANSIBLE_CALLBACK_PLUGINS and ANSIBLE_CALLBACKS_ENABLED (kept if set)."""
    dirs = [d for d in env.get("ANSIBLE_CALLBACK_PLUGINS", "").split(os.pathsep) if d]
    enabled = [c.strip() for c in env.get("ANSIBLE_CALLBACKS_ENABLED", "").split(",") if c.strip()]
    if CALLBACK_DIR not in dirs:
        env["ANSIBLE_CALLBACK_PLUGINS"] = os.pathsep.join([*dirs, CALLBACK_DIR])
    if CALLBACK not in enabled:
        env["ANSIBLE_CALLBACKS_ENABLED"] = ",".join([*enabled, CALLBACK])
