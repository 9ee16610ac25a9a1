"""Run an expensive, read-only piece of test setup once per test run, whichever xdist worker needs it first.

A module- or session-scoped fixture runs once per worker, and the tests that read it may land on either
worker: `once` keeps the result in the run's temporary root, which the workers share, under a lock, so a
worker that needs it while another one is making it waits for that one instead of making it again.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Any]) -> tuple[Path, Any]:
    """(directory, make(directory)) for this run: make is called once, with an empty directory of its own,
    and what it returns (JSON) is what every later call gets. If make fails, the next call tries again."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if base.name.startswith("popen-gw") else base  # xdist: <run>/popen-gwN, <run> is shared
    directory, done = root / f"once-{name}", root / f"once-{name}.json"
    with (root / f"once-{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)  # what a failed attempt left
            directory.mkdir()
            done.write_text(json.dumps(make(directory)))
        return directory, json.loads(done.read_text())
