"""Shared test setup.

Unit tests import modules from plugins/modules/ and filters from plugins/filter/ directly. Modules and
plugins import the package by the collection's name,
``ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet``; AnsiballZ provides that name on nodes,
and here collections/ (which holds ansible_collections/llmfleet/fleet, a link to this checkout) goes on
sys.path, so the one source tree is what that name, and ``llmfleet`` (the CLI's), load.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for sub in ("plugins/modules", "plugins/filter", "collections"):
    path = str(ROOT / sub)
    if path not in sys.path:
        sys.path.insert(0, path)

pytest_plugins = ["tests.unit.module_utils"]


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/unit/golden/ from the code")
