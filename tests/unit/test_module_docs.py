"""Every module in library/ is documented the way Ansible reads it, and its documentation says what the
code does: the real `ansible-doc` (one call for all modules) must parse DOCUMENTATION / EXAMPLES / RETURN,
and the documented options (name, type, elements, default, required, choices, suboptions) must equal the
argument_spec the module hands to AnsibleModule (for the action plugin: the spec it validates with).
Block-style YAML only, `attributes` with check_mode, RETURN entries complete, examples use the module."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.once import once
from tests.unit.modules.util import ACTION_NAMES, LIBRARY, MODULES, ROOT, real_spec

ANSIBLE_DOC = Path(sys.executable).parent / "ansible-doc"
# From ansible-test validate-modules' schema (its voluptuous dependency is not installed here).
SUPPORT = {"full", "partial", "none", "N/A"}
OPTION_KEYS = {"description", "type", "elements", "default", "required", "choices", "aliases", "suboptions",
               "version_added", "version_added_collection", "deprecated"}  # fmt: skip
RETURN_KEYS = {"description", "returned", "type", "elements", "sample", "example", "choices", "contains",
               "version_added", "version_added_collection"}  # fmt: skip
RETURN_TYPES = {"bool", "complex", "dict", "float", "int", "list", "raw", "str"}


def _ansible_doc(names: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    return subprocess.run(
        [str(ANSIBLE_DOC), "-M", str(LIBRARY), "-t", "module", "--json", *names],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _read_docs(_dir) -> dict:
    cp = _ansible_doc(MODULES)
    if cp.returncode != 0:
        bad = {n: r.stderr.strip() for n in MODULES if (r := _ansible_doc([n])).returncode != 0}
        pytest.fail("ansible-doc cannot read: " + ("; ".join(f"{n}: {e}" for n, e in bad.items()) or cp.stderr))
    return json.loads(cp.stdout)


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> dict:
    """ansible-doc's JSON of every module, from one run of the CLI per test run, whichever worker asks first
    (a second run per module only to name the one it could not read: ansible-doc stops at the first)."""
    return once(tmp_path_factory, "ansible-doc", _read_docs)[1]


def option_mismatches(documented: dict, spec: dict, where: str = "") -> list[str]:
    """Every difference between documented options and an argument_spec, one line each."""
    out = []
    for opt in sorted(set(documented) - set(spec)):
        out.append(f"option {where}{opt} is documented but not in the argument_spec")
    for opt in sorted(set(spec) - set(documented)):
        out.append(f"option {where}{opt} is in the argument_spec but not documented")
    for opt in sorted(set(spec) & set(documented)):
        d, s, name = documented[opt], spec[opt], f"{where}{opt}"
        extra = set(d) - OPTION_KEYS
        if extra:
            out.append(f"option {name}: {sorted(extra)} are not option documentation keys")
        if "type" not in d:
            out.append(f"option {name}: no type documented (the spec says {s.get('type', 'str')})")
        checks = {
            "type": (d.get("type", "str"), s.get("type", "str")),
            "elements": (d.get("elements"), s.get("elements")),
            "default": (d.get("default"), s.get("default")),
            "required": (bool(d.get("required", False)), bool(s.get("required", False))),
            "choices": (d.get("choices"), s.get("choices")),
            "aliases": (d.get("aliases"), s.get("aliases")),
        }
        for key, (doc_v, spec_v) in checks.items():
            if doc_v != spec_v:
                out.append(f"option {name}: {key} is {doc_v!r} in DOCUMENTATION but {spec_v!r} in the argument_spec")
        if s.get("required") and "default" in d:
            out.append(f"option {name}: required and documented with a default")
        if s.get("no_log") and "no_log" not in str(d.get("description", "")):
            out.append(f"option {name}: no_log in the argument_spec; say so in its description (no_log - never logged)")
        if "suboptions" in d or "options" in s:
            out += option_mismatches(d.get("suboptions", {}), s.get("options") or {}, f"{name}.")
    return out


def flow_mappings(text: str, section: str) -> list[str]:
    """Option, attribute and return-value entries written as flow mappings (`name: {description: ...}`)
    where Ansible's documentation style wants block mappings (values such as `default: {}` may be flow)."""
    root = yaml.compose(text)
    out = []

    def entries(node, path, nested):
        for k, v in node.value if isinstance(node, yaml.MappingNode) else []:
            if isinstance(v, yaml.MappingNode):
                if v.flow_style:
                    out.append(f"{section}: {'.'.join([*path, k.value])} is a flow mapping")
                for k2, v2 in v.value:
                    if k2.value == nested:
                        entries(v2, [*path, k.value, nested], nested)

    if section == "DOCUMENTATION":
        for k, v in root.value:
            if k.value in ("options", "attributes"):
                entries(v, [k.value], "suboptions")
    else:
        entries(root, [], "contains")
    return out


