"""Every task in the roles, playbooks and molecule scenarios that calls an llmfleet module calls it by its FQCN
(llmfleet.fleet.<module>: the name that works where the collection is installed) and passes only options the
module has, and every required one. (ansible-playbook --syntax-check does not look at module arguments, and
ansible-lint cannot import these modules to check them.)"""

from __future__ import annotations

import pytest
import yaml

from tests.unit.modules.util import MODULES, ROOT, real_spec

PATTERNS = ("roles/*/tasks/*.yml", "roles/*/handlers/*.yml", "roles/*/molecule/*/*.yml", "playbooks/*.yml",
            "tests/integration/playbooks/*.yml", "tests/molecule/*.yml")  # fmt: skip
TASK_FILES = sorted(p for pattern in PATTERNS for p in ROOT.glob(pattern))


def module_calls(node, where: str):
    """(module, args, where) for every task of a parsed YAML file, blocks and plays included."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from module_calls(item, f"{where}[{i}]")
    elif isinstance(node, dict):
        for key, value in node.items():
            name = key.removeprefix(FQCN)
            if name in MODULES:
                yield key, value or {}, f"{where} ({node.get('name', '?')})"
            elif isinstance(value, (list, dict)):
                yield from module_calls(value, f"{where}.{key}")


FQCN = "llmfleet.fleet."
CALLS = [c for p in TASK_FILES for c in module_calls(yaml.safe_load(p.read_text()), str(p.relative_to(ROOT)))]


def test_every_module_is_used_somewhere():
    assert sorted(set(MODULES) - {c[0].removeprefix(FQCN) for c in CALLS}) == []


def test_every_call_names_the_module_by_its_fqcn():
    short = [f"{where}: {key}" for key, _, where in CALLS if not key.startswith(FQCN)]
    assert short == [], "call these by their FQCN (llmfleet.fleet.<module>), as the installed collection needs"


@pytest.mark.parametrize(("module", "args", "where"), CALLS, ids=[c[2] for c in CALLS])
def test_task_options_exist_and_required_ones_are_given(module, args, where):
    spec, _ = real_spec(module.removeprefix(FQCN))
    unknown = sorted(set(args) - set(spec))
    missing = sorted(k for k, v in spec.items() if v.get("required") and k not in args)
    assert not unknown and not missing, f"{where}: {module} has no option {unknown}; missing required {missing}"
