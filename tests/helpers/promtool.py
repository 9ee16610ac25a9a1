"""promtool (Debian's prometheus package) for the tests that parse and run Prometheus rules and service discovery:
skipped where it is not installed, except in CI (CI=true), where a missing promtool fails the test."""

from __future__ import annotations

import os
import shutil

import pytest


def promtool_path() -> str:
    found = shutil.which("promtool")
    if found:
        return found
    if os.environ.get("CI") == "true":
        pytest.fail("promtool is missing: make install unpacks it into .venv/bin (from Debian's prometheus package)")
    pytest.skip("promtool is not here (make .venv/bin/promtool unpacks it from Debian's prometheus package); CI has it")