def test_every_module_is_named_llmfleet_and_every_action_has_a_doc_stub():
    assert [n for n in MODULES if not n.startswith("llmfleet_")] == []
    assert [a for a in ACTION_NAMES if a not in MODULES] == [], (
        "an action plugin needs library/<name>.py documenting it"
    )


def test_ansible_doc_reads_every_module(docs):
    assert sorted(docs) == MODULES


@pytest.mark.parametrize("name", MODULES)
def test_documented_options_match_the_argument_spec(docs, name):
    spec, _ = real_spec(name)
    problems = option_mismatches(docs[name]["doc"].get("options") or {}, spec)
    assert not problems, f"{name}: " + "; ".join(problems)


@pytest.mark.parametrize("name", MODULES)
def test_doc_header_and_attributes(docs, name):
    doc = docs[name]["doc"]
    _, kwargs = real_spec(name)
    problems = []
    if doc.get("module") != name:
        problems.append(f"DOCUMENTATION says module: {doc.get('module')}")
    for key in ("short_description", "description", "author"):
        if not doc.get(key):
            problems.append(f"no {key}")
    attrs = doc.get("attributes") or {}
    for attr, entry in attrs.items():
        if not entry.get("description") or entry.get("support") not in SUPPORT:
            problems.append(f"attribute {attr} needs a description and support in {sorted(SUPPORT)}: {entry}")
        if entry.get("support") == "partial" and not entry.get("details"):
            problems.append(f"attribute {attr}: partial support without details saying what is partial")
    check = attrs.get("check_mode", {}).get("support")
    if check is None:
        problems.append("no attributes.check_mode")
    elif (check != "none") != bool(kwargs.get("supports_check_mode")):
        problems.append(f"check_mode support is {check} but supports_check_mode={kwargs.get('supports_check_mode')}")
    assert not problems, f"{name}: " + "; ".join(problems)


def return_problems(ret: dict, where: str = "") -> list[str]:
    out = []
    for key, v in ret.items():
        name = f"RETURN {where}{key}"
        if not {"description", "returned", "type"} <= set(v):
            out.append(f"{name} lacks {sorted({'description', 'returned', 'type'} - set(v))}")
        if set(v) - RETURN_KEYS:
            out.append(f"{name}: {sorted(set(v) - RETURN_KEYS)} are not return documentation keys")
        if v.get("type") not in RETURN_TYPES:
            out.append(f"{name}: type {v.get('type')!r} is not one of {sorted(RETURN_TYPES)}")
        if v.get("type") == "complex" and not v.get("contains"):
            out.append(f"{name}: type complex needs contains")
        out += return_problems(v.get("contains") or {}, f"{where}{key}.")
    return out


@pytest.mark.parametrize("name", MODULES)
def test_return_values_are_complete(docs, name):
    ret = docs[name]["return"] or {}
    problems = return_problems(ret)
    if "ansible_facts" in ret and "facts" not in docs[name]["doc"].get("attributes", {}):
        problems.append("returns ansible_facts but documents no facts attribute")
    if name.endswith("_facts") and "ansible_facts" not in ret:
        problems.append("a *_facts module must return ansible_facts (name it *_info otherwise)")
    assert not problems, f"{name}: " + "; ".join(problems)


@pytest.mark.parametrize("name", MODULES)
def test_block_style_yaml_and_examples_use_the_module(name):
    module = importlib.import_module(name)
    problems = flow_mappings(module.DOCUMENTATION, "DOCUMENTATION") + flow_mappings(module.RETURN, "RETURN")
    tasks = yaml.safe_load(module.EXAMPLES)
    if not any(f"llmfleet.fleet.{name}" in t for t in tasks):
        problems.append(f"no example task uses llmfleet.fleet.{name} (examples name the module by its FQCN)")
    assert not problems, f"{name}: " + "; ".join(problems)
