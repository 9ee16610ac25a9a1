"""Shared test setup.

Unit tests import modules from plugins/modules/ and filters from plugins/filter/ directly. Modules and
plugins import the package by the collection's name,
``ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet``; AnsiballZ provides that name on nodes,
and here Ansible's collection loader is set up as ansible-playbook sets it up, with collections/ (which holds
ansible_collections/llmfleet/fleet, a link to this checkout) on its path, so the one source tree is what that
name, and ``llmfleet`` (the CLI's), load.
"""

import sys
from pathlib import Path

from ansible.plugins.loader import init_plugin_loader

ROOT = Path(__file__).resolve().parent.parent
for sub in ("plugins/modules", "plugins/filter"):
    path = str(ROOT / sub)
    if path not in sys.path:
        sys.path.insert(0, path)
# Once per process, before anything imports ansible_collections: a later set-up would find the name taken.
init_plugin_loader([str(ROOT / "collections")])

pytest_plugins = ["tests.unit.module_utils"]


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/unit/golden/ from the code")
