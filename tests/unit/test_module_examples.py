"""Every module's EXAMPLES block is a play Ansible accepts and says what the roles do: `ansible-playbook
--syntax-check` reads all of them (each block wrapped in a play, the modules resolved from library/); each
example task's arguments are options of the module's argument_spec (suboptions too) with the required ones
given; and where every role task of a module passes an option the same fixed value (`detach: true`), the
examples do too - an example with `async:`/`poll: 0` on a module the roles run with `detach: true` fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.unit.modules.util import MODULES, ROOT, real_spec

ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
TASK_KEYWORDS = {"async", "poll"}


def examples(name: str) -> list[dict]:
    """The example tasks of a module, from its EXAMPLES block as Ansible reads it (plain text, then YAML)."""
    from ansible.parsing.plugin_docs import read_docstring

    return yaml.safe_load(read_docstring(str(ROOT / "library" / f"{name}.py"))["plainexamples"])


def tasks_in(items) -> list[dict]:
    """Tasks of a task list, the tasks of its blocks (block/rescue/always) included."""
    out = []
    for t in items or []:
        if not isinstance(t, dict):
            continue
        if "block" in t:
            for key in ("block", "rescue", "always"):
                out += tasks_in(t.get(key))
        else:
            out.append(t)
    return out


def key_of(task: dict) -> str | None:
    """The task's key that names one of our modules (its FQCN in roles and examples)."""
    return next((k for k in task if k.removeprefix("llmfleet.fleet.") in MODULES), None)


def module_of(task: dict) -> str | None:
    key = key_of(task)
    return None if key is None else key.removeprefix("llmfleet.fleet.")


def role_tasks() -> dict[str, list[dict]]:
    """The role tasks that run each module, from roles/*/tasks/*.yml."""
    found: dict[str, list[dict]] = {}
    for path in sorted(ROOT.glob("roles/*/tasks/*.yml")):
        for task in tasks_in(yaml.safe_load(path.read_text())):
            if (name := module_of(task)) is not None:
                found.setdefault(name, []).append(task)
    return found


ROLE_TASKS = role_tasks()


def argument_problems(args: dict, spec: dict, where: str) -> list[str]:
    out = [f"{where}{k} is not an option" for k in sorted(set(args) - set(spec))]
    for opt, s in spec.items():
        if s.get("required") and opt not in args:
            out.append(f"{where}{opt} is required but not given")
        sub, value = s.get("options"), args.get(opt)
        if sub and isinstance(value, dict):
            out += argument_problems(value, sub, f"{where}{opt}.")
        elif sub and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    out += argument_problems(item, sub, f"{where}{opt}[{i}].")
    return out


def fixed_role_values(name: str) -> dict:
    """Options every role task of a module passes with one and the same literal (not templated) value; a task
    that always runs in check mode (a plan) does not count, as check mode never starts the work."""
    tasks = [t for t in ROLE_TASKS.get(name, []) if t.get("check_mode") is not True]
    if not tasks:
        return {}
    args = [t[key_of(t)] or {} for t in tasks]
    common = set.intersection(*(set(a) for a in args))
    return {
        k: args[0][k] for k in sorted(common) if isinstance(args[0][k], bool) and all(a[k] == args[0][k] for a in args)
    }


@pytest.mark.parametrize("name", MODULES)
def test_example_arguments_are_options_of_the_module(name):
    problems = []
    for task in examples(name):
        if (used := module_of(task)) is not None:
            problems += argument_problems(task[key_of(task)] or {}, real_spec(used)[0], f"task {task.get('name')!r}: ")
    assert not problems, f"{name}: " + "; ".join(problems)


@pytest.mark.parametrize("name", MODULES)
def test_examples_do_what_the_roles_do(name):
    problems = []
    for task in examples(name):
        if (used := module_of(task)) is None:
            continue
        args, where = task[key_of(task)] or {}, f"task {task.get('name')!r} ({used})"
        for opt, value in fixed_role_values(used).items():
            if args.get(opt, value) != value:
                problems.append(f"{where} sets {opt}: {args[opt]}, every role task {opt}: {value}")
            elif opt not in args and value != spec_default(used, opt):
                problems.append(f"{where} leaves out {opt}: {value}, which every role task passes")
        role_keywords = {k for t in ROLE_TASKS.get(used, []) for k in TASK_KEYWORDS & set(t)}
        for keyword in sorted(TASK_KEYWORDS & set(task) - role_keywords):
            problems.append(f"{where} uses {keyword}:, no role task of {used} does")
    assert not problems, f"{name}: " + "; ".join(problems)


def spec_default(name: str, opt: str):
    return real_spec(name)[0][opt].get("default")


def test_the_role_check_sees_detach():
    """The check above has something to compare: the roles run the job modules detached."""
    for name in ("llmfleet_model_stage", "llmfleet_nccl_check", "llmfleet_engine_ready"):
        assert fixed_role_values(name).get("detach") is True, name


def test_examples_pass_ansible_playbook_syntax_check(tmp_path):
    plays = [
        {"name": f"EXAMPLES of {name}", "hosts": "all", "gather_facts": False, "tasks": examples(name)}
        for name in MODULES
    ]
    playbook = tmp_path / "examples.yml"
    playbook.write_text(yaml.safe_dump(plays, sort_keys=False))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    cp = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "--syntax-check", "-i", "localhost,", str(playbook)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert cp.returncode == 0, cp.stdout + cp.stderr
