"""Shared test setup.

Unit tests import modules from library/ and filters from filter_plugins/ directly. Modules import
the package as ``ansible.module_utils.llmfleet``; AnsiballZ provides that name on nodes, and here
we extend ``ansible.module_utils.__path__`` with the project's module_utils/ the same way, so the
one source tree is what both names load.
"""

import sys
from pathlib import Path

import ansible.module_utils

ROOT = Path(__file__).resolve().parent.parent
for sub in ("library", "filter_plugins"):
    path = str(ROOT / sub)
    if path not in sys.path:
        sys.path.insert(0, path)
if str(ROOT / "module_utils") not in ansible.module_utils.__path__:
    ansible.module_utils.__path__.append(str(ROOT / "module_utils"))

pytest_plugins = ["tests.unit.module_utils"]


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/unit/golden/ from the code")
